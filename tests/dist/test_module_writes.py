"""Writes into the user's module after compile reach what the engine trains, on 2 ranks
([Note: writes into the user's module] in `fxzero/runtime/module_writes.py`).

Before, three of them were lost without a word: `model.load_state_dict(sd)` after compile did
nothing at ZeRO-3 (torch copied into meta placeholders, warning only) and under mixed precision
at any stage (it wrote the compute-dtype copy, which the next step cast the old fp32 masters over);
an in-place write (`nn.init.constant_(p, ...)`) under mixed precision went the same way; and a
buffer the user replaced (`model.scale = t`) was never read by the programs and was put back at
the next step. The reference is eager PyTorch, the same writes made to its model between the
same steps (torch.optim.AdamW, the global batch in one process).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from tests.dist.harness import run_ranks
from tests.dist.reference import assert_state_close, eager_data_parallel

pytestmark = pytest.mark.timeout(300)

WORLD = 2
STEPS = 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, h):
        return h + F.relu(self.fc(self.norm(h)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, ids, y):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy((self.head(h) * self.scale).flatten(0, 1), y.flatten())


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _new_values() -> dict[str, torch.Tensor]:
    """What the program loads: another initialization, and a buffer of its own."""
    values = _net(7).state_dict()
    values["scale"] = torch.full((16,), 2.0)
    return values


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)


def _write(model: nn.Module, step: int, in_place: bool) -> None:
    """The program's writes before `step`: a load after two steps; after three, an in-place
    initialization of the head's bias (where the parameter holds a value) and a replaced buffer."""
    if step == 2:
        model.load_state_dict(_new_values())
    if step == 3:
        if in_place:
            with torch.no_grad():
                nn.init.constant_(model.head.bias, 0.25)
        model.scale = torch.full((16,), 0.5)


def _eager(in_place: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _net(0)
    return eager_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _batch, STEPS, WORLD,
                               lambda m, step: _write(m, step, in_place))


def _fp32_run(rank: int, world_size: int, stage: int, offload: str, where: str) -> dict:
    placement = {"": fxzero.Offload(),
                 "cpu": fxzero.Offload(optimizer=fxzero.Cpu()),
                 "nvme": fxzero.Offload(params=fxzero.Nvme(path=where),
                                          optimizer=fxzero.Nvme(path=where))}[offload]
    model = _net(0)
    engine = fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.AdamW(lr=1e-2), offload=placement,
                                                 cost_model=None))
    losses = []
    for step in range(STEPS):
        _write(model, step, in_place=stage != 3)
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    loss_mean = torch.stack(losses)
    torch.distributed.all_reduce(loss_mean)
    state = engine.full_state_dict()
    engine.close()
    return {"losses": (loss_mean / world_size).tolist(), "state": state}


@pytest.mark.parametrize("stage,offload", [(1, ""), (2, ""), (3, ""), (3, "cpu"), (3, "nvme")])
def test_loads_writes_and_replaced_buffers_train_as_eager_pytorch(stage, offload, tmp_path):
    ranks = run_ranks(_fp32_run, WORLD, stage, offload, str(tmp_path), timeout_s=240)
    want_losses, want_state = _eager(in_place=stage != 3)
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=0, atol=1e-5)
        assert_state_close(got["state"], want_state, f"rank {rank}")
    assert torch.equal(ranks[0]["state"]["scale"], torch.full((16,), 0.5))  # (the replaced buffer, read)


def _bf16_run(rank: int, world_size: int, stage: int) -> dict:
    config = fxzero.Config(stage=stage, optimizer=fxzero.AdamW(lr=1e-2), mixed_precision=fxzero.MixedPrecision(),
                           cost_model=None)
    model = _net(0)
    engine = fxzero.compile(model, config)
    engine.backward(engine(*_batch(0, rank)))
    engine.step()
    out: dict = {}
    model.load_state_dict(_new_values())
    out["masters"] = engine.full_state_dict()
    out["compute"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["loss"] = engine(*_batch(1, rank)).detach()
    fresh_model = _net(0)
    fresh_model.load_state_dict(_new_values())
    fresh = fxzero.compile(fresh_model, config)  # (the same values from the start: the same forward)
    out["fresh_loss"] = fresh(*_batch(1, rank)).detach()
    before = engine.full_state_dict()["head.weight"]
    try:
        with torch.no_grad():
            model.head.weight.mul_(0.5)
        engine(*_batch(2, rank))
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    out["before"], out["after"] = before, engine.full_state_dict()["head.weight"]
    engine.backward(engine(*_batch(2, rank)))  # (after a refused write the engine trains on)
    engine.step()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_under_mixed_precision_a_load_sets_the_fp32_masters_and_an_in_place_write_is_kept(stage):
    ranks = run_ranks(_bf16_run, WORLD, stage, timeout_s=240)
    want = _new_values()
    for rank, got in enumerate(ranks):
        for key, value in want.items():
            assert torch.equal(got["masters"][key], value), (rank, key)  # (exactly the file's fp32 values)
            cast = value.to(torch.bfloat16) if key != "scale" else value
            assert torch.equal(got["compute"][key], cast), (rank, key)
        assert torch.equal(got["loss"], got["fresh_loss"]), rank
        if stage == 3:  # (a sharded parameter holds no value on a rank: the write did nothing, said so)
            assert "head.weight" in got["error"] and "written in place after compile" in got["error"], got["error"]
            assert torch.equal(got["after"], got["before"])
        else:  # the written elements hold what was written (a bf16 value); the others keep the fp32 master's
            assert got["error"] is None
            written = got["before"].to(torch.bfloat16) * 0.5
            expected = torch.where(written == got["before"].to(torch.bfloat16), got["before"], written.float())
            assert torch.equal(got["after"], expected), rank
            assert not torch.equal(got["after"], got["before"])


def _forms_run(rank: int, world_size: int) -> dict:
    """load_state_dict's other forms at ZeRO-3: assign=True, a submodule's with strict=False, and
    Hugging Face's ZeRO-3 loading (GatheredParameters with modifier_rank=0, rank 0 copying in)."""
    model = _net(0)
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-2), cost_model=None))
    new = _new_values()
    weight = model.head.weight
    model.load_state_dict(new, assign=True)
    out = {"identity": model.head.weight is weight and list(engine.parameters())[-1] is model.head.bias}
    out["assigned"] = engine.full_state_dict()
    other = _net(3).state_dict()
    result = model.blocks[1].load_state_dict({"fc.weight": other["blocks.1.fc.weight"]}, strict=False)
    out["missing"] = sorted(result.missing_keys)
    out["partial"] = engine.full_state_dict()
    params = list(model.head.parameters())
    with fxzero.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.head.weight.copy_(other["head.weight"])
    out["gathered"] = engine.full_state_dict()["head.weight"]
    return out


def test_assign_a_submodules_partial_load_and_a_gathered_write_at_zero3():
    ranks = run_ranks(_forms_run, WORLD, timeout_s=240)
    new, other = _new_values(), _net(3).state_dict()
    for rank, got in enumerate(ranks):
        assert got["identity"], rank  # (assign=True keeps the engine's parameter objects)
        for key, value in new.items():
            assert torch.equal(got["assigned"][key], value), (rank, key)
        assert got["missing"] == ["fc.bias", "norm.bias", "norm.weight"]
        for key, value in new.items():
            want = other[key] if key == "blocks.1.fc.weight" else value
            assert torch.equal(got["partial"][key], want), (rank, key)
        assert torch.equal(got["gathered"], other["head.weight"]), rank


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 256), nn.Linear(256, 8)

    def forward(self, x):
        return self.down(F.relu(self.up(x))).square().mean()


def _wide(seed: int) -> Wide:
    torch.manual_seed(seed)
    return Wide()


def _tiled_run(rank: int, world_size: int) -> dict:
    model = _wide(0)
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.SGD(lr=0.0), tiling=fxzero.Tiling(max_bytes=2048),
                                                 cost_model=None))
    tiles = [layout.name for layout in engine.state.layouts if any(s.param_shape for s in layout.slots)]
    model.load_state_dict(_wide(5).state_dict())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return {"tiles": tiles, "loss": engine(x).detach(), "state": engine.full_state_dict()}


def test_a_load_reaches_a_tiled_parameters_tiles_on_every_rank():
    want = _wide(5)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for rank, got in enumerate(run_ranks(_tiled_run, WORLD, timeout_s=120)):
        assert len(got["tiles"]) > 1  # (up.weight and down.weight are tiled: units of their rows)
        for key, value in want.state_dict().items():
            assert torch.equal(got["state"][key], value), (rank, key)
        torch.testing.assert_close(got["loss"], want(x).detach(), rtol=1e-6, atol=0)


def _buffer_shape_run(rank: int, world_size: int) -> str:
    model = _net(0)
    engine = fxzero.compile(model, fxzero.Config(stage=1, cost_model=None))
    engine(*_batch(0, rank))
    model.scale = torch.ones(8)
    try:
        engine(*_batch(0, rank))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_buffer_replaced_by_another_shape_is_refused_by_name():
    message = run_ranks(_buffer_shape_run, 1, timeout_s=120)[0]
    assert "'scale'" in message and "(8,)" in message and "(16,)" in message, message


def _one_rank_loads_run(rank: int, world_size: int, stage: int) -> str:
    model = _net(0)
    engine = fxzero.compile(model, fxzero.Config(stage=stage, cost_model=None))
    if rank == 0:  # (a torch habit: load on rank 0, as before DDP broadcasts; fxzero broadcasts nothing)
        model.load_state_dict(_new_values())
    try:
        engine(*_batch(0, rank))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [1, 3])
def test_a_state_dict_loaded_on_one_rank_only_is_an_error_on_every_rank(stage):
    for rank, message in enumerate(run_ranks(_one_rank_loads_run, WORLD, stage, timeout_s=120)):
        assert "the ranks wrote different values into the model after compile: ranks [0]: values written into " \
            "blocks.0.fc.bias after compile (digest" in message, (rank, message)
        assert "ranks [1]: no such write" in message and "modifier_rank=0" in message


def _pickle_run(rank: int, world_size: int, stage: int) -> dict:
    import copy

    model = _net(0)
    engine = fxzero.compile(model, fxzero.Config(stage=stage, cost_model=None))
    out = {"deepcopy": type(copy.deepcopy(model)).__name__}  # (as before: an EMA copy, say)
    try:
        torch.save(model, io.BytesIO())
        out["save"] = None
    except TypeError as e:
        out["save"] = str(e)
    out["runs"] = bool(torch.isfinite(engine(*_batch(0, rank))))
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_pickling_the_model_after_compile_is_refused_naming_what_to_save(stage):
    """`torch.save(model)` pickles the module, whose parameters are the engine's views
    (placeholders at ZeRO-3): the file would not hold the trained model. Before, it failed with
    "Can't pickle local object '_function.<locals>.<lambda>'"."""
    got = run_ranks(_pickle_run, 1, stage, timeout_s=120)[0]
    assert got["deepcopy"] == "Net" and got["runs"]
    assert "would not hold the trained model" in got["save"] and "model.state_dict()" in got["save"], got["save"]

"""Memory-centric tiling, compiled in one process ([Note: tiling] in `fxzero/passes/tile.py`): the
tiles are nodes with their own gather / wait / free, the schedule validates, the tiled joint graph
computes what the untiled one does (forward and the weight's gradient bit for bit, the input's
gradient within 1e-6), and a bound no tile can meet is an error naming the operator."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import fxzero
from fxzero.artifacts import record
from fxzero.cli import main as cli_main
from fxzero.compiler import plan_layouts
from fxzero.config.notices import IneffectiveSetting
from fxzero.ir.layout import UnitLayout
from fxzero.passes.runner import PassContext
from fxzero.passes.tile import tile_pass
from fxzero.schedule.validate import validate
from fxzero.trace import trace_joint

pytestmark = pytest.mark.timeout(300)


class WideHead(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 256, out: int = 1024) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 32), nn.GELU(), nn.Linear(32, hidden))
                                    for _ in range(2))
        self.head = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


HEAD_BYTES = 1024 * 256 * 4  # 1 MiB
MAX_BYTES = HEAD_BYTES // 2  # tiles of 256 KiB: 4 tiles of 256 rows


def _config(max_bytes: int = MAX_BYTES, **kw) -> fxzero.Config:
    return fxzero.Config(stage=3, tiling=fxzero.Tiling(max_bytes=max_bytes), **kw)


def _compile(config: fxzero.Config, world_size: int = 2):
    torch.manual_seed(0)
    return fxzero.compile_program(WideHead(), [torch.randn(2, 8, 16)], config, world_size=world_size)


def test_the_wide_weight_is_sharded_as_units_of_rows_and_keeps_its_name():
    layouts = plan_layouts(WideHead(), _config(), world_size=2)
    tiles = [u for u in layouts if u.name.startswith("head.weight:tile")]
    assert [u.name for u in tiles] == [f"head.weight:tile{i}" for i in range(4)]
    for i, u in enumerate(tiles):
        (slot,) = u.slots
        assert (slot.fqn, slot.shape, slot.start, slot.param_shape) == ("head.weight", (256, 256), i * 256 * 256,
                                                                         (1024, 256))
        assert u.padded_numel * u.itemsize == MAX_BYTES // 2
    # The bias stays in its unit; the unit after the blocks is followed by its weight's tiles.
    tail = next(u for u in layouts if any(s.fqn == "head.bias" for s in u.slots))
    assert [s.fqn for s in tail.slots] == ["head.bias"]
    assert layouts.index(tiles[0]) == layouts.index(tail) + 1
    # The layouts (tiles too) survive the schedule's JSON.
    assert [UnitLayout.from_json(u.to_json()) for u in layouts] == layouts


def test_tiles_are_nodes_each_gathered_and_freed_on_its_own_and_the_schedule_validates():
    compiled = _compile(_config())
    schedule = compiled.schedule
    validate(schedule)
    for program in ("forward", "backward"):
        ins = schedule.program(program).instructions
        for i in range(4):
            unit = f"head.weight:tile{i}"
            (gather,) = [x for x in ins if x.unit == unit and x.kind == "all_gather"]
            (wait,) = [x for x in ins if x.kind == "wait" and x.reads == (gather.name,)]
            (free,) = [x for x in ins if x.kind == "free" and x.unit == unit]
            assert free.reads == (wait.name,), (program, unit)
            assert (gather.numel, gather.bytes) == (256 * 256, MAX_BYTES // 2), gather  # the tile's bytes only
        # Tile i's matmul runs between tile i's wait and free, and tile i is freed before tile i+2 waits:
        # never more than the tile computing and the one prefetched.
        at = {x.name: n for n, x in enumerate(ins)}
        waits = [next(at[x.name] for x in ins if x.unit == f"head.weight:tile{i}" and x.kind == "wait"
                      and x.buffer == "gathered") for i in range(4)]
        frees = [next(at[x.name] for x in ins if x.unit == f"head.weight:tile{i}" and x.kind == "free") for i in range(4)]
        assert all(w < f for w, f in zip(waits, frees))
        assert all(frees[i] < waits[i + 2] for i in range(2)), (program, waits, frees)
    # Every gradient tile is reduced on its own, as soon as it is computed.
    backward = schedule.program("backward").instructions
    assert sorted(x.unit for x in backward if x.kind == "reduce_scatter" and "tile" in x.unit) == \
        [f"head.weight:tile{i}" for i in range(4)]
    largest_other = max(u.padded_numel * u.itemsize for u in schedule.units if ":tile" not in u.name)
    assert schedule.peak_gathered_bytes <= MAX_BYTES + largest_other
    untiled = _compile(fxzero.Config(stage=3)).schedule
    assert untiled.peak_gathered_bytes >= HEAD_BYTES
    # The pass trace says what it did.
    (rec,) = [r for r in compiled.pass_trace if r.name == "tile"]
    assert rec.summary["tiles"] == 4 and rec.summary["tiled_parameters"] == 1


def test_fxzero_graph_draws_the_tiles(tmp_path):
    compiled = _compile(_config())
    art = record(compiled, model="WideHead", inputs=[], config=_config(), seconds=0.0)
    art.write(str(tmp_path / "art"))
    result = CliRunner().invoke(cli_main, ["graph", str(tmp_path / "art"), "--format", "dot", "-o", "-",
                                           "--no-collapse"])
    assert result.exit_code == 0, result.output
    for i in range(4):
        assert f"head.weight:tile{i}" in result.output


def _run_joint(gm: torch.fx.GraphModule, model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Run a joint graph on real tensors: parameters (a tile: its rows), the input, the output's gradient."""
    params = dict(model.named_parameters())
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        t = node.meta["fxzero"]
        if t["kind"] == "param":
            w = params[t["fqn"]].detach()
            shape = node.meta["val"].shape
            start = t.get("start", 0)
            args.append(w.reshape(-1)[start : start + math.prod(shape)].view(shape))
        else:
            args.append({"input": x, "grad_output": g}[t["kind"]])
    return gm(*args)


def test_tiled_joint_graph_computes_the_untiled_values():
    torch.manual_seed(0)
    model = WideHead()
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 1024)
    traced = trace_joint(model, [x])
    plain = _run_joint(traced.gm, model, x, g)
    layouts = plan_layouts(model, _config(), world_size=2)
    ctx = PassContext(layouts=layouts, signature=traced.signature, world_size=2)
    tiled_gm = tile_pass(copy.deepcopy(traced.gm), ctx).gm
    tiled_gm.recompile()
    tiled = _run_joint(tiled_gm, model, x, g)
    fqns = traced.signature.trainable_fqns
    # The forward: each output element is the same dot product by the same kernel on a slice.
    assert torch.equal(tiled[0], plain[0])
    grads = dict(zip(fqns, plain[1 : 1 + len(fqns)]))
    tiled_grads = dict(zip(fqns, tiled[1 : 1 + len(fqns)]))
    # The weight's gradient: one per tile, exactly its rows.
    assert isinstance(tiled_grads["head.weight"], list) and len(tiled_grads["head.weight"]) == 4
    assert torch.equal(torch.cat(tiled_grads["head.weight"]), grads["head.weight"])
    assert torch.equal(tiled_grads["head.bias"], grads["head.bias"])
    # Upstream of the head, the input's gradient sums the tiles' products in tile order: a reordered
    # sum's rounding is bounded relative to its terms' magnitude, not to a result that cancels to
    # near zero, so the bound is 1e-6 of the gradient's largest element (4e-7 measured here).
    for fqn in fqns:
        if fqn.startswith("head."):
            continue
        scale = grads[fqn].abs().max().item()
        torch.testing.assert_close(tiled_grads[fqn], grads[fqn], rtol=0, atol=1e-6 * scale, msg=fqn)


def test_a_bound_below_two_rows_is_an_error_naming_the_operator_and_the_fix():
    model = nn.ModuleDict({"proj": nn.Linear(4096, 8)})  # rows of 16 KiB, 128 KiB in all
    with pytest.raises(ValueError, match=r"operator proj \(Linear 4096 -> 8\) has rows of 16384 bytes.*at most "
                                         r"max_bytes // 2 = 10240 bytes.*Tiling\(max_bytes=32768\) or more"):
        plan_layouts(model, _config(max_bytes=20 << 10), world_size=2)


def test_a_bound_no_operator_exceeds_warns_once_that_it_has_no_effect():
    with pytest.warns(IneffectiveSetting, match=r"Tiling\(max_bytes=1073741824\) has no effect: no Linear's or "
                                                r"Embedding's gathered weight is larger \(the largest: head.weight, 1048576 bytes\)"):
        layouts = plan_layouts(WideHead(), _config(max_bytes=1 << 30), world_size=2)
    assert not any(":tile" in u.name for u in layouts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_layouts(WideHead(), _config(max_bytes=1 << 30), world_size=2)  # (said once per process)


def test_tiling_at_stage_2_warns_that_it_has_no_effect():
    with pytest.warns(IneffectiveSetting, match="Config.tiling has no effect at stage 2"):
        layouts = plan_layouts(WideHead(), fxzero.Config(stage=2, tiling=fxzero.Tiling(max_bytes=MAX_BYTES)), 2)
    assert not any(":tile" in u.name for u in layouts)


def test_tiling_refuses_a_weight_read_by_an_operator_it_cannot_tile():
    class Reads(WideHead):
        def forward(self, x):
            return super().forward(x) + self.head.weight.sum()

    with pytest.raises(ValueError, match=r"head.weight is read by aten.sum.default .* drop Config.tiling"):
        fxzero.compile_program(Reads(), [torch.randn(2, 8, 16)], _config(), world_size=2)


def test_tiling_config_is_checked():
    with pytest.raises(ValueError, match="Tiling.max_bytes must be a positive int"):
        fxzero.Tiling(max_bytes=0)
    with pytest.raises(TypeError, match="Config.tiling must be a fxzero.Tiling"):
        fxzero.Config(tiling=64 << 20)


def test_mixed_precision_tiles_by_the_gathered_dtype_and_a_forward_only_program_tiles_too():
    mp = fxzero.MixedPrecision(param_dtype=torch.bfloat16)
    # bf16 gathers 512 KiB of head: over MAX_BYTES // 2 = 256 KiB, 4 tiles of 128 KiB (256 rows each).
    compiled = _compile(_config(max_bytes=MAX_BYTES // 2, mixed_precision=mp))
    validate(compiled.schedule)
    tiles = [u for u in compiled.layouts if ":tile" in u.name]
    assert len(tiles) == 4 and all(u.dtype == torch.float32 and u.slots[0].shape == (256, 256) for u in tiles)
    gathers = [x for x in compiled.schedule.program("forward").instructions if x.kind == "all_gather" and ":tile" in x.unit]
    assert [x.bytes for x in gathers] == [256 * 256 * 2] * 4  # (the bf16 copy is what is gathered)
    torch.manual_seed(0)
    evaluation = fxzero.compile_program(WideHead(), [torch.randn(2, 8, 16)], _config(), world_size=2, forward_only=True)
    validate(evaluation.schedule)
    assert sorted(x.unit for x in evaluation.schedule.program("forward").instructions
                  if x.kind == "all_gather" and ":tile" in x.unit) == [f"head.weight:tile{i}" for i in range(4)]


class TiedLM(nn.Module):
    """An embedding and an LM head sharing one 1024 x 64 weight (256 KiB), a small block between."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1024, 64, padding_idx=3)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 1024, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)))


def test_a_tied_embedding_and_head_tile_together_and_compute_the_untied_values():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 1024, (2, 16))
    ids[0, :3] = 3  # (the padding row gets no gradient)
    config = _config(max_bytes=128 << 10)  # tiles of 64 KiB: 4 tiles of 256 rows
    layouts = plan_layouts(model, config, world_size=2)
    assert [u.name for u in layouts if ":tile" in u.name] == [f"emb.weight:tile{i}" for i in range(4)]
    traced = trace_joint(model, [ids])
    g = torch.randn(2, 16, 1024)
    plain = _run_joint(traced.gm, model, ids, g)
    tiled_gm = tile_pass(copy.deepcopy(traced.gm), PassContext(layouts=layouts, signature=traced.signature,
                                                               world_size=2)).gm
    tiled_gm.recompile()
    tiled = _run_joint(tiled_gm, model, ids, g)
    assert torch.equal(tiled[0], plain[0])  # lookups are selections, the head's columns the same dot products
    fqns = traced.signature.trainable_fqns
    grads, tiled_grads = dict(zip(fqns, plain[1:])), dict(zip(fqns, tiled[1:]))
    # The tied weight's gradient is the head's rows plus the lookups' rows; the lookups' part comes
    # through the head's input gradient (a reordered sum), so all of it is within 1e-6 of its scale.
    tiled_grads["emb.weight"] = torch.cat(tiled_grads["emb.weight"])
    for fqn in ("emb.weight", "block.0.weight", "block.0.bias"):
        scale = grads[fqn].abs().max().item()
        torch.testing.assert_close(tiled_grads[fqn], grads[fqn], rtol=0, atol=1e-6 * scale, msg=fqn)
    compiled = fxzero.compile_program(model, [ids], config, world_size=2)
    validate(compiled.schedule)


def test_an_embedding_tiles_its_lookups_and_its_gradient_bit_for_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1024, 64, padding_idx=300), nn.Linear(64, 8))
    ids = torch.randint(0, 1024, (2, 16))
    ids[0, :3] = 300  # (the padding row, in tile 1, gets no gradient)
    ids[1, :4] = 5  # (a row looked up four times: its gradient sums them in the same order)
    layouts = plan_layouts(model, _config(max_bytes=128 << 10), world_size=2)
    ctx = PassContext(layouts=layouts, signature=None, world_size=2)
    traced = trace_joint(model, [ids])
    ctx.signature = traced.signature
    g = torch.randn(2, 16, 8)
    plain = _run_joint(traced.gm, model, ids, g)
    tiled_gm = tile_pass(copy.deepcopy(traced.gm), ctx).gm
    tiled_gm.recompile()
    tiled = _run_joint(tiled_gm, model, ids, g)
    assert torch.equal(tiled[0], plain[0])
    grads, tiled_grads = dict(zip(traced.signature.trainable_fqns, plain[1:])), dict(zip(traced.signature.trainable_fqns, tiled[1:]))
    assert len(tiled_grads["0.weight"]) == 4
    assert torch.equal(torch.cat(tiled_grads["0.weight"]), grads["0.weight"])
    assert not grads["0.weight"][300].any()


def test_a_tiled_operator_that_is_the_models_output_trains_as_untiled():
    """A 2-D input makes the head's `addmm` itself the model's output (a 3-D one ends in a view):
    the pass replaced it with its tiles' concatenation and then wrote back the output list it had
    read before, naming the erased `addmm` ("used before it has been defined")."""
    runs = []
    for tiling in (None, fxzero.Tiling(max_bytes=MAX_BYTES)):
        torch.manual_seed(0)
        model = WideHead()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        engine = fxzero.compile(model, fxzero.Config(stage=3, tiling=tiling, optimizer=fxzero.AdamW(lr=1e-3)),
                                state_dict=state)
        losses = []
        for step in range(3):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(step))
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs.append((losses, engine.full_state_dict()))
    (plain, plain_state), (tiled, tiled_state) = runs
    assert tiled == plain  # (the forward's outputs are the same dot products: equal losses)
    for key, want in plain_state.items():
        torch.testing.assert_close(tiled_state[key], want, rtol=0, atol=1e-6, msg=key)

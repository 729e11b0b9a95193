"""DeepSpeed's namespace on fxzero, used as DeepSpeed programs use it, on 2 ranks at ZeRO-3 (and 1).

`fxzero.zero.Init` / `GatheredParameters`, `fxzero.utils.safe_get_full_*`, the Engine calls
DeepSpeed scripts make (`no_sync`, `was_step_applied`, attribute forwarding), and the global RNG
left alone by `initialize`. References are eager torch: the same model built eagerly after the
same seed, `torch.optim.AdamW` on the whole batch.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
import fxzero.comm as ds_comm
from fxzero.accelerator import get_accelerator
from fxzero.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                          safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                          safe_set_full_fp32_param, safe_set_full_grad, safe_set_local_fp32_param, safe_set_local_grad,
                          safe_set_local_optimizer_state, safe_update_full_grad_vectorized)
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.reference import rank_slice

pytestmark = pytest.mark.timeout(300)

DS = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,  # (DeepSpeed clips at 1.0 unless told)
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
      "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}}}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.tanh(layer(x))
        return x


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(steps)]


def _eager(model: nn.Module, batches, steps_before_grads: int) -> dict:
    """AdamW on the whole batch: the weights, and the gradient and moment after `steps_before_grads` steps."""
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    out = {}
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if i == steps_before_grads:
            out["grad"] = model.layers[1].weight.grad.clone()
        opt.step()
        if i == steps_before_grads:
            out["exp_avg"] = opt.state[model.layers[1].weight]["exp_avg"].clone()
    out["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _namespace(rank: int, world_size: int) -> dict:
    out: dict = {}
    # zero.Init: nothing allocated, values and the RNG afterwards as eager construction's.
    torch.manual_seed(3)
    with fxzero.zero.Init(config_dict_or_path=DS):
        model = Net()
    out["meta_after_init"] = all(p.is_meta for p in model.parameters())
    out["rng_after_init"] = torch.rand(3)
    torch.manual_seed(5)
    parser = fxzero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    engine, _, _, _ = fxzero.initialize(args=args, model=model, model_parameters=model.parameters())
    out["rng_after_initialize"] = torch.rand(3)  # initialize draws nothing from the global RNG
    out["initial"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    out["dist"] = (ds_comm.get_rank(), ds_comm.get_world_size(), get_accelerator().communication_backend_name())
    batches = _batches()
    for i, (x, y) in enumerate(batches):
        engine.backward(F.mse_loss(engine(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)))
        if i == 1:
            out["grad"] = safe_get_full_grad(model.layers[1].weight)
        engine.step()
        out.setdefault("applied", []).append(engine.was_step_applied())
        if i == 1:
            out["exp_avg"] = safe_get_full_optimizer_state(model.layers[1].weight, "exp_avg")
    out["grad_after_step"] = safe_get_full_grad(model.layers[1].weight)
    out["trained"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    out["fp32"] = safe_get_full_fp32_param(model.layers[1].weight)
    # GatheredParameters: read; write on rank 0 only (kept); write without a modifier (dropped).
    with fxzero.zero.GatheredParameters(model.layers[0].weight, modifier_rank=0):
        out["gathered"] = model.layers[0].weight.detach().clone()
        if rank == 0:
            model.layers[0].weight.data.mul_(2.0)
    with fxzero.zero.GatheredParameters(list(model.layers[2].parameters()), modifier_rank=None):
        model.layers[2].bias.data.fill_(123.0)
    out["after_gather"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    out["placeholder_again"] = model.layers[0].weight.is_meta
    safe_set_full_fp32_param(model.layers[2].bias, torch.arange(4.0))
    out["set_bias"] = safe_get_full_fp32_param(model.layers[2].bias)
    x, _ = batches[0]
    out["forward_after"] = engine(rank_slice(x, rank, world_size)).detach()
    out["forwarded_attr"] = engine.layers is model.layers and not engine.bfloat16_enabled()
    return out


@pytest.fixture(scope="module")
def runs():
    return {w: run_ranks(_namespace, w, timeout_s=240) for w in (2, 1)}


def _eager_reference() -> tuple[nn.Module, dict, torch.Tensor]:
    torch.manual_seed(3)
    model = Net()
    rng_after = torch.rand(3)
    initial = copy.deepcopy(model)
    return initial, _eager(model, _batches(), steps_before_grads=1), rng_after


@pytest.mark.parametrize("world", [2, 1])
def test_zero_init_builds_what_eager_construction_builds_and_leaves_the_rng_there(runs, world):
    initial, _, rng_after = _eager_reference()
    torch.manual_seed(5)
    untouched = torch.rand(3)
    for rank, r in enumerate(runs[world]):
        assert r["meta_after_init"]
        assert torch.equal(r["rng_after_init"], rng_after), "the RNG after zero.Init is eager construction's"
        assert torch.equal(r["rng_after_initialize"], untouched), "initialize drew from the global RNG"
        for k, v in initial.state_dict().items():
            assert torch.equal(r["initial"][k], v), k
        assert r["dist"] == (rank, world, "gloo")


@pytest.mark.parametrize("world", [2, 1])
def test_safe_get_full_values_are_eager_torchs(runs, world):
    _, ref, _ = _eager_reference()
    for r in runs[world]:
        torch.testing.assert_close(r["grad"], ref["grad"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["exp_avg"], ref["exp_avg"], rtol=1e-5, atol=1e-8)
        assert r["grad_after_step"] is None  # (step() consumed the gradients, as DeepSpeed's zero_grad does)
        for k, v in ref["weights"].items():
            torch.testing.assert_close(r["trained"][k], v, rtol=1e-5, atol=1e-6)
        assert torch.equal(r["fp32"], r["trained"]["layers.1.weight"])
        assert r["applied"] == [True, True, True]


@pytest.mark.parametrize("world", [2, 1])
def test_gathered_parameters_read_and_the_modifiers_writes_land_in_every_shard(runs, world):
    for r in runs[world]:
        trained, after = r["trained"], r["after_gather"]
        assert torch.equal(r["gathered"], trained["layers.0.weight"])
        assert torch.equal(after["layers.0.weight"], trained["layers.0.weight"] * 2), "rank 0's write is kept"
        assert torch.equal(after["layers.2.bias"], trained["layers.2.bias"]), "no modifier: the write is dropped"
        assert r["placeholder_again"]
        assert torch.equal(r["set_bias"], torch.arange(4.0))
    # The program computes with what was written: the engine's forward is eager's with those weights.
    x, _ = _batches()[0]
    model = Net()
    model.load_state_dict({**runs[world][0]["after_gather"], "layers.2.bias": torch.arange(4.0)})
    with torch.no_grad():
        want = model(x)
    got = torch.cat([r["forward_after"] for r in runs[world]])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_engine_answers_what_deepspeed_scripts_ask(runs):
    assert all(r["forwarded_attr"] for r in runs[2])


def _no_sync(rank: int, world_size: int) -> dict:
    """Two micro-batches under no_sync then one outside, one step; against three accumulated."""
    out = {}
    for mode in ("no_sync", "accumulate"):
        torch.manual_seed(3)
        model = Net()
        ds = {**DS, "gradient_accumulation_steps": 3 if mode == "accumulate" else 1,
              "zero_optimization": {"stage": 1}}
        engine, *_ = fxzero.initialize(model=model, config=ds)
        batches = _batches()
        for i, (x, y) in enumerate(batches):
            loss = F.mse_loss(engine(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)) / 3
            if mode == "no_sync" and i < 2:
                with engine.no_sync():
                    engine.backward(loss)
                    if i == 0:
                        try:
                            engine.step()
                        except RuntimeError as e:
                            out["step_inside"] = str(e)
                continue
            # (accumulating: the engine divides by 3 itself, so give it the undivided loss)
            engine.backward(loss * 3 if mode == "accumulate" else loss)
            engine.step()
            out.setdefault(f"{mode}_applied", []).append(engine.was_step_applied())
        out[mode] = engine.full_state_dict()
    return out


def test_no_sync_accumulates_unreduced_and_the_next_backward_reduces(tmp_path):
    for r in run_ranks(_no_sync, 2, timeout_s=240):
        for k, v in r["accumulate"].items():
            torch.testing.assert_close(r["no_sync"][k], v, rtol=1e-6, atol=1e-7)
        assert r["no_sync_applied"] == [True] and r["accumulate_applied"] == [False, False, True]
        assert "inside engine.no_sync()" in r["step_inside"]


def _gather_before_initialize(rank: int, world_size: int) -> dict:
    """What from_pretrained at ZeRO-3 does: in zero.Init, then each module gathered with rank 0 as
    modifier writing the checkpoint's values; one gather with rank 1 as modifier; one read."""
    torch.manual_seed(3)
    with fxzero.zero.Init(config_dict_or_path=DS):
        model = Net()
    out = {"meta_before": all(p.is_meta for p in model.parameters())}
    for i, layer in enumerate(model.layers):
        with torch.no_grad(), fxzero.zero.GatheredParameters(list(layer.parameters()), modifier_rank=0):
            out.setdefault("whole_inside", []).append(not layer.weight.is_meta)
            if i == 0:
                out["init_seen"] = layer.weight.clone()  # (its own init, broadcast from the holder)
            if rank == 0:
                layer.weight.fill_(float(i + 1))
                layer.bias.fill_(-1.0)
    out["meta_after_on_rank"] = [p.is_meta for p in model.parameters()]
    with torch.no_grad(), fxzero.zero.GatheredParameters(model.layers[1].weight, modifier_rank=1):
        if rank == 1:
            model.layers[1].weight[0].fill_(7.0)
    with torch.no_grad(), fxzero.zero.GatheredParameters(model.layers[2].weight, modifier_rank=None):
        out["read"] = model.layers[2].weight.clone()
        model.layers[2].weight.zero_()  # (dropped)
    engine, *_ = fxzero.initialize(model=model, config=DS)
    out["full"] = engine.full_state_dict()
    return out


def test_gathering_before_initialize_keeps_the_model_whole_on_one_rank(tmp_path):
    """[Note: gathering before initialize] in fxzero/zero.py, on 2 ranks: rank 0 holds the model
    whole, rank 1 holds each gathered layer only inside its block, and initialize shards what
    the modifiers wrote."""
    torch.manual_seed(3)
    eager = Net()
    ranks = run_ranks(_gather_before_initialize, 2, timeout_s=240)
    for rank, r in enumerate(ranks):
        assert r["meta_before"] and r["whole_inside"] == [True, True, True]
        assert torch.equal(r["init_seen"], eager.layers[0].weight)
        assert r["meta_after_on_rank"] == [rank != 0] * 6
        assert torch.equal(r["read"], torch.full((4, 16), 3.0))
        full = r["full"]
        want1 = torch.full((16, 16), 2.0)
        want1[0] = 7.0
        assert torch.equal(full["layers.0.weight"], torch.full((16, 8), 1.0))
        assert torch.equal(full["layers.1.weight"], want1) and torch.equal(full["layers.2.weight"], torch.full((4, 16), 3.0))
        assert all(torch.equal(full[f"layers.{i}.bias"], -torch.ones_like(full[f"layers.{i}.bias"])) for i in range(3))


def test_the_deepspeed_alias_names_what_fxzero_lacks():
    import subprocess
    import sys

    code = ("from fxzero.deepspeed_alias import install; install()\n"
            "import deepspeed, fxzero; assert deepspeed is fxzero\n"
            "from deepspeed.accelerator import get_accelerator; import deepspeed.comm as dist\n"
            "assert dist is fxzero.comm and deepspeed.zero.Init is fxzero.zero.Init\n"
            "try:\n    import deepspeed.ops.transformer\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "No module named 'deepspeed.ops.transformer'" in proc.stdout and "deepspeed.zero" in proc.stdout
    assert "deepspeed.ops.adam" in proc.stdout  # (what it has, named)


def _local_parts(rank: int, world_size: int, stage: int) -> dict:
    """DeepSpeed's local API (`safe_get_local_*`, `safe_set_local_grad`) and `safe_set_full_grad`."""
    torch.manual_seed(3)
    model = Net()
    ds = {**DS, "zero_optimization": {**DS["zero_optimization"], "stage": stage}}
    engine, _, _, _ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=ds)
    weight = model.layers[1].weight
    out = {"before_backward": safe_get_local_grad(weight)}
    x, y = _batches()[0]
    engine.backward(F.mse_loss(engine(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)))
    out["grad"], out["local_grad"] = safe_get_full_grad(weight), safe_get_local_grad(weight)
    out["fp32"], out["local_fp32"] = safe_get_full_fp32_param(weight), safe_get_local_fp32_param(weight)
    safe_set_full_grad(weight, torch.full((16, 16), 0.5))
    out["set_full"] = safe_get_full_grad(weight)
    local = safe_get_local_grad(weight)
    safe_set_local_grad(weight, torch.full_like(local, float(rank + 1)))
    out["set_local"] = safe_get_full_grad(weight)
    engine.step()
    out["exp_avg"] = safe_get_full_optimizer_state(weight, "exp_avg")
    out["local_exp_avg"] = safe_get_local_optimizer_state(weight, "exp_avg")
    out["after_step"] = safe_get_local_grad(weight)
    safe_set_local_optimizer_state(weight, torch.full_like(out["local_exp_avg"], float(rank + 1)), "exp_avg")
    out["set_exp_avg"] = safe_get_full_optimizer_state(weight, "exp_avg")
    # (ZeRO-2 holds the unit whole on every rank: each rank's copy takes every rank's part)
    safe_set_local_fp32_param(weight, torch.full_like(safe_get_local_fp32_param(weight), float(rank + 1)))
    out["set_local_fp32"] = safe_get_full_fp32_param(weight)
    with fxzero.zero.GatheredParameters([weight]):
        out["set_local_computes_with"] = weight.detach().clone()
    return out


@pytest.mark.parametrize("stage", [3, 2])
def test_each_ranks_local_part_and_the_gradients_a_script_sets(stage):
    ranks = run_ranks(_local_parts, 2, stage, timeout_s=240)
    assert all(r["before_backward"] is None and r["after_step"] is None for r in ranks)
    for key, local in (("grad", "local_grad"), ("fp32", "local_fp32"), ("exp_avg", "local_exp_avg")):
        # (the unit's flat buffer is the weight's 256 elements then the bias's, split in two)
        assert torch.equal(torch.cat([ranks[0][local], ranks[1][local]]), ranks[0][key].reshape(-1)), key
        assert ranks[0][local].numel() == 136
    for r in ranks:
        assert torch.equal(r["set_full"], torch.full((16, 16), 0.5))
        want = torch.cat([torch.full((136,), 1.0), torch.full((120,), 2.0)]).reshape(16, 16)
        assert torch.equal(r["set_local"], want)
        # AdamW's first moment after one step is (1 - beta1) times the gradient it applied
        torch.testing.assert_close(r["exp_avg"], want * (1 - ADAMW["betas"][0]))
        assert torch.equal(r["set_exp_avg"], want)  # (each rank's part written: rank + 1)
        assert torch.equal(r["set_local_fp32"], want) and torch.equal(r["set_local_computes_with"], want)


def _frozen_and_vectorized(rank: int, world_size: int, stage: int) -> dict:
    """DeepSpeed's safe_get_* of a frozen parameter, and safe_update_full_grad_vectorized."""
    torch.manual_seed(3)
    model = Net()
    model.layers[0].weight.requires_grad_(False)
    ds = {**DS, "zero_optimization": {**DS["zero_optimization"], "stage": stage}}
    engine, _, _, _ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=ds)
    x, y = _batches()[0]
    engine.backward(F.mse_loss(engine(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)))
    frozen = model.layers[0].weight
    out = {"frozen": [safe_get_full_fp32_param(frozen), safe_get_full_grad(frozen), safe_get_local_fp32_param(frozen),
                      safe_get_local_grad(frozen)]}
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: safe_get_full_grad(p) for n, p in trained.items()}
    seen = []
    safe_update_full_grad_vectorized(list(model.parameters()), lambda grad, param: seen.append(param) or grad * 2 + 1)
    out["updated"] = {n: (safe_get_full_grad(p), before[n] * 2 + 1) for n, p in trained.items()}
    out["called_for"] = [id(p) for p in seen] == [id(p) for p in trained.values()]
    engine.step()
    out["frozen"] += [safe_get_full_optimizer_state(frozen, "exp_avg"), safe_get_local_optimizer_state(frozen, "exp_avg")]
    return out


@pytest.mark.parametrize("stage", [3, 2])
def test_a_frozen_parameter_has_no_training_state_and_grads_update_in_one_call(stage):
    for r in run_ranks(_frozen_and_vectorized, 2, stage, timeout_s=240):
        assert r["frozen"] == [None] * 6  # (as DeepSpeed's: its optimizer never holds a frozen parameter)
        assert r["called_for"]  # (each parameter that requires grad, once, in order)
        for name, (got, want) in r["updated"].items():
            assert torch.equal(got, want), name

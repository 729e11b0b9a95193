"""The optimizers on shards and on every tier: Adagrad against eager torch.optim.Adagrad, on 2
gloo ranks, and what its one state per element costs against AdamW's two.

One spawn trains every scenario in turn (a module-scoped fixture), each with its own engine on
the tiny GPT (cost model pinned to None): Adagrad with lr_decay, weight_decay and
initial_accumulator_value all set, at stage 3 and stage 1 with its states on the device, in host
memory and on NVMe, with parameters and states on NVMe, updated inside the backward
(`Offload(step_in_backward=True)`), and with two param groups (a torch.optim.Adagrad handed to
`fxzero.initialize`). The reference is one eager model over each step's whole global batch (the
GPT has no buffers, so data parallelism over equal micro-batches is exactly that) trained by
torch.optim.Adagrad. Single-process tests below read an Adagrad from a DeepSpeed config.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero import estimate, zoo
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.reference import (
    assert_losses_close,
    assert_state_close,
    clone_state_dict,
    eager_gpt_reference,
    lm_loss,
    make_gpt_batches,
    rank_slice,
)

WORLD = 2
STEPS = 5
GLOBAL = 8  # rows per step over both ranks
STATE_ATOL = 1e-5  # (and losses to rtol 1e-5: assert_losses_close's default)

ADAGRAD: dict[str, Any] = dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1, eps=1e-10)
"""Keyword arguments of torch.optim.Adagrad (the reference) and fxzero.Adagrad alike: every
option that changes the arithmetic away from its default."""
SMALL_LR = dict(lr=0.02, weight_decay=0.0)
"""The second param group's (biases and norms): its own lr, no decay."""

# name -> (stage, offload given the nvme directory)
SCENARIOS: dict[str, tuple[int, Any]] = {
    "device": (3, lambda d: fxzero.Offload()),
    "cpu": (3, lambda d: fxzero.Offload(optimizer=fxzero.Cpu())),
    "nvme": (3, lambda d: fxzero.Offload(optimizer=fxzero.Nvme(path=d))),
    "stage1-device": (1, lambda d: fxzero.Offload()),
    "stage1-cpu": (1, lambda d: fxzero.Offload(optimizer=fxzero.Cpu())),
    "stage1-nvme": (1, lambda d: fxzero.Offload(optimizer=fxzero.Nvme(path=d))),
    "params-and-states-nvme": (3, lambda d: fxzero.Offload(params=fxzero.Nvme(path=d), optimizer=fxzero.Nvme(path=d))),
    "groups": (3, lambda d: fxzero.Offload()),
    "step-in-backward": (3, lambda d: fxzero.Offload(params=fxzero.Nvme(path=d), optimizer=fxzero.Nvme(path=d),
                                                    step_in_backward=True)),
}
"""Adagrad runs. "stage1-device" is built from a DeepSpeed config; "groups" goes through
fxzero.initialize with a torch.optim.Adagrad of two param groups."""

def _model_fn():
    return zoo.build("gpt-tiny")


@functools.cache
def _problem() -> tuple[dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    return clone_state_dict(_model_fn()), make_gpt_batches(zoo.GPT_SIZES["tiny"], STEPS, GLOBAL, seed=3)


def _groups(named) -> list[dict]:
    """Matrices with the optimizer's own settings; biases and norms with `SMALL_LR`'s."""
    named = list(named)
    return [{"params": [p for _, p in named if p.ndim >= 2]},
            {"params": [p for _, p in named if p.ndim < 2], **SMALL_LR}]


# -- the eager reference ---------------------------------------------------------------------


@functools.cache
def _eager(groups: bool) -> dict[str, Any]:
    state, batches = _problem()

    def adagrad(model):
        return torch.optim.Adagrad(_groups(model.named_parameters()) if groups else model.parameters(), **ADAGRAD)

    return eager_gpt_reference(_model_fn, state, batches, make_optimizer=adagrad)


# -- what each rank runs ---------------------------------------------------------------------


def _engine(name: str, nvme_dir: str) -> Any:
    state, _ = _problem()
    stage, offload = SCENARIOS[name]
    cfg = fxzero.Config(stage=stage, optimizer=fxzero.Adagrad(**ADAGRAD), offload=offload(nvme_dir), cost_model=None)
    if name == "stage1-device":  # the same Config, read from DeepSpeed's keys
        ds = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0,  # (DeepSpeed clips at 1.0 unless told)
              "optimizer": {"type": "Adagrad", "params": ADAGRAD}}
        read = fxzero.Config.from_deepspeed(ds)
        assert read.optimizer == cfg.optimizer and read.stage == 1, read
        cfg = dataclasses.replace(read, cost_model=None)
    if name == "groups":  # DeepSpeed's entry point, with a torch optimizer on an eager model
        model = _model_fn()
        model.load_state_dict(state)
        torch_opt = torch.optim.Adagrad(_groups(model.named_parameters()), **ADAGRAD)
        engine, optimizer, _, _ = fxzero.initialize(model=model, optimizer=torch_opt, config=cfg)
        assert optimizer is engine.optimizer and engine.config.optimizer == fxzero.Adagrad(**ADAGRAD)
        return engine
    with torch.device("meta"):
        model = _model_fn()
    return fxzero.compile(model, config=cfg, state_dict=state)


def _train(rank: int, name: str, nvme_dir: str) -> dict[str, Any]:
    _, batches = _problem()
    engine = _engine(name, nvme_dir)
    losses, lrs = [], []
    for x, y in batches:
        lrs.append(engine.get_lr())
        loss = lm_loss(engine(rank_slice(x, rank, WORLD)), rank_slice(y, rank, WORLD))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    full = engine.full_state_dict()
    out = {"losses": (stacked / WORLD).tolist(), "lrs": lrs, "groups": [dict(g, params=None) for g in
                                                                      engine.optimizer.param_groups],
           "state_dict": {k: v.clone() for k, v in full.items()} if rank == 0 else None}
    engine.close()
    return out


def _memory(rank: int, optimizer: Any, offload: Any) -> dict[str, Any]:
    """Memory of one engine after a step and another backward (gradients held, states exist),
    with the estimate's figures for the same layouts."""
    state, batches = _problem()
    with torch.device("meta"):
        model = _model_fn()
    engine = fxzero.compile(model, config=fxzero.Config(stage=3, optimizer=optimizer, offload=offload, cost_model=None),
                            state_dict=state)
    x, y = (rank_slice(t, rank, WORLD) for t in batches[0])
    for _ in range(2):
        engine.backward(lm_loss(engine(x), y))
        if _ == 0:
            engine.step()
    states = estimate.runtime_model_states(engine.layouts, 3, optimizer=optimizer)
    out = {"memory": engine.memory_report(),
           "shard_numel": sum(lay.shard_numel for lay in engine.layouts if lay.trainable),
           "estimate": dataclasses.asdict(states),
           "placed": estimate.place(states, 3, offload).to_json(),
           "itemsize": engine.layouts[0].itemsize}
    engine.close()
    return out


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SCENARIOS:  # step-in-backward last: it may fail (STEP_IN_BACKWARD_BUG)
        nvme_dir = os.path.join(tempfile.gettempdir(), f"fxzero-test-optimizers-{os.getppid()}-{name}")
        if rank == 0:
            os.makedirs(nvme_dir, exist_ok=True)
        dist.barrier()
        out[name] = _train(rank, name, nvme_dir)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    nvme_dir = os.path.join(tempfile.gettempdir(), f"fxzero-test-optimizers-{os.getppid()}-memory")
    os.makedirs(nvme_dir, exist_ok=True)
    dist.barrier()
    for opt_name, policy in (("adagrad", fxzero.Adagrad(**ADAGRAD)), ("adamw", fxzero.AdamW(**ADAMW))):
        out[f"memory-{opt_name}"] = _memory(rank, policy, fxzero.Offload())
        out[f"memory-{opt_name}-nvme"] = _memory(rank, policy, fxzero.Offload(optimizer=fxzero.Nvme(path=nvme_dir)))
        dist.barrier()
    if rank == 0:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout_s=900)



# -- tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "groups"])
def test_adagrad_equals_torch_adagrad(runs, name):
    got = runs[0][name]
    ref = _eager(groups=False)
    assert_losses_close(got["losses"], ref["losses"], f"{name}: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], name)
    assert runs[1][name]["losses"] == got["losses"]


@pytest.mark.timeout(900)
def test_adagrad_param_groups_are_honoured(runs):
    ref = _eager(groups=True)
    got = runs[0]["groups"]
    assert_losses_close(got["losses"], ref["losses"], "Adagrad param groups: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], "groups")
    assert got["lrs"][0] == [ADAGRAD["lr"], SMALL_LR["lr"]]
    # Each group carries Adagrad's hyperparameters (its own where it set them), no betas.
    first, second = got["groups"]
    assert {k: first[k] for k in ("lr", "lr_decay", "eps", "weight_decay")} == {
        k: ADAGRAD[k] for k in ("lr", "lr_decay", "eps", "weight_decay")}
    assert second["lr"] == SMALL_LR["lr"] and second["weight_decay"] == 0.0 and second["lr_decay"] == ADAGRAD["lr_decay"]
    assert "betas" not in first
    # The groups make a difference: the single-group reference is elsewhere.
    assert not all(torch.allclose(a, b, atol=STATE_ATOL) for a, b in
                   zip(ref["state_dict"].values(), _eager(groups=False)["state_dict"].values()))


@pytest.mark.timeout(900)
def test_adagrad_keeps_one_state_per_element_and_the_estimate_agrees(runs):
    for rank in range(WORLD):
        adagrad, adamw = runs[rank]["memory-adagrad"], runs[rank]["memory-adamw"]
        numel, itemsize = adagrad["shard_numel"], adagrad["itemsize"]
        assert itemsize == 4
        assert adagrad["memory"]["optimizer_states"] == 4 * numel  # "sum"
        assert adamw["memory"]["optimizer_states"] == 2 * 4 * numel  # exp_avg, exp_avg_sq
        for run in (adagrad, adamw):
            assert run["memory"]["optimizer_states"] == run["estimate"]["optimizer"]
            assert run["memory"]["model_states"] == sum(run["estimate"].values())
        # fp32 at stage 3: 4 + 4 + 4 bytes per element for Adagrad, 4 + 4 + 8 for AdamW.
        assert adagrad["memory"]["model_states"] == 12 * numel
        assert adamw["memory"]["model_states"] == 16 * numel
        # On NVMe: the states and the gradients that go with them, as the estimate places them.
        for name, states in (("memory-adagrad-nvme", 1), ("memory-adamw-nvme", 2)):
            run = runs[rank][name]
            assert run["memory"]["optimizer_states"] == 0
            assert run["memory"]["offloaded"] == {"nvme": (states + 1) * 4 * numel}, name
            assert run["placed"]["nvme"] == run["memory"]["offloaded"]["nvme"]
            assert run["placed"]["device"] == run["memory"]["param_shards"]


# -- single-process: the policy and its DeepSpeed reading --------------------------------------


@pytest.mark.timeout(60)
def test_paper_figures_for_adagrad():
    phi, n = 1e9, 8
    adagrad = fxzero.Adagrad()
    assert estimate.bytes_per_param("fp32", adagrad) == (4, 4, 4)
    assert estimate.bytes_per_param("mixed", adagrad) == (2, 2, 8)
    assert estimate.paper_model_states(phi, n, 3, "fp32", optimizer=adagrad).total == pytest.approx(12 * phi / n)
    assert estimate.paper_model_states(phi, n, 3, "fp32").total == pytest.approx(16 * phi / n)
    assert estimate.paper_model_states(phi, n, 1, "mixed", optimizer=adagrad).total == pytest.approx(
        4 * phi + 8 * phi / n)


@pytest.mark.timeout(60)
def test_adagrad_declares_its_state_and_initial_value():
    policy = fxzero.Adagrad(initial_accumulator_value=0.25)
    assert policy.states == ("sum",) and fxzero.AdamW().states == fxzero.Adam().states == ("exp_avg", "exp_avg_sq")
    assert policy.initial_value("sum") == 0.25 and fxzero.AdamW().initial_value("exp_avg") == 0.0
    assert set(policy.defaults()) == {"lr", "lr_decay", "eps", "weight_decay"}
    # Its state goes where Offload(optimizer=...) says.
    assert fxzero.Offload(optimizer=fxzero.Cpu()).tiers(optimizer=policy) == {"sum": "cpu", "grad": "cpu"}
    with pytest.raises(ValueError, match="Adagrad.lr_decay must be >= 0"):
        fxzero.Adagrad(lr_decay=-0.1)
    with pytest.raises(TypeError, match=r"Config.optimizer must be an fxzero optimizer policy \(fxzero.AdamW, fxzero.Adam, "):
        fxzero.Config(optimizer=torch.optim.SGD)


@pytest.mark.timeout(60)
def test_deepspeed_adagrad_is_read_strictly():
    cfg = fxzero.Config.from_deepspeed({"optimizer": {"type": "Adagrad", "params": ADAGRAD}})
    assert cfg.optimizer == fxzero.Adagrad(**ADAGRAD)
    assert fxzero.Config.from_deepspeed({"optimizer": {"type": "adagrad"}}).optimizer == fxzero.Adagrad()
    with pytest.raises(ValueError, match="optimizer.params has no 'lr_decy' for Adagrad; did you mean 'lr_decay'"):
        fxzero.Config.from_deepspeed({"optimizer": {"type": "Adagrad", "params": {"lr_decy": 0.1}}})
    with pytest.raises(ValueError, match="optimizer.params has no 'betas' for Adagrad"):
        fxzero.Config.from_deepspeed({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})


@pytest.mark.timeout(60)
def test_a_param_group_takes_only_its_optimizers_options():
    from fxzero.runtime.optimizer import ShardedOptimizer

    with pytest.raises(ValueError, match=r"unknown option\(s\) \['betas'\]; Adagrad's param groups take"):
        ShardedOptimizer(fxzero.Adagrad(), [{"betas": (0.9, 0.99)}])
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['lr_decay'\]; AdamW's param groups take"):
        ShardedOptimizer(fxzero.AdamW(), [{"lr_decay": 0.1}])
    groups = ShardedOptimizer(fxzero.Adagrad(lr=0.1), [{}, {"lr": 0.5}]).param_groups
    assert [g["lr"] for g in groups] == [0.1, 0.5] and groups[1]["lr_decay"] == 0.0

"""Element-wise torch optimizers on shards, on 2 gloo ranks: training parity with eager torch,
on every tier, and their states through a checkpoint.

The update's arithmetic is pinned bit for bit on shards in tests/passes/test_shard_updates.py;
here each optimizer's states go through the machinery around it: SGD's momentum buffer, created
at the first step (on the device and in host memory), SGD without momentum (no state at all, with
Offload(optimizer=Cpu())), NAdam's mu_product and ASGD's eta and mu (one number per parameter in
torch, kept per element: on NVMe, parameters too), RMSprop's optional states at stage 1, AMSGrad's
third state, Lion (no torch implementation: the reference is its authors' update, written out
in tests/passes/test_shard_updates.py), and torch optimizers with two param groups handed to
`fxzero.initialize`. One spawn trains every scenario on the tiny GPT (cost model pinned to None);
the reference is one eager model over each step's whole global batch trained by the same torch
optimizer (foreach=False), its gradient the mean of the ranks' slices' (the sums' order as the
ranks': whole-batch gradients differ from it by rounding, which AMSGrad and NAdam amplify to 2e-5). Then a checkpoint: NAdam and SGD with momentum saved after 2 steps
and resumed on the same 2 ranks (bit for bit the uninterrupted run) and on 1 (re-sliced; the
eager run's values).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero import zoo
from tests.dist.harness import run_ranks
from tests.dist.reference import (
    assert_losses_close,
    assert_state_close,
    clone_state_dict,
    eager_gpt_reference,
    lm_loss,
    make_gpt_batches,
    rank_slice,
)
from tests.passes.test_shard_updates import _EagerLion

WORLD = 2
STEPS = 5
SAVED_AT = 2
GLOBAL = 8

# name -> (stage, offload given the nvme directory, torch.optim class name, its options, param groups?)
SCENARIOS: dict[str, tuple[int, Callable[[str], Any], str, dict[str, Any], bool]] = {
    "sgd-nesterov-groups": (3, lambda d: fxzero.Offload(), "SGD",
                            dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), True),
    "sgd-dampening-cpu": (3, lambda d: fxzero.Offload(optimizer=fxzero.Cpu()), "SGD",
                          dict(lr=0.05, momentum=0.9, dampening=0.1), False),
    "sgd-no-state-cpu": (2, lambda d: fxzero.Offload(optimizer=fxzero.Cpu()), "SGD", dict(lr=0.1), False),
    "nadam-nvme-groups": (3, lambda d: fxzero.Offload(optimizer=fxzero.Nvme(path=d)), "NAdam",
                          dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True), True),
    "asgd-params-nvme": (3, lambda d: fxzero.Offload(params=fxzero.Nvme(path=d), optimizer=fxzero.Nvme(path=d)),
                         "ASGD", dict(lr=0.05, t0=2, lambd=1e-3), False),
    "rmsprop-stage1": (1, lambda d: fxzero.Offload(), "RMSprop",
                       dict(lr=1e-3, momentum=0.5, centered=True, eps=1e-5), False),  # (eps: sqrt(v - m^2) is tiny)
    "adamw-amsgrad": (3, lambda d: fxzero.Offload(), "AdamW", dict(lr=0.01, amsgrad=True), False),
    "lion-stage2": (2, lambda d: fxzero.Offload(), "Lion", dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), False),
}
CHECKPOINTED = {"nadam": ("NAdam", dict(lr=0.01, weight_decay=0.1)),
                "sgd-momentum": ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1))}


def _model_fn():
    return zoo.build("gpt-tiny")


@functools.cache
def _problem() -> tuple[dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    return clone_state_dict(_model_fn()), make_gpt_batches(zoo.GPT_SIZES["tiny"], STEPS, GLOBAL, seed=7)


def _groups(named, options: dict[str, Any]) -> list[dict]:
    """Matrices with the optimizer's options; biases and norms with half the lr, no decay."""
    named = list(named)
    return [{"params": [p for _, p in named if p.ndim >= 2]},
            {"params": [p for _, p in named if p.ndim < 2], "lr": options["lr"] / 2, "weight_decay": 0.0}]


def _torch_optimizer(name: str, options: dict[str, Any], params) -> torch.optim.Optimizer:
    if name == "Lion":
        return _EagerLion(params, **options)
    return getattr(torch.optim, name)(params, foreach=False, **options)


@functools.cache
def _eager(name: str, options_items: tuple, groups: bool, slices: int | tuple[int, ...] = WORLD) -> dict[str, Any]:
    """The eager reference, each step's gradient the mean of `slices` (per step) of its batch,
    as that many ranks form it (`eager_gpt_reference`)."""
    state, batches = _problem()
    options = dict(options_items)

    def make(model):
        params = _groups(model.named_parameters(), options) if groups else model.parameters()
        return _torch_optimizer(name, options, params)

    return eager_gpt_reference(_model_fn, state, batches, make_optimizer=make, slices=slices)


# -- what each rank runs ---------------------------------------------------------------------------

def _engine(stage: int, offload: Any, name: str, options: dict[str, Any], groups: bool):
    state, _ = _problem()
    cfg = fxzero.Config(stage=stage, offload=offload, cost_model=None)
    if groups:  # DeepSpeed's entry point with the client's torch optimizer
        model = _model_fn()
        model.load_state_dict(state)
        opt = _torch_optimizer(name, options, _groups(model.named_parameters(), options))
        engine, optimizer, _, _ = fxzero.initialize(model=model, optimizer=opt, config=cfg)
        assert optimizer.param_groups is opt.param_groups
        return engine
    with torch.device("meta"):
        model = _model_fn()
    cfg = fxzero.Config(stage=stage, offload=offload, cost_model=None, optimizer=getattr(fxzero, name)(**options))
    return fxzero.compile(model, config=cfg, state_dict=state)


def _steps(engine, rank: int, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = lm_loss(engine(rank_slice(x, rank, WORLD)), rank_slice(y, rank, WORLD))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    return (stacked / WORLD).tolist()


def _full(engine, rank: int):
    full = engine.full_state_dict()
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


def _checkpointed(rank: int, name: str, options: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """Uninterrupted; and resumed on these ranks from the save after `SAVED_AT` steps."""
    _, batches = _problem()
    engine = _engine(3, fxzero.Offload(), name, options, False)
    _steps(engine, rank, batches[:SAVED_AT])
    engine.save_checkpoint(ckpt_dir, tag="mid")
    saved = {unit: {k: v.clone() for k, v in held.items()} for unit, held in engine.state.optimizer_states.items()}
    _steps(engine, rank, batches[SAVED_AT:])
    uninterrupted = _full(engine, rank)
    engine.close()
    resumed = _engine(3, fxzero.Offload(), name, options, False)
    resumed.load_checkpoint(ckpt_dir, tag="mid")
    _steps(resumed, rank, batches[SAVED_AT:])
    out = {"uninterrupted": uninterrupted, "resumed": _full(resumed, rank), "saved": saved}
    resumed.close()
    return out


def _all(rank: int, world_size: int, ckpt_root: str) -> dict[str, Any]:
    _, batches = _problem()
    out: dict[str, Any] = {}
    for scenario, (stage, offload, name, options, groups) in SCENARIOS.items():
        nvme_dir = os.path.join(tempfile.gettempdir(), f"fxzero-test-elementwise-{os.getppid()}-{scenario}")
        if rank == 0:
            os.makedirs(nvme_dir, exist_ok=True)
        dist.barrier()
        engine = _engine(stage, offload(nvme_dir), name, options, groups)
        out[scenario] = {"losses": _steps(engine, rank, batches), "state_dict": _full(engine, rank),
                         "states": engine.optimizer.policy.states, "memory": engine.memory_report(),
                         "trained": sum(lay.shard_numel for lay in engine.layouts if lay.trainable)}
        engine.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    for key, (name, options) in CHECKPOINTED.items():
        out[f"checkpoint-{key}"] = _checkpointed(rank, name, options, os.path.join(ckpt_root, key))
    return out


@pytest.fixture(scope="module")
def ckpt_root():
    root = tempfile.mkdtemp(prefix="fxzero-test-elementwise-ckpt-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(ckpt_root) -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, ckpt_root, timeout_s=900)


# -- tests -------------------------------------------------------------------------------------------

@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_an_elementwise_optimizer_trains_as_eager_torch(runs, scenario):
    _, _, name, options, groups = SCENARIOS[scenario]
    got = runs[0][scenario]
    ref = _eager(name, tuple(options.items()), groups)
    assert_losses_close(got["losses"], ref["losses"], f"{scenario}: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], scenario)
    assert runs[1][scenario]["losses"] == got["losses"]
    # Each state is 4 bytes per element of this rank's shards, where Offload puts it (with the
    # gradients, on a tier); SGD without momentum keeps none.
    on_tier = sum(got["memory"]["offloaded"].values()) if got["memory"].get("offloaded") else 0
    states = 4 * len(got["states"]) * got["trained"]
    if offloaded := ("cpu" in scenario or "nvme" in scenario):
        params = 4 * got["trained"] if "params" in scenario else 0
        assert on_tier == states + 4 * got["trained"] + params, (scenario, got["memory"])
    assert got["memory"]["optimizer_states"] == (0 if offloaded else states), (scenario, got["memory"])
    assert (got["states"] == ()) == (scenario == "sgd-no-state-cpu")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("key", list(CHECKPOINTED))
def test_states_resume_from_a_checkpoint_on_the_same_ranks_and_on_one(runs, ckpt_root, key):
    got = runs[0][f"checkpoint-{key}"]
    for k, want in got["uninterrupted"].items():
        assert torch.equal(got["resumed"][k], want), f"{key}: {k} after resuming on 2 ranks"
    # On one rank: every state re-sliced from the 2-rank shards (scalars per element included).
    name, options = CHECKPOINTED[key]
    _, batches = _problem()
    state, _ = _problem()
    with torch.device("meta"):
        model = _model_fn()
    cfg = fxzero.Config(stage=3, cost_model=None, optimizer=getattr(fxzero, name)(**options))
    engine = fxzero.compile(model, config=cfg, state_dict=state)
    engine.load_checkpoint(os.path.join(ckpt_root, key), tag="mid")
    for layout in engine.layouts:
        if not layout.trainable:
            continue
        for kind in engine.optimizer.policy.states:
            shards = torch.cat([runs[r][f"checkpoint-{key}"]["saved"][layout.name][kind] for r in range(WORLD)])
            loaded = engine.state.optimizer_states[layout.name][kind]
            assert torch.equal(loaded[: layout.numel], shards[: layout.numel]), (key, layout.name, kind)
    for x, y in batches[SAVED_AT:]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    # Steps 1-2 ran on 2 ranks and 3-5 on one, and so does the reference's gradient.
    ref = _eager(name, tuple(options.items()), False, (WORLD,) * SAVED_AT + (1,) * (len(batches) - SAVED_AT))
    assert_state_close(engine.full_state_dict(), ref["state_dict"], f"{key} resumed on 1 rank")
    engine.close()

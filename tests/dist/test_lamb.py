"""DeepSpeed's "Lamb" (FusedLamb) on gloo ranks: ZeRO-1, 2 and 3 on 2 ranks and on 1, optimizer
states offloaded, updates inside the backward, bfloat16 and float16 (loss-scaled) mixed precision,
each against LAMB on whole tensors.

Every run is a DeepSpeed config, read as `fxzero.initialize` reads it, with two param groups (the
matrices with weight decay; norms, biases and a parameter whose gradient is always 0 without),
gradient clipping by the global norm (0.5, below the gradients' norm, so it scales every step),
and a trust-ratio clamp that both bounds reach. The reference is `ReferenceLamb`
(tests/passes/test_lamb.py: DeepSpeed's kernel written out per whole tensor) training one eager
model on each step's whole global batch, its gradients clipped first by
`torch.nn.utils.clip_grad_norm_`, as DeepSpeed's engine scales them before FusedLamb. The steps
cover what the trust ratio can be: clamped from above (the norms' weights of ones) and from below
(a head scaled down), within the bounds, 1 for a weight of norm 0 (the zero-initialized biases of
the norms, at the first step) and 1 for an update of norm 0 (that parameter: not moved).

Mixed precision computes the forward in another precision than the eager fp32 model, so there
the check is per step and exact: the update each step makes to the fp32 masters, from the
gradients (unscaled: float16's loss scale divided out), masters and states fxzero holds (read
whole with `fxzero.utils`), against `ReferenceLamb`'s step from the same values.

Tolerances: fp32 runs compare the per-step losses within 1e-5 relative and the parameters within
FP32_ATOL absolute after the steps. The two sides sum each batch's loss, each gradient and each
norm in different orders (over 2 ranks' halves, over shards), so they part by fp32 rounding: a
couple of ulps of weights of magnitude ~1 (1.2e-7 each) over the steps (measured: at most 3e-8).
The per-step mixed-precision checks take the same values on both sides: their masters within
FP32_ATOL too (measured: at most 3e-8).
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
import torch.nn as nn

import fxzero
from fxzero import utils
from fxzero.config import Config
from tests.dist.harness import run_ranks
from tests.dist.reference import assert_losses_close, assert_state_close, clone_state_dict, rank_slice
from tests.passes.test_lamb import ReferenceLamb

STEPS = 5
GLOBAL = 8
D = 16
CLIP = 0.5
LAMB = dict(lr=0.02, weight_decay=0.05, betas=(0.9, 0.99), max_coeff=0.25, min_coeff=0.02)
"""FusedLamb's params in the configs (and ReferenceLamb's)."""
FP32_ATOL = 3e-7
"""See the module doc."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.dead = nn.Parameter(torch.randn(D))  # its gradient is 0: an update of norm 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x))) + 0.0 * self.dead


class _Net(nn.Module):
    """A stem, three blocks (a unit each) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), y)


@functools.cache
def _problem() -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():
        model.head.weight.mul_(0.1)  # (its ratio below min_coeff)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(GLOBAL, 8, generator=g), torch.randint(0, 4, (GLOBAL,), generator=g))
               for _ in range(STEPS)]
    return clone_state_dict(model), batches


def _groups(named) -> list[dict]:
    named = list(named)
    return [{"params": [p for n, p in named if p.ndim >= 2]},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}]


def _no_decay(name: str) -> bool:
    return _problem()[0][name].ndim < 2


@functools.cache
def _eager() -> dict[str, Any]:
    state, batches = _problem()
    model = _Net()
    model.load_state_dict(state)
    opt = ReferenceLamb(_groups(model.named_parameters()), **LAMB)
    losses = []
    for x, y in batches:
        loss = _loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state_dict": clone_state_dict(model), "cases": [c for s in opt.ratios for c, _ in s]}


# -- what each rank runs ---------------------------------------------------------------------------

SCENARIOS: dict[str, dict[str, Any]] = {
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    "zero3-states-on-cpu": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                  "offload_optimizer": {"device": "cpu"}}},
}
"""DeepSpeed config sections per scenario (2 ranks; "zero3" and "zero1" on 1 rank too)."""


def _config(extra: dict[str, Any], clip: bool = True) -> Config:
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": CLIP if clip else 0,
          "optimizer": {"type": "Lamb", "params": {**LAMB, "betas": list(LAMB["betas"])}}, **extra}
    return dataclasses.replace(Config.from_deepspeed(ds), cost_model=None, train_batch_size=None,
                               train_micro_batch_size_per_gpu=None)


def _engine(config: Config):
    state, _ = _problem()
    model = _Net()
    model.load_state_dict(state)
    engine, optimizer, _, _ = fxzero.initialize(model=model, model_parameters=_groups(model.named_parameters()),
                                                config=config)
    assert type(optimizer.policy) is fxzero.Lamb and optimizer.param_groups[1]["weight_decay"] == 0.0
    return engine


def _train(engine, rank: int, world: int) -> list[float]:
    _, batches = _problem()
    losses = []
    for x, y in batches:
        loss = _loss(engine(rank_slice(x, rank, world)), rank_slice(y, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    if world > 1:
        dist.all_reduce(stacked)
    return (stacked / world).tolist()


def _result(engine, rank: int, world: int) -> dict[str, Any]:
    losses = _train(engine, rank, world)
    full = engine.full_state_dict()
    out = {"losses": losses, "state_dict": {k: v.clone() for k, v in full.items()} if rank == 0 else None,
           "comm": engine.comm_report(), "layouts": [(lay.name, len(lay.slots)) for lay in engine.layouts
                                                     if lay.trainable]}
    engine.close()
    return out


MIXED = {"bf16": {"bf16": {"enabled": True}},
         "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}
"""The mixed-precision sections checked step by step (float16 with dynamic loss scaling, as the
bing_bert LAMB config; a scale small enough that no step of this model overflows)."""


def _mixed_steps(rank: int, world: int, precision: str) -> list[dict[str, Any]]:
    """Per step: the masters, states and gradients before `step()` and the masters after, whole."""
    config = _config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                      **MIXED[precision]})
    engine, (_, batches) = _engine(config), _problem()
    named = list(engine.module.named_parameters())
    records = []
    for x, y in batches:
        engine.backward(_loss(engine(rank_slice(x, rank, world)), rank_slice(y, rank, world)))
        before = {n: utils.safe_get_full_fp32_param(p).clone() for n, p in named}
        grads = {n: utils.safe_get_full_grad(p).float().clone() for n, p in named}
        states = {k: {n: (s.clone() if (s := utils.safe_get_full_optimizer_state(p, k)) is not None else None)
                      for n, p in named} for k in ("exp_avg", "exp_avg_sq")}
        engine.step()
        after = {n: utils.safe_get_full_fp32_param(p).clone() for n, p in named}
        records.append({"before": before, "grads": grads, "states": states, "after": after,
                        "applied": engine.was_step_applied(),
                        "compute_dtype": next(iter(engine.state.low.values())).dtype if engine.state.low else None})
    engine.close()
    return records


def _step_in_backward(rank: int, world: int, nvme_dir: str) -> dict[str, Any]:
    """Every state and parameter shard on NVMe, each unit updated inside the backward (no clipping:
    the global norm is not known there; Config refuses the two together)."""
    # (Two directories: with one nvme_path for both, fxzero's offload store makes each rank's
    # directory there twice, and fails; see the report of this change.)
    params = {"device": "nvme", "nvme_path": os.path.join(nvme_dir, "params")}
    states = {"device": "nvme", "nvme_path": os.path.join(nvme_dir, "states")}
    config = _config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                            "offload_param": params, "offload_optimizer": states}}, clip=False)
    config = dataclasses.replace(config, offload=dataclasses.replace(config.offload, step_in_backward=True))
    return _result(_engine(config), rank, world)


def _two_ranks(rank: int, world: int, nvme_root: str) -> dict[str, Any]:
    out = {name: _result(_engine(_config(extra)), rank, world) for name, extra in SCENARIOS.items()}
    for precision in MIXED:
        out[precision] = _mixed_steps(rank, world, precision)
    nvme_dir = os.path.join(nvme_root, "step-in-backward")
    if rank == 0:
        for sub in ("params", "states"):
            os.makedirs(os.path.join(nvme_dir, sub), exist_ok=True)
    dist.barrier()
    out["step-in-backward"] = _step_in_backward(rank, world, nvme_dir)
    return out


def _one_rank(rank: int, world: int) -> dict[str, Any]:
    return {name: _result(_engine(_config(SCENARIOS[name])), rank, world) for name in ("zero1", "zero3")}


@pytest.fixture(scope="module")
def nvme_root():
    root = tempfile.mkdtemp(prefix="fxzero-test-lamb-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(nvme_root) -> list[dict[str, Any]]:
    return run_ranks(_two_ranks, 2, nvme_root, timeout_s=600)


@pytest.fixture(scope="module")
def one() -> dict[str, Any]:
    return run_ranks(_one_rank, 1, timeout_s=300)[0]


@functools.cache
def _eager_unclipped() -> dict[str, Any]:
    state, batches = _problem()
    model = _Net()
    model.load_state_dict(state)
    opt = ReferenceLamb(_groups(model.named_parameters()), **LAMB)
    losses = []
    for x, y in batches:
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state_dict": clone_state_dict(model)}


# -- tests -------------------------------------------------------------------------------------------

def test_the_reference_reaches_every_case_of_the_trust_ratio():
    """What the runs below are compared on: both clamps, unclamped ratios and both norms of 0."""
    assert set(_eager()["cases"]) == {"within", "max", "min", "zero weight", "zero update"}
    # ... and the clipping applies at every step (the gradients' norm is above CLIP)
    state, batches = _problem()
    model = _Net()
    model.load_state_dict(state)
    x, y = batches[0]
    _loss(model(x), y).backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) > CLIP


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_lamb_trains_as_lamb_on_whole_tensors_on_two_ranks(runs, scenario):
    got, want = runs[0][scenario], _eager()
    assert_losses_close(got["losses"], want["losses"], f"{scenario}: per-step losses")
    assert_state_close(got["state_dict"], want["state_dict"], scenario, atol=FP32_ATOL)
    assert runs[1][scenario]["losses"] == got["losses"]
    initial = _problem()[0]
    for name in (f"blocks.{i}.dead" for i in range(3)):
        assert torch.equal(got["state_dict"][name], initial[name]), f"{scenario}: {name} has a zero update"
    # One all-reduce per unit and step: 2 numbers per parameter of the unit.
    units = got["layouts"]
    assert got["comm"]["all_reduce"]["calls"] == STEPS * len(units)
    assert got["comm"]["all_reduce"]["elements"] == STEPS * sum(2 * n for _, n in units)


@pytest.mark.timeout(600)
def test_lamb_inside_the_backward_with_every_state_on_nvme(runs):
    got, want = runs[0]["step-in-backward"], _eager_unclipped()
    assert_losses_close(got["losses"], want["losses"], "step-in-backward: per-step losses")
    assert_state_close(got["state_dict"], want["state_dict"], "step-in-backward", atol=FP32_ATOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["zero1", "zero3"])
def test_lamb_on_one_rank(one, scenario):
    got, want = one[scenario], _eager()
    assert_losses_close(got["losses"], want["losses"], f"{scenario} on 1 rank: per-step losses")
    assert_state_close(got["state_dict"], want["state_dict"], f"{scenario} on 1 rank", atol=FP32_ATOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", list(MIXED))
def test_mixed_precision_each_step_is_lambs_step_on_the_fp32_masters(runs, precision):
    records = runs[0][precision]
    assert records[0]["compute_dtype"] == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert all(rec["applied"] for rec in records), "a step was skipped (a float16 overflow): lower the scale"
    for step, rec in enumerate(records, start=1):
        names = list(rec["before"])
        params = {n: nn.Parameter(rec["before"][n].clone()) for n in names}
        grads = {n: rec["grads"][n] for n in names}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        clip = min(CLIP / (float(norm) + 1e-6), 1.0)  # DeepSpeed's (and torch's) clip coefficient
        opt = ReferenceLamb(_groups(params.items()), **LAMB)
        for n, p in params.items():
            p.grad = grads[n] * clip
            if step > 1:
                opt.state[p] = {"step": step - 1, "exp_avg": rec["states"]["exp_avg"][n].clone(),
                                "exp_avg_sq": rec["states"]["exp_avg_sq"][n].clone()}
        opt.step()
        for n in names:
            torch.testing.assert_close(rec["after"][n], params[n].detach().view_as(rec["after"][n]), rtol=0,
                                       atol=FP32_ATOL, msg=lambda m, n=n: f"{precision} step {step}: {n}: {m}")

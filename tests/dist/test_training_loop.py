"""What a training loop needs, on 2 gloo ranks against eager fp32 references written out here:
gradient accumulation, clipping by the global norm, Adam with L2 decay, param groups, LR
schedules (DeepSpeed's from a config, torch's through initialize), and rank 0's initial weights.

One spawn trains every scenario in turn (a module-scoped fixture), each with its own engine on
the tiny GPT at stage 3 (accumulation also at stage 2), cost model pinned to None. References:
one eager model over each step's whole global batch (the GPT has no buffers, so data parallelism
over equal micro-batches is exactly that), with torch.optim and torch.nn.utils.clip_grad_norm_.
"""

from __future__ import annotations

import functools
import math
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero import estimate, zoo
from fxzero.runtime.lr_schedules import build_scheduler
from fxzero.units import plan_units
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.reference import (
    assert_losses_close,
    assert_state_close,
    clone_state_dict,
    default_unit_numels,
    lm_loss,
    make_gpt_batches,
    padded_numel,
    rank_slice,
)

pytestmark = pytest.mark.timeout(900)

WORLD = 2
STEPS = 6
CLIP_STEPS = 10  # the bar: parameters within 1e-5 after 10 steps with a clip that binds
MICRO = 2  # rows per rank per micro-step
ACCUMULATION = 4
GLOBAL = MICRO * ACCUMULATION * WORLD  # rows per optimizer step
CLIP = 0.05
WARMUP = dict(warmup_min_lr=1e-4, warmup_max_lr=2e-3, warmup_num_steps=4, warmup_type="linear")
STATE_ATOL = 1e-5  # (and losses to rtol 1e-5: assert_losses_close's default)


def _model_fn():
    return zoo.build("gpt-tiny")


@functools.cache
def _problem(steps: int = STEPS) -> tuple[dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    return clone_state_dict(_model_fn()), make_gpt_batches(zoo.GPT_SIZES["tiny"], steps, GLOBAL, seed=3)


def _steps(kind: str) -> int:
    return CLIP_STEPS if kind.startswith("clip") else STEPS


SCHEDULES = {
    "WarmupDecayLR": fxzero.WarmupDecayLR(total_num_steps=6, warmup_min_lr=1e-4, warmup_max_lr=2e-3,
                                          warmup_num_steps=2, warmup_type="linear"),
    "WarmupCosineLR": fxzero.WarmupCosineLR(total_num_steps=6, warmup_num_steps=2, warmup_min_ratio=0.1,
                                            cos_min_ratio=0.05),
    "OneCycle": fxzero.OneCycle(cycle_min_lr=1e-4, cycle_max_lr=2e-3, cycle_first_step_size=2,
                                cycle_min_mom=0.85, cycle_max_mom=0.95),
}
"""DeepSpeed's other schedules, from the config: the eager reference runs the same scheduler
class on its torch.optim.AdamW (the sequences themselves are checked against DeepSpeed's
formulas in tests/passes/test_lr_schedules.py); OneCycle also cycles beta1."""


def _decay_groups(named) -> list[dict]:
    """The usual split: weight decay on matrices, none on biases and norms, a higher lr on those."""
    named = list(named)
    return [{"params": [p for _, p in named if p.ndim >= 2]},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3}]


def _warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR (linear), as optimizer step `step` (from 1) runs it: the schedule is
    built at i = -1 and stepped after each update, so step n runs with lr(i = n - 2), and
    lr(i) = min + (max - min) * clamp(i / warmup_num_steps, 0, 1)."""
    i = step - 2
    frac = min(max(i, 0) / WARMUP["warmup_num_steps"], 1.0)
    return WARMUP["warmup_min_lr"] + (WARMUP["warmup_max_lr"] - WARMUP["warmup_min_lr"]) * frac


# -- eager references ------------------------------------------------------------------------


def _eager(kind: str) -> dict[str, Any]:
    state, batches = _problem(_steps(kind))
    model = _model_fn()
    model.load_state_dict(state)
    hp = dict(ADAMW)
    if kind == "adam":
        opt = torch.optim.Adam(model.parameters(), **hp)
    elif kind == "groups":
        opt = torch.optim.AdamW(_decay_groups(model.named_parameters()), **hp)
    else:
        opt = torch.optim.AdamW(model.parameters(), **hp)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if kind == "torch_schedule" else None
    if kind in SCHEDULES:
        sched = build_scheduler(SCHEDULES[kind], opt)
    losses, norms, betas = [], [], []
    for n, (x, y) in enumerate(batches, start=1):
        betas.append(opt.param_groups[0]["betas"])
        if kind == "warmup":
            for g in opt.param_groups:
                g["lr"] = _warmup_lr(n)
        if kind == "accumulate":  # what DDP with accumulation computes: loss / (k * world) per micro-step
            loss = torch.zeros(())
            for r in range(WORLD):
                xs, ys = rank_slice(x, r, WORLD), rank_slice(y, r, WORLD)
                for xm, ym in zip(xs.chunk(ACCUMULATION), ys.chunk(ACCUMULATION)):
                    micro = lm_loss(model(xm), ym) / (ACCUMULATION * WORLD)
                    micro.backward()
                    loss += micro.detach()
        elif kind == "accumulate_local":  # DDP under no_sync: each rank sums its micro-steps, then the mean
            loss, per_rank = torch.zeros(()), []
            for r in range(WORLD):
                xs, ys = rank_slice(x, r, WORLD), rank_slice(y, r, WORLD)
                for xm, ym in zip(xs.chunk(ACCUMULATION), ys.chunk(ACCUMULATION)):
                    micro = lm_loss(model(xm), ym) / ACCUMULATION
                    micro.backward()
                    loss += micro.detach() / WORLD
                per_rank.append([p.grad.clone() for p in model.parameters()])
                opt.zero_grad()
            for p, *grads in zip(model.parameters(), *per_rank):
                p.grad = sum(grads) / WORLD
        else:
            loss = lm_loss(model(x), y)
            loss.backward()
        if kind == "clip":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return {"losses": losses, "state_dict": clone_state_dict(model), "norms": norms, "betas": betas}


# -- what each rank runs ---------------------------------------------------------------------


def _engine(kind: str, stage: int = 3) -> Any:
    state, _ = _problem()
    cfg = dict(stage=stage, optimizer=fxzero.AdamW(**ADAMW), cost_model=None)
    if kind.startswith("accumulate"):
        cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=ACCUMULATION)
        if kind.startswith("accumulate_local"):  # full gradients kept locally, reduced at the boundary
            cfg.update(gradient_accumulation="local")
        if kind in ("accumulate_cpu", "accumulate_local_cpu"):  # gradients go to host memory with the states
            cfg.update(offload=fxzero.Offload(optimizer=fxzero.Cpu()))
        elif kind == "accumulate_nvme":
            cfg.update(offload=fxzero.Offload(optimizer=fxzero.Nvme(path=tempfile.gettempdir())))
    elif kind == "whole":
        cfg.update(train_batch_size=GLOBAL, train_micro_batch_size_per_gpu=GLOBAL // WORLD)
    elif kind.startswith("clip"):
        cfg.update(gradient_clipping=CLIP)
        if kind == "clip_cpu":  # the norm of gradients that live on a tier
            cfg.update(offload=fxzero.Offload(optimizer=fxzero.Cpu()))
    elif kind == "adam":
        cfg.update(optimizer=fxzero.Adam(**ADAMW))
    elif kind == "warmup":
        cfg.update(lr_schedule=fxzero.WarmupLR(**WARMUP))
    elif kind in SCHEDULES:  # through fxzero.compile: the Config's schedule is stepped by the engine
        cfg.update(lr_schedule=SCHEDULES[kind])
    if kind in ("warmup", "torch_schedule"):  # through DeepSpeed's entry point, on an eager model
        model = _model_fn()
        model.load_state_dict(state)
        sched = None
        if kind == "torch_schedule":
            sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
        engine, optimizer, _, scheduler = fxzero.initialize(model=model, config=fxzero.Config(**cfg),
                                                            lr_scheduler=sched)
        assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
        return engine
    with torch.device("meta"):
        model = _model_fn()
    groups = _decay_groups(model.named_parameters()) if kind == "groups" else None
    return fxzero.compile(model, config=fxzero.Config(**cfg), state_dict=state, model_parameters=groups)


def _train(rank: int, kind: str, stage: int = 3) -> dict[str, Any]:
    _, batches = _problem(_steps(kind))
    engine = _engine(kind, stage)
    micro_steps = ACCUMULATION if kind.startswith("accumulate") else 1
    losses, norms, lrs, rs_bytes, unreduced, betas = [], [], [], [], [], []
    for x, y in batches:
        xs, ys = rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD)
        total = torch.zeros(())
        engine.comm_report(reset=True)
        lrs.append(engine.get_lr())
        betas.append(engine.optimizer.param_groups[0]["betas"])
        for m, (xm, ym) in enumerate(zip(xs.chunk(micro_steps), ys.chunk(micro_steps))):
            assert engine.is_gradient_accumulation_boundary() == (m == micro_steps - 1)
            if kind == "siamese":  # two forwards into one loss: their gradients add up
                half = len(xm) // 2
                loss = (lm_loss(engine(xm[:half]), ym[:half]) + lm_loss(engine(xm[half:]), ym[half:])) / 2
            else:
                loss = lm_loss(engine(xm), ym)
            engine.backward(loss)
            if m == 0:
                unreduced.append(engine.memory_report()["unreduced_grads"])
            engine.step()
            total += loss.detach()
        rs_bytes.append(engine.comm_report().get("reduce_scatter", {}).get("bytes", 0))
        norms.append(engine.get_global_grad_norm())
        losses.append(total / micro_steps)
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    full = engine.full_state_dict()
    out = {"losses": (stacked / WORLD).tolist(), "norms": norms, "lrs": lrs, "rs_bytes": rs_bytes,
           "unreduced": unreduced, "betas": betas,
           "steps": engine.global_steps, "state_dict": {k: v.clone() for k, v in full.items()} if rank == 0 else None}
    engine.close()
    return out


def _broadcast(rank: int) -> dict[str, Any]:
    """A model built eagerly with a different init on each rank trains from rank 0's."""
    torch.manual_seed(100 + rank)
    model = _model_fn()
    initial = clone_state_dict(model)
    engine = fxzero.compile(model, config=fxzero.Config(stage=3, cost_model=None))
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"initial": initial, "full": full}


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for kind, stage in [("accumulate", 3), ("accumulate2", 2), ("accumulate1", 1), ("accumulate_cpu", 3),
                        ("accumulate_local", 3), ("accumulate_local1", 1), ("accumulate_local_cpu", 3),
                        ("accumulate_nvme", 3), ("whole", 3), ("clip", 3), ("clip_cpu", 3), ("adam", 3),
                        ("groups", 3), ("warmup", 3), ("torch_schedule", 3), ("siamese", 3),
                        *((name, 3) for name in SCHEDULES)]:
        out[kind] = _train(rank, kind, stage)
        dist.barrier()
    out["broadcast"] = _broadcast(rank)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout_s=900)



# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["accumulate", "accumulate2", "accumulate1", "accumulate_cpu", "accumulate_nvme",
                                  "accumulate_local", "accumulate_local1", "accumulate_local_cpu", "whole"])
def test_accumulation_equals_the_whole_batch(runs, kind):
    """k=4 micro-batches of b (stages 3 and 2) == one micro-batch of 4b == eager on the global batch.

    The losses to rtol 1e-5. The parameters: each within 1e-5 of the whole-batch run, or no
    further from it than eager PyTorch's own accumulation is (summing four micro-batch means
    rounds differently from one mean over the batch, and Adam turns that rounding into a
    1.05e-5 difference in one element of this problem, in eager PyTorch as in fxzero); and
    the accumulated runs equal eager accumulation (the same sums: for gradient_accumulation=
    "local", DDP's under no_sync, each rank's sum of its micro-steps, then their mean) to 1e-5.
    """
    whole = _eager("adamw")
    accumulated = _eager("accumulate_local" if kind.startswith("accumulate_local") else "accumulate")
    got = runs[0][kind]
    assert_losses_close(got["losses"], whole["losses"], f"{kind}: per-step losses")
    assert got["steps"] == STEPS
    if kind == "whole":
        assert_state_close(got["state_dict"], whole["state_dict"], kind)
        return
    assert_state_close(got["state_dict"], accumulated["state_dict"], f"{kind} against eager accumulation")
    for k, want in whole["state_dict"].items():
        allowed = (accumulated["state_dict"][k] - want).abs().clamp(min=STATE_ATOL) + 1e-7
        excess = (got["state_dict"][k] - want).abs() - allowed
        assert excess.max() <= 0, f"{kind}: {k!r} is further from the whole-batch run than eager accumulation"


def test_accumulation_reduce_scatters_every_micro_step(runs):
    """Into the fp32 gradient shard: traffic per micro-step as without accumulation, so k times
    the whole batch's per optimizer step (and never an extra collective)."""
    accumulate, whole = runs[0]["accumulate"]["rs_bytes"], runs[0]["whole"]["rs_bytes"]
    assert whole[0] > 0
    assert accumulate == [ACCUMULATION * b for b in whole]


@pytest.mark.parametrize("kind", ["accumulate_local", "accumulate_local1", "accumulate_local_cpu"])
def test_local_accumulation_reduces_once_and_holds_the_full_gradient(runs, kind):
    """gradient_accumulation="local": one reduce-scatter per optimizer step, as the whole batch's,
    for a full fp32 gradient of every unit held between boundaries (each unit's flat buffer:
    its parameters padded to a multiple of the world)."""
    got, whole = runs[0][kind], runs[0]["whole"]["rs_bytes"]
    assert got["rs_bytes"] == whole
    with torch.device("meta"):
        model = _model_fn()
    full = sum(padded_numel(n, WORLD) for n in default_unit_numels(model).values()) * 4
    assert got["unreduced"] == [full] * STEPS
    assert runs[0]["accumulate"]["unreduced"] == [0] * STEPS  # (the sharded policy holds none)


def test_estimate_shows_what_each_policy_holds_and_moves(runs):
    """`fxzero estimate --accumulation K` (estimate.accumulation_costs) against what ran."""
    with torch.device("meta"):
        model = _model_fn()
    costs = estimate.accumulation_costs(plan_units(model, fxzero.UnitsPolicy(), WORLD), 3, ACCUMULATION)
    assert costs["local"].grads_held == runs[0]["accumulate_local"]["unreduced"][0]
    assert costs["local"].reduce_scatter_bytes == runs[0]["accumulate_local"]["rs_bytes"][0]
    assert costs["sharded"].reduce_scatter_bytes == runs[0]["accumulate"]["rs_bytes"][0]


@pytest.mark.parametrize("kind", ["clip", "clip_cpu"])
def test_clipping_equals_clip_grad_norm(runs, kind):
    ref = _eager("clip")
    assert min(ref["norms"]) > CLIP  # the clip binds at every step
    got = runs[0][kind]
    assert_losses_close(got["norms"], ref["norms"], f"{kind}: global grad norm (before clipping)")
    assert_losses_close(got["losses"], ref["losses"], f"{kind}: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], kind)
    assert runs[1][kind]["norms"] == got["norms"]  # every rank reports the same norm


def test_two_forwards_into_one_loss_accumulate(runs):
    """A siamese loss, the mean of two half-batch losses: the same gradient as one forward of the
    batch (the halves are equal), so the same training as the whole batch."""
    ref = _eager("adamw")
    got = runs[0]["siamese"]
    assert_losses_close(got["losses"], ref["losses"], "siamese: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], "siamese")


def test_adam_equals_torch_adam(runs):
    ref = _eager("adam")
    assert ref["state_dict"].keys()
    assert_losses_close(runs[0]["adam"]["losses"], ref["losses"], "Adam: per-step losses")
    assert_state_close(runs[0]["adam"]["state_dict"], ref["state_dict"], "adam")
    # L2 decay differs from decoupled decay: the two references do not agree with each other
    assert not all(torch.allclose(a, b, atol=STATE_ATOL) for a, b in
                   zip(ref["state_dict"].values(), _eager("adamw")["state_dict"].values()))


def test_param_groups_are_honoured(runs):
    ref = _eager("groups")
    got = runs[0]["groups"]
    assert_losses_close(got["losses"], ref["losses"], "param groups: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], "groups")
    assert got["lrs"][0] == [ADAMW["lr"], 3e-3]


def test_deepspeed_warmup_drives_the_sharded_step(runs):
    ref = _eager("warmup")
    got = runs[0]["warmup"]
    assert_losses_close([lrs[0] for lrs in got["lrs"]], [_warmup_lr(n) for n in range(1, STEPS + 1)], "lr per step")
    assert_losses_close(got["losses"], ref["losses"], "warmup: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], "warmup")


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_deepspeeds_other_schedules_drive_the_sharded_step(runs, kind):
    ref = _eager(kind)
    got = runs[0][kind]
    assert len({lrs[0] for lrs in got["lrs"]}) > 2  # the lr moves
    assert_losses_close([lrs[0] for lrs in got["lrs"]], [g for g in _lrs_of(kind)], f"{kind}: lr per step")
    assert [tuple(b) for b in got["betas"]] == [tuple(b) for b in ref["betas"]]
    assert_losses_close(got["losses"], ref["losses"], f"{kind}: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], kind)
    if kind == "OneCycle":
        assert len({b[0] for b in got["betas"]}) > 2  # beta1 cycles too


def _lrs_of(kind: str) -> list[float]:
    """The lr each optimizer step of the eager reference ran with."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **ADAMW)
    sched = build_scheduler(SCHEDULES[kind], opt)
    out = []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def test_a_torch_scheduler_drives_the_sharded_step(runs):
    ref = _eager("torch_schedule")
    got = runs[0]["torch_schedule"]
    assert_losses_close([lrs[0] for lrs in got["lrs"]], [ADAMW["lr"] * 0.5 ** (n // 2) for n in range(STEPS)], "lr per step")
    assert_losses_close(got["losses"], ref["losses"], "StepLR: per-step losses")
    assert_state_close(got["state_dict"], ref["state_dict"], "torch_schedule")


def test_every_rank_starts_from_rank_0s_weights(runs):
    r0, r1 = runs[0]["broadcast"], runs[1]["broadcast"]
    assert any(not torch.equal(r0["initial"][k], r1["initial"][k]) for k in r0["initial"])  # inits differed
    for rank in (0, 1):
        for k, v in r0["initial"].items():
            assert torch.equal(runs[rank]["broadcast"]["full"][k], v), (rank, k)
    assert math.isfinite(sum(runs[0]["accumulate"]["losses"]))

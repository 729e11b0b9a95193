"""Model-state memory and traffic per step on 4 gloo ranks, against ZeRO's arithmetic.

In fp32 with AdamW (4 param + 4 grad + 8 Adam bytes per parameter), per rank:
stage 1: 8*Phi + 8*Phi/N, stage 2: 4*Phi + 12*Phi/N, stage 3: 16*Phi/N; elements communicated
per step: 2*Phi (stages 1-2: reduce-scatter + re-gather), 3*Phi (stage 3: gather in forward,
gather in backward, reduce-scatter). "Up to padding": each unit is padded to a multiple of N,
so the exact figures use the padded size P = sum of padded unit sizes (Phi <= P < Phi + N*units).

One spawn trains every stage; the measurement is taken after the second backward, when the
optimizer states exist and the gradients have not yet been consumed by step().
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import fxzero
from fxzero import zoo
from tests.dist.harness import run_ranks
from tests.dist.reference import eager_gpt_reference, make_gpt_batches, rank_slice

WORLD = 4
STAGES = (1, 2, 3)
# Stage 3 is measured as issue-before-use (the two-largest-units bound) and with prefetch.
CONFIGS = {
    1: fxzero.Config(stage=1),
    2: fxzero.Config(stage=2),
    3: fxzero.Config(stage=3, prefetch=None),
    "3+prefetch": fxzero.Config(stage=3, prefetch=fxzero.Prefetch(keep_for_backward=False)),
    "3+keep": fxzero.Config(stage=3),  # the default: units the backward needs first kept from the forward
}
# A large eps makes AdamW's update depend on the gradient's size, so a wrongly scaled
# reduction (a sum instead of an average) shows in the parameters, not only in their signs.
SCALE_SENSITIVE = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-1, weight_decay=0.0)


def _gpt_tiny():
    return zoo.build("gpt-tiny")


def _measure(rank: int, world_size: int, batches, initial) -> dict:
    out = {}
    for key, config in CONFIGS.items():
        with torch.device("meta"):
            model = _gpt_tiny()
        engine = fxzero.compile(model, config)
        comm_per_step, memory = [], None
        for i, (x, y) in enumerate(batches[:3]):
            logits = engine(rank_slice(x, rank, world_size))
            engine.backward(F.cross_entropy(logits.flatten(0, 1), rank_slice(y, rank, world_size).flatten()))
            if i == 1:
                memory = engine.memory_report()
            engine.step()
            comm_per_step.append(engine.comm_report(reset=True))
        units = [(u.name, u.numel, u.padded_numel, u.trainable) for u in engine.layouts]
        out[key] = {
            "memory": memory,
            "comm": comm_per_step,
            "units": units,
            "phi": engine.num_params,
            "budget": engine.schedule.prefetch_budget_bytes,
            "schedule_peak": engine.schedule.peak_gathered_bytes,
            "kept": engine.schedule.kept_for_backward,
        }
        torch.distributed.barrier()
    # Gradient scale: stage 3 with a scale-sensitive AdamW against the eager reference.
    with torch.device("meta"):
        model = _gpt_tiny()
    engine = fxzero.compile(
        model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(**SCALE_SENSITIVE)), state_dict=initial
    )
    for x, y in batches[:3]:
        logits = engine(rank_slice(x, rank, world_size))
        engine.backward(F.cross_entropy(logits.flatten(0, 1), rank_slice(y, rank, world_size).flatten()))
        engine.step()
    state = engine.full_state_dict()  # a collective: every rank calls it
    out["scale_state"] = state if rank == 0 else None
    return out


@functools.cache
def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return _gpt_tiny().state_dict()


@functools.cache
def _batches():
    return make_gpt_batches(zoo.GPT_SIZES["tiny"], steps=3, global_batch=8, seed=3)


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_measure, WORLD, _batches(), _initial(), timeout_s=600)


def _padded(run) -> int:
    return sum(padded for _, _, padded, _ in run["units"])


@pytest.mark.parametrize("stage", STAGES)
def test_model_state_bytes_follow_zero_arithmetic(runs, stage):
    n = WORLD
    for rank in range(n):
        run = runs[rank][stage]
        phi, p, mem = run["phi"], _padded(run), run["memory"]
        expected = {
            1: (4 * p, 4 * p, 8 * p // n),
            2: (4 * p, 4 * p // n, 8 * p // n),
            3: (4 * p // n, 4 * p // n, 8 * p // n),
        }[stage]
        got = (mem["param_shards"], mem["grad_shards"], mem["optimizer_states"])
        assert got == expected, f"rank {rank} stage {stage}: (param, grad, optim) bytes {got} != {expected}"
        formula = {1: 8 * phi + 8 * phi / n, 2: 4 * phi + 12 * phi / n, 3: 16 * phi / n}[stage]
        padding_slack = 16 * (p - phi)
        assert abs(mem["model_states"] - formula) <= padding_slack, (
            f"rank {rank} stage {stage}: model states {mem['model_states']} B vs ZeRO's "
            f"{formula:.0f} B (Phi={phi}), more than the padding ({padding_slack} B) apart"
        )


def test_stage3_gathered_peak_bounded_by_two_largest_units(runs):
    for rank in range(WORLD):
        run = runs[rank][3]
        two_largest = sorted((padded * 4 for _, _, padded, _ in run["units"]), reverse=True)[:2]
        peak = run["memory"]["gathered_peak"]
        assert 0 < peak <= sum(two_largest), f"rank {rank}: gathered peak {peak} B > two largest units {two_largest}"
    for stage in (1, 2):
        assert runs[0][stage]["memory"]["gathered_peak"] == 0, f"stage {stage} gathers nothing per layer"


def test_prefetch_stays_within_its_budget(runs):
    for rank in range(WORLD):
        run = runs[rank]["3+prefetch"]
        peak, budget = run["memory"]["gathered_peak"], run["budget"]
        assert budget is not None and run["schedule_peak"] <= budget
        assert peak == run["schedule_peak"], "the runtime's peak must be the schedule's"
        assert peak > runs[rank][3]["memory"]["gathered_peak"], "prefetch should hold more in flight"


def test_prefetch_keeps_traffic(runs):
    for rank in range(WORLD):
        assert runs[rank]["3+prefetch"]["comm"] == runs[rank][3]["comm"]


def test_units_kept_for_the_backward_are_gathered_once(runs):
    for rank in range(WORLD):
        run = runs[rank]["3+keep"]
        padded = {name: n for name, _, n, _ in run["units"]}
        assert run["kept"], "the default prefetch keeps the units the backward needs first"
        kept = sum(padded[u] for u in run["kept"])
        for report in run["comm"]:
            assert report["all_gather"]["elements"] == 2 * _padded(run) - kept
            assert report["reduce_scatter"]["elements"] == _padded(run)
        # Between the forward and the backward the kept buffers are alive: within the budget,
        # and the runtime's peak is the schedule's.
        assert run["memory"]["gathered_peak"] == run["schedule_peak"] <= run["budget"]


@pytest.mark.parametrize("stage", STAGES)
def test_traffic_per_step(runs, stage):
    for rank in range(WORLD):
        run = runs[rank][stage]
        phi, p = run["phi"], _padded(run)
        for step, report in enumerate(run["comm"]):
            elements = sum(kind["elements"] for kind in report.values())
            factor = 3 if stage == 3 else 2
            assert elements == factor * p, f"rank {rank} stage {stage} step {step}: {report}"
            assert factor * phi <= elements <= factor * phi * 1.01, (
                f"{elements} elements per step, not within 1% of {factor}*Phi = {factor * phi}"
            )
            assert report["reduce_scatter"]["elements"] == p
            assert report["all_gather"]["elements"] == (factor - 1) * p


def test_gradients_are_averaged_not_summed(runs):
    want = eager_gpt_reference(_gpt_tiny, _initial(), _batches()[:3], SCALE_SENSITIVE)["state_dict"]
    got = runs[0]["scale_state"]
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")

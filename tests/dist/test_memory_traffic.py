"""Model-state memory and traffic per step on 4 gloo ranks, against ZeRO's arithmetic.

In fp32 with AdamW (4 param + 4 grad + 8 Adam bytes per parameter), per rank:
stage 1: 8*Phi + 8*Phi/N, stage 2: 4*Phi + 12*Phi/N, stage 3: 16*Phi/N; elements communicated
per step: 2*Phi (stages 1-2: reduce-scatter + re-gather), 3*Phi (stage 3: gather in forward,
gather in backward, reduce-scatter). "Up to padding": each unit is padded to a multiple of N,
so the exact figures use the padded size P = sum of padded unit sizes (Phi <= P < Phi + N*units).
P is computed from the model alone (`reference.default_unit_numels`: its parameters grouped as
the default UnitsPolicy groups them, each unit rounded up to a multiple of N), never from the
engine's own layouts; the test model's widths are odd so that every unit needs padding on 4
ranks (a mis-padded unit changes P).

Every run pins `cost_model=None` (native reduce-scatters), so nothing depends on a timing
measurement. One spawn trains every stage; the measurement is taken after the second backward, when the
optimizer states exist and the gradients have not yet been consumed by step().
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import fxzero
from fxzero import zoo
from tests.dist.harness import run_ranks, train
from tests.dist.reference import default_unit_numels, eager_gpt_reference, lm_loss, make_gpt_batches, padded_numel

WORLD = 4
STAGES = (1, 2, 3)
# Stage 3 is measured as issue-before-use (the two-largest-units bound) and with prefetch.
CONFIGS = {
    1: fxzero.Config(stage=1, cost_model=None),
    2: fxzero.Config(stage=2, cost_model=None),
    3: fxzero.Config(stage=3, prefetch=None, cost_model=None),
    "3+prefetch": fxzero.Config(stage=3, prefetch=fxzero.Prefetch(keep_for_backward=False), cost_model=None),
    # The default prefetch: units the backward needs first kept from the forward.
    "3+keep": fxzero.Config(stage=3, cost_model=None),
}
# gpt-tiny with odd widths: on 4 ranks the root (3,729 parameters), the blocks (13,398) and the
# tail (66) all need padding; with the zoo's even widths no unit would.
SHAPE = dict(vocab_size=97, d_model=33, n_heads=3)
# A large eps makes AdamW's update depend on the gradient's size, so a wrongly scaled
# reduction (a sum instead of an average) shows in the parameters, not only in their signs.
SCALE_SENSITIVE = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-1, weight_decay=0.0)


def _gpt_tiny():
    return zoo.build("gpt-tiny", **SHAPE)


def _measure(rank: int, world_size: int, batches, initial) -> dict:
    out = {}
    for key, config in CONFIGS.items():
        with torch.device("meta"):
            model = _gpt_tiny()
        engine = fxzero.compile(model, config)
        comm_per_step, memory = [], {}

        def measure_memory(i: int) -> None:
            if i == 1:  # optimizer states exist, gradients not yet consumed by step()
                memory.update(engine.memory_report())

        train(engine, batches[:3], lm_loss, rank, world_size, after_backward=measure_memory,
              after_step=lambda i: comm_per_step.append(engine.comm_report(reset=True)))
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
        model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(**SCALE_SENSITIVE), cost_model=None),
        state_dict=initial,
    )
    train(engine, batches[:3], lm_loss, rank, world_size)
    state = engine.full_state_dict()  # a collective: every rank calls it
    out["scale_state"] = state if rank == 0 else None
    return out


@functools.cache
def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return _gpt_tiny().state_dict()


@functools.cache
def _batches():
    return make_gpt_batches(dataclasses.replace(zoo.GPT_SIZES["tiny"], **SHAPE), steps=3, global_batch=8, seed=3)


@functools.cache
def _padded_units() -> dict[str, int]:
    """Each default unit's size from the model's parameter shapes, rounded up to a multiple of
    the world size."""
    with torch.device("meta"):
        units = default_unit_numels(_gpt_tiny())
    return {name: padded_numel(n, WORLD) for name, n in units.items()}


@functools.cache
def _model_numels() -> tuple[int, int]:
    """(Phi, P) from the model's parameter shapes: its unique parameters, and their padded sum."""
    with torch.device("meta"):
        phi = sum(default_unit_numels(_gpt_tiny()).values())
    return phi, sum(_padded_units().values())


def test_the_model_needs_padding():
    phi, p = _model_numels()
    with torch.device("meta"):
        model = _gpt_tiny()
    assert phi == sum(t.numel() for t in model.parameters()), "tied parameters count once"
    assert p > phi, "the memory and traffic figures below would not see the padding"
    assert all(n % WORLD for n in default_unit_numels(model).values()), "every unit needs padding"


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_measure, WORLD, _batches(), _initial(), timeout_s=600)


@pytest.mark.parametrize("stage", STAGES)
def test_model_state_bytes_follow_zero_arithmetic(runs, stage):
    n = WORLD
    phi, p = _model_numels()
    for rank in range(n):
        run = runs[rank][stage]
        mem = run["memory"]
        assert run["phi"] == phi, f"rank {rank}: engine.num_params {run['phi']} != the model's {phi}"
        layouts = {name: padded for name, _, padded, _ in run["units"]}
        assert layouts == _padded_units(), f"rank {rank}: the engine's units {layouts} != the model's"
        expected = {
            1: (4 * p, 4 * p, 8 * p // n),
            2: (4 * p, 4 * p // n, 8 * p // n),
            3: (4 * p // n, 4 * p // n, 8 * p // n),
        }[stage]
        got = (mem["param_shards"], mem["grad_shards"], mem["optimizer_states"])
        assert got == expected, f"rank {rank} stage {stage}: (param, grad, optim) bytes {got} != {expected}"
        assert mem["model_states"] == sum(expected), f"rank {rank} stage {stage}: {mem}"
        # Units held whole: every unit at stages 1-2, none at stage 3 without a threshold.
        assert mem["persistent_params"] == (4 * p if stage in (1, 2) else 0), f"rank {rank} stage {stage}: {mem}"
        assert mem["buffers"] == 0, "the GPT has no buffers"
        formula = {1: 8 * phi + 8 * phi / n, 2: 4 * phi + 12 * phi / n, 3: 16 * phi / n}[stage]
        padding_slack = 16 * (p - phi)
        assert abs(mem["model_states"] - formula) <= padding_slack, (
            f"rank {rank} stage {stage}: model states {mem['model_states']} B vs ZeRO's "
            f"{formula:.0f} B (Phi={phi}), more than the padding ({padding_slack} B) apart"
        )


def test_stage3_gathered_peak_bounded_by_two_largest_units(runs):
    for rank in range(WORLD):
        run = runs[rank][3]
        two_largest = sorted((padded * 4 for padded in _padded_units().values()), reverse=True)[:2]
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
        padded = _padded_units()
        p = _model_numels()[1]
        assert run["kept"], "the default prefetch keeps the units the backward needs first"
        kept = sum(padded[u] for u in run["kept"])
        for report in run["comm"]:
            assert report["all_gather"]["elements"] == 2 * p - kept
            assert report["reduce_scatter"]["elements"] == p
        # Between the forward and the backward the kept buffers are alive: within the budget,
        # and the runtime's peak is the schedule's.
        assert run["memory"]["gathered_peak"] == run["schedule_peak"] <= run["budget"]


@pytest.mark.parametrize("stage", STAGES)
def test_traffic_per_step(runs, stage):
    for rank in range(WORLD):
        run = runs[rank][stage]
        phi, p = _model_numels()
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

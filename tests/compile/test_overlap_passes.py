"""Prefetch, persistence and collective choice, checked on compiled schedules (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxzero
from fxzero import zoo
from fxzero.cost import PRESETS, CostModel, Link, simulate
from fxzero.passes.prefetch import MIN_DEFAULT_BUDGET


def _compile(config: fxzero.Config, world_size: int = 4, **kw):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny", **kw)
    return fxzero.compile_program(model, model.example_inputs(batch=2), config, world_size=world_size)


def _gathers(schedule, program):
    return [i for i in schedule.program(program).instructions if i.kind == "all_gather"]


def test_prefetch_never_exceeds_its_budget():
    base = _compile(fxzero.Config(stage=3, prefetch=None)).schedule
    largest = max(u.padded_numel * u.itemsize for u in base.units)
    for budget in (base.peak_gathered_bytes, base.peak_gathered_bytes + largest, 10 * base.peak_gathered_bytes):
        s = _compile(fxzero.Config(stage=3, prefetch=fxzero.Prefetch(max_live_bytes=budget))).schedule
        assert s.prefetch_budget_bytes == budget
        assert s.peak_gathered_bytes <= budget, (budget, s.peak_gathered_bytes)
    # The default budget is the peak without prefetch plus the largest unit, at least 128 MiB.
    s = _compile(fxzero.Config(stage=3)).schedule
    assert s.prefetch_budget_bytes == max(base.peak_gathered_bytes + largest, MIN_DEFAULT_BUDGET) == 128 << 20


def test_prefetch_issues_gathers_earlier_and_keeps_their_order():
    base = _compile(fxzero.Config(stage=3, prefetch=None)).schedule
    # One unit of lookahead (the default budget, 128 MiB, would keep every unit of this small
    # model from the forward, leaving the backward almost nothing to gather).
    largest = max(u.padded_numel * u.itemsize for u in base.units)
    pre = _compile(fxzero.Config(stage=3, prefetch=fxzero.Prefetch(max_live_bytes=base.peak_gathered_bytes + largest))).schedule
    for program in ("forward", "backward"):
        # (The backward does not gather again the units it keeps from the forward.)
        units = [i.unit for i in _gathers(base, program) if program == "forward" or i.unit not in pre.kept_for_backward]
        assert [i.unit for i in _gathers(pre, program)] == units, "gathers keep the order units are used"
        index = {i.name: n for n, i in enumerate(pre.program(program).instructions)}
        base_index = {i.name: n for n, i in enumerate(base.program(program).instructions)}
        # Some gather now starts before the previous unit's wait: it overlaps that unit's compute.
        waits = {i.reads[0]: index[i.name] for i in pre.program(program).instructions if i.kind == "wait"}
        gathers = _gathers(pre, program)
        assert any(index[g.name] < waits[prev.name] for prev, g in zip(gathers, gathers[1:])), program
        assert any(index[g.name] < base_index[g.name] - 1 for g in gathers[1:])


def _live_with_reductions(schedule) -> int:
    """Most bytes of gathered buffers plus flat gradients being reduced alive at once (backward)."""
    backward = schedule.program("backward")
    reducing, most = {}, 0
    for n, ins in enumerate(backward.instructions):
        if ins.kind == "reduce_scatter":
            reducing[ins.name] = ins.bytes
        elif ins.kind == "wait":
            reducing.pop(ins.reads[0], None)
        most = max(most, backward.gathered_bytes[n] + sum(reducing.values()))
    return most


def test_prefetch_sinks_reduce_scatter_waits_within_the_budget():
    base = _compile(fxzero.Config(stage=3, prefetch=None)).schedule
    # A roomy budget: every reduction overlaps the backward compute of the units before it,
    # and some stay in flight past the next reduce-scatter.
    roomy = _compile(fxzero.Config(stage=3, prefetch=fxzero.Prefetch(max_live_bytes=10 * base.peak_gathered_bytes))).schedule
    # The gradients the backward leaves in flight are waited for in the step, after it.
    pre = roomy.program("backward").instructions + roomy.program("step").instructions
    position = {i.name: n for n, i in enumerate(pre)}
    scatters = [i for i in pre if i.kind == "reduce_scatter"]
    waits = {i.reads[0]: i for i in pre if i.kind == "wait"}
    for rs in scatters[:-1]:
        computes_between = [i for i in pre[position[rs.name] + 1 : position[waits[rs.name].name]] if i.kind == "compute"]
        assert computes_between, f"wait of {rs.unit} follows its reduce-scatter directly"
    assert any(position[waits[rs.name].name] > position[nxt.name] for rs, nxt in zip(scatters, scatters[1:]))
    # The budget bounds gathered buffers and flat gradients being reduced together, for a tight
    # budget (the default) and a roomy one; one that barely holds two units is passed by at most
    # the one flat gradient each reduction keeps until the next is issued (its overlap).
    largest = max(u.padded_numel * u.itemsize for u in base.units)
    for schedule in (_compile(fxzero.Config(stage=3)).schedule, roomy):
        assert _live_with_reductions(schedule) <= schedule.prefetch_budget_bytes
    tight = _compile(fxzero.Config(stage=3, prefetch=fxzero.Prefetch(max_live_bytes=2 * largest))).schedule
    assert _live_with_reductions(tight) <= tight.prefetch_budget_bytes + largest


@pytest.mark.parametrize("budget", [1, "two units"])
def test_each_reduction_overlaps_backward_compute_whatever_the_budget(budget):
    """Issue 26's defect: units larger than the budget had each reduce-scatter waited for right
    after it was issued, its reduction exposed. Now every one but the last has backward compute
    between it and its wait, as the pass's docstring promises."""
    base = _compile(fxzero.Config(stage=3, prefetch=None)).schedule
    largest = max(u.padded_numel * u.itemsize for u in base.units)
    bytes_ = 1 if budget == 1 else 2 * largest
    schedule = _compile(fxzero.Config(stage=3, prefetch=fxzero.Prefetch(max_live_bytes=bytes_))).schedule
    backward = schedule.program("backward").instructions + schedule.program("step").instructions
    position = {i.name: n for n, i in enumerate(backward)}
    waits = {i.reads[0]: i for i in backward if i.kind == "wait"}
    scatters = [i for i in backward if i.kind == "reduce_scatter"]
    assert len(scatters) > 2
    for rs in scatters[:-1]:
        between = backward[position[rs.name] + 1 : position[waits[rs.name].name]]
        assert any(i.kind == "compute" for i in between), f"the reduction of {rs.unit} is waited for at once"


def test_persistence_removes_those_units_gathers():
    base = _compile(fxzero.Config(stage=3, prefetch=None))
    root = next(u for u in base.layouts if u.name == "root")
    blocks = [u for u in base.layouts if u.name.startswith("blocks.")]
    threshold = root.numel + 1  # the (small) root and tail units are under it, every block above
    assert all(u.numel >= threshold for u in blocks), "the test needs blocks above the threshold"
    s = _compile(fxzero.Config(stage=3, prefetch=None, persist_threshold=threshold)).schedule
    assert s.persistent == ("root", "root:tail")
    for program in ("forward", "backward"):
        gathered = {i.unit for i in _gathers(s, program)}
        assert "root" not in gathered and gathered == {u.name for u in blocks}
    # A persistent unit is re-gathered after its optimizer step, like every unit at ZeRO-1/2.
    step = s.program("step").instructions
    # (updated in the order the backward reduce-scatters their gradients: the tail's first)
    assert [i.unit for i in step if i.kind == "all_gather"] == ["root:tail", "root"]
    # ...and its full buffer shows in the rewritten graph: its placeholder is not sharded.
    placeholder = next(
        n for n in _compile(fxzero.Config(stage=3, persist_threshold=threshold)).joint.graph.nodes
        if n.meta.get("fxzero", {}).get("kind") == "unit" and n.meta["fxzero"]["unit"] == "root"
    )
    assert placeholder.meta["fxzero"]["sharded"] is False


def _slow_rs_fast_ar(native: float, via: float) -> CostModel:
    return dataclasses.replace(
        PRESETS["cpu-loopback"],
        links={
            "all_gather": Link(bandwidth=1e9),
            "reduce_scatter": Link(bandwidth=native),
            "all_reduce": Link(bandwidth=via),
        },
    )


@pytest.mark.parametrize("native, via, expected", [(1e8, 1e9, "all_reduce"), (1e9, 1e8, "reduce_scatter")])
def test_cost_model_chooses_how_reduce_scatters_run(native, via, expected):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    s = fxzero.compile_program(
        model, model.example_inputs(batch=2), fxzero.Config(stage=3), world_size=2,
        cost_model=_slow_rs_fast_ar(native, via),
    ).schedule
    algorithms = {i.algorithm for _, i in s.collectives() if i.kind == "reduce_scatter"}
    assert algorithms == {expected}


def test_simulator_hides_communication_with_prefetch():
    # A link slow enough that communication matters, compute from the same preset.
    cost = dataclasses.replace(
        PRESETS["cpu-loopback"],
        links={k: Link(bandwidth=2e7, latency=1e-4) for k in ("all_gather", "reduce_scatter", "all_reduce")},
    )
    base = simulate(_compile(fxzero.Config(stage=3, prefetch=None), world_size=2).schedule, cost)
    pre = simulate(_compile(fxzero.Config(stage=3), world_size=2).schedule, cost)
    assert pre.exposed_comm_seconds < base.exposed_comm_seconds
    assert pre.step_seconds < base.step_seconds
    assert pre.step_seconds >= max(pre.compute_seconds, pre.comm_seconds) * 0.999
    # Without prefetch every gather is exposed: the step is about compute + gathers.
    assert base.step_seconds >= base.compute_seconds


def test_simulator_runs_for_hardware_we_do_not_have():
    s = _compile(fxzero.Config(stage=3), world_size=8).schedule
    result = simulate(s, PRESETS["h100x8-nvlink"])
    assert 0 < result.step_seconds < 1.0
    assert result.peak_gathered_bytes == s.peak_gathered_bytes
    streams = {e.stream for e in result.events}
    assert streams == {"compute", "comm"}
    for e in result.events:
        assert e.end >= e.start >= 0


def test_keep_for_backward_follows_deepspeeds_reuse_distance():
    # Unset (None): kept where that applies, as DeepSpeed reuses within its default distance.
    assert fxzero.Config.from_deepspeed({"zero_optimization": {"stage": 3}}).prefetch.keep_for_backward is None
    cfg = fxzero.Config.from_deepspeed({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}})
    assert cfg.prefetch.keep_for_backward is False
    kept = _compile(fxzero.Config(stage=3)).schedule
    twice = _compile(fxzero.Config(stage=3, prefetch=fxzero.Prefetch(keep_for_backward=False))).schedule
    assert kept.kept_for_backward and not twice.kept_for_backward
    # The backward starts with what the forward ended with: those units' backward gathers go.
    n = len(kept.kept_for_backward)
    assert {i.unit for i in _gathers(twice, "backward")[:n]} == set(kept.kept_for_backward)
    assert [i.unit for i in _gathers(kept, "backward")] == [i.unit for i in _gathers(twice, "backward")][n:]

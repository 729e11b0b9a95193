"""build_schedule, the Schedule value and its validator, on compiled toy models.

Broken schedules are made from real ones with dataclasses.replace, and their fingerprint is
recomputed with fingerprint_of, so that only the rule a test targets can fail.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fxzero
from fxzero.ir.instruction import Instruction
from fxzero.schedule import (
    ProgramSchedule,
    SCHEDULE_VERSION,
    Schedule,
    ScheduleError,
    first_difference,
    fingerprint_of,
    validate,
)
from tests.passes.toys import STAGES, WORLD_SIZES, build, compiled, example_inputs

SCHEDULED = ("mlp", "tied", "bn", "frozen", "unused")


# ---------------------------------------------------------------------------------------------
# Helpers that break a schedule


def _with_program(schedule: Schedule, program: ProgramSchedule) -> Schedule:
    programs = tuple(program if p.name == program.name else p for p in schedule.programs)
    return dataclasses.replace(
        schedule, programs=programs, fingerprint=fingerprint_of(programs, schedule.units, schedule.stage)
    )


def _rebuild(program: ProgramSchedule, order: list, replace: dict | None = None) -> ProgramSchedule:
    """The program with instructions in `order` (old indices, or new Instructions).

    Deps are remapped to the new indices; deps on dropped instructions, or that would now
    point forward, are left out, so that the dependency rule does not fire first.
    """
    new_index = {old: new for new, old in enumerate(order) if isinstance(old, int)}
    out = []
    for new, old in enumerate(order):
        ins = program.instructions[old] if isinstance(old, int) else old
        deps = tuple(sorted(new_index[d] for d in ins.deps if d in new_index and new_index[d] < new))
        ins = dataclasses.replace(ins, deps=deps)
        if replace and ins.name in replace:
            ins = dataclasses.replace(ins, **replace[ins.name])
        out.append(ins)
    return dataclasses.replace(program, instructions=tuple(out), gathered_bytes=tuple(0 for _ in out))


def _index(program: ProgramSchedule, kind: str, nth: int = 0) -> int:
    return [i for i, ins in enumerate(program.instructions) if ins.kind == kind][nth]


@pytest.fixture(scope="module")
def mlp3() -> Schedule:
    """mlp at stage 3 on two ranks; forward: all_gather, wait, views, addmm, free, ... per layer."""
    return compiled("mlp", 3, 2).schedule


# ---------------------------------------------------------------------------------------------
# Building


def _check_built(schedule: Schedule, stage: int, world_size: int) -> None:
    validate(schedule)
    assert (schedule.version, schedule.stage, schedule.world_size) == (SCHEDULE_VERSION, stage, world_size)
    assert [p.name for p in schedule.programs] == ["forward", "backward", "step"]
    assert Schedule.loads(schedule.dumps()) == schedule
    units = {u.name: u.padded_numel * u.itemsize for u in schedule.units}
    kept = sum(units[u] for u in schedule.kept_for_backward)
    for p in schedule.programs:
        assert len(p.gathered_bytes) == len(p.instructions)
        # Every gathered buffer is freed by the end, but those the forward keeps for the backward.
        assert p.gathered_bytes[-1:] in ((), (kept if p.name == "forward" else 0,))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", SCHEDULED)
def test_built_schedules_validate_and_round_trip(name, stage, world_size):
    _check_built(compiled(name, stage, world_size).schedule, stage, world_size)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", SCHEDULED)
def test_default_config_schedules_validate_and_round_trip(name, stage):
    # The default Config also runs the prefetch pass, which moves gathers and waits.
    _check_built(compiled(name, stage, 2, prefetch=True).schedule, stage, 2)


def test_instructions_follow_program_order_on_named_streams(mlp3):
    programs = compiled("mlp", 3, 2).programs
    # The waits for the gradients the backward leaves in flight moved into the step program.
    carried = {i.reads[0] for i in mlp3.program("step").instructions if i.kind == "wait"}
    assert carried
    for name in ("forward", "backward"):
        nodes = [n.name for n in programs[name].gm.graph.nodes if n.op == "call_function"
                 and not (n.target is torch.ops.fxzero.wait.default and n.args[0].name in carried)]
        p = mlp3.program(name)
        assert [i.name for i in p.instructions] == nodes
        assert p.inputs == tuple(n.name for n in programs[name].gm.graph.nodes if n.op == "placeholder")
        for idx, ins in enumerate(p.instructions):
            assert ins.stream == ("comm" if ins.kind in ("all_gather", "reduce_scatter") else "compute")
            assert all(d < idx for d in ins.deps)
    layouts = {u.name: u for u in mlp3.units}
    for _, ins in mlp3.collectives():
        assert (ins.numel, ins.bytes) == (layouts[ins.unit].padded_numel, layouts[ins.unit].padded_numel * 4)


def test_free_depends_on_every_reader_of_its_buffer(mlp3):
    fwd = mlp3.program("forward")
    for idx, ins in enumerate(fwd.instructions):
        if ins.kind == "free":
            (buf,) = ins.reads
            readers = {i for i, other in enumerate(fwd.instructions[:idx]) if buf in other.touches}
            assert readers and readers <= set(ins.deps)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ("mlp", "tied", "frozen"))
def test_stage3_peak_gathered_bytes_is_at_most_two_units(name, world_size):
    schedule = compiled(name, 3, world_size).schedule
    sizes = sorted((u.padded_numel * u.itemsize for u in schedule.units), reverse=True)
    assert sizes[0] <= schedule.peak_gathered_bytes <= sum(sizes[:2])


def test_tied_root_unit_stays_gathered_across_the_forward():
    # The embedding (first use) and the head (last use) share the root unit's buffer.
    schedule = compiled("tied", 3, 2).schedule
    sizes = {u.name: u.padded_numel * u.itemsize for u in schedule.units}
    assert schedule.program("forward").peak_gathered_bytes == sizes["root"] + sizes["blocks.0"]


@pytest.mark.parametrize("stage", (1, 2))
@pytest.mark.parametrize("name", ("mlp", "frozen"))
def test_unsharded_stages_gather_only_in_the_step(name, stage):
    schedule = compiled(name, stage, 2).schedule
    for p in ("forward", "backward"):
        assert not [i for i in schedule.program(p).instructions if i.kind in ("all_gather", "free")]
    step = schedule.program("step")
    trainable = [u.name for u in schedule.units if u.trainable]
    # Units whose gradients the backward waited for first, in layout order; then those whose
    # reduce-scatters are still in flight, in the order the backward issued them.
    defined = {i.name for i in step.instructions}
    in_flight = [i.unit for i in step.instructions if i.kind == "wait" and i.reads[0] not in defined]
    issued = [i.unit for i in schedule.program("backward").instructions if i.kind == "reduce_scatter"]
    assert in_flight and in_flight == [u for u in issued if u in in_flight]
    order = [u for u in trainable if u not in in_flight] + in_flight
    assert [i.unit for i in step.instructions if i.kind == "all_gather"] == order
    assert [i.unit for i in step.instructions if i.kind == "optim_step"] == order
    assert schedule.peak_gathered_bytes == 0


def test_stage3_step_waits_for_each_gradient_right_before_its_update():
    schedule = compiled("frozen", 3, 2).schedule
    step = schedule.program("step")
    # In gradient arrival order; layers.2's gradient was waited for in the backward (the
    # prefetch pass placed that wait), layers.0's reduce-scatter, the backward's last
    # instruction, is still in flight when the step starts.
    expected = [("optim_step", "layers.2"), ("wait", "layers.0"), ("optim_step", "layers.0")]
    assert [(i.kind, i.unit) for i in step.instructions] == expected
    # The backward hands over the reduce-scatter itself, in flight: its output names it.
    backward = schedule.program("backward")
    (waited,) = [i.reads[0] for i in step.instructions if i.kind == "wait"]
    assert backward.instructions[-1].name == waited and waited in backward.outputs
    update, wait = step.instructions[-1], step.instructions[-2]
    assert wait.reads == (waited,) and update.reads[1] == wait.name  # adamw(param, grad, exp_avg, exp_avg_sq)


def test_same_model_gives_the_same_fingerprint():
    def fresh(world_size, stage=3):
        return fxzero.compile_program(
            build("tied"), example_inputs("tied"), fxzero.Config(stage=stage), world_size=world_size
        ).schedule

    a, b = fresh(2), fresh(2)
    assert a.fingerprint == b.fingerprint
    assert [(p, i.kind, i.unit, i.numel) for p, i in a.collectives()] == [
        (p, i.kind, i.unit, i.numel) for p, i in b.collectives()
    ]
    assert fresh(4).fingerprint != a.fingerprint
    assert fresh(2, stage=2).fingerprint != a.fingerprint


# ---------------------------------------------------------------------------------------------
# The validator rejects broken schedules


def test_use_after_free_is_rejected(mlp3):
    fwd = mlp3.program("forward")
    free = _index(fwd, "free")
    reader = free - 1  # the addmm that last reads the gathered buffer
    assert fwd.instructions[reader].touches == fwd.instructions[free].reads
    order = list(range(len(fwd.instructions)))
    order[reader], order[free] = order[free], order[reader]
    broken = _with_program(mlp3, _rebuild(fwd, order))
    expected = r"forward program, instruction \d+ \(compute addmm\): uses gathered buffer wait_default after it was freed"
    with pytest.raises(ScheduleError, match=expected):
        validate(broken)


def test_missing_wait_is_rejected(mlp3):
    fwd = mlp3.program("forward")
    wait = _index(fwd, "wait")
    gather, result = fwd.instructions[wait].reads[0], fwd.instructions[wait].name
    order = [i for i in range(len(fwd.instructions)) if i != wait]
    replace = {
        ins.name: {"reads": tuple(gather if r == result else r for r in ins.reads)}
        for ins in fwd.instructions
        if result in ins.reads
    }
    broken = _with_program(mlp3, _rebuild(fwd, order, replace))
    expected = r"reads all_gather_default, the result of a all_gather of unit '0', before its wait \(missing wait\)"
    with pytest.raises(ScheduleError, match=expected):
        validate(broken)


def test_collective_never_waited_for_is_rejected(mlp3):
    bwd = mlp3.program("backward")
    rs = bwd.instructions[_index(bwd, "reduce_scatter", -1)]
    assert rs.name in bwd.outputs  # left in flight for the step; not an output: never waited
    broken = _with_program(mlp3, dataclasses.replace(bwd, outputs=tuple(o for o in bwd.outputs if o != rs.name)))
    with pytest.raises(ScheduleError, match=r"backward program: reduce_scatter \S+ of unit '0' is never waited"):
        validate(broken)


def test_gradient_the_step_never_waits_for_is_rejected(mlp3):
    step = mlp3.program("step")
    wait = _index(step, "wait", -1)
    gone = step.instructions[wait].name
    replace = {i.name: {"reads": tuple(r for r in i.reads if r != gone)} for i in step.instructions if gone in i.reads}
    broken = _with_program(mlp3, _rebuild(step, [i for i in range(len(step.instructions)) if i != wait], replace))
    with pytest.raises(ScheduleError, match=r"step program: reduce_scatter \S+ of unit '0' is never waited"):
        validate(broken)


def _double_free(schedule: Schedule) -> Schedule:
    fwd = schedule.program("forward")
    free = _index(fwd, "free")
    again = dataclasses.replace(fwd.instructions[free], name="free_again")
    order = list(range(free + 1)) + [again] + list(range(free + 1, len(fwd.instructions)))
    return _with_program(schedule, _rebuild(fwd, order))


def test_double_free_is_rejected(mlp3):
    with pytest.raises(ScheduleError, match=r"\(free free_again\)"):
        validate(_double_free(mlp3))


def test_double_free_is_reported_as_a_double_free(mlp3):
    with pytest.raises(ScheduleError, match=r"frees wait_default a second time \(double free\)"):
        validate(_double_free(mlp3))


def test_gathered_buffer_never_freed_is_rejected(mlp3):
    fwd = mlp3.program("forward")
    free = _index(fwd, "free", 1)
    broken = _with_program(mlp3, _rebuild(fwd, [i for i in range(len(fwd.instructions)) if i != free]))
    with pytest.raises(ScheduleError, match=r"forward program: gathered or fetched buffers \['wait_default_1'\] are never"):
        validate(broken)


def test_read_before_definition_is_rejected(mlp3):
    fwd = mlp3.program("forward")
    view = next(i for i, ins in enumerate(fwd.instructions) if ins.name == "as_strided_default")
    user = next(i for i, ins in enumerate(fwd.instructions) if "as_strided_default" in ins.reads and i > view)
    order = list(range(len(fwd.instructions)))
    order.insert(view, order.pop(user))  # the transpose now runs before the view it reads
    broken = _with_program(mlp3, _rebuild(fwd, order))
    with pytest.raises(ScheduleError, match=r"instruction 2 \(compute t\): reads as_strided_default before it is"):
        validate(broken)


def test_dependency_on_a_later_instruction_is_rejected(mlp3):
    fwd = mlp3.program("forward")
    first = dataclasses.replace(fwd.instructions[0], deps=(3,))
    broken = _with_program(mlp3, dataclasses.replace(fwd, instructions=(first,) + fwd.instructions[1:]))
    with pytest.raises(ScheduleError, match=r"instruction 0 .*depends on instruction 3, which does not run"):
        validate(broken)


def test_schedule_edited_after_it_was_built_is_rejected(mlp3):
    data = json.loads(mlp3.dumps())
    gather = next(i for i in data["programs"][0]["instructions"] if i["kind"] == "all_gather")
    gather["unit"] = "2"
    edited = Schedule.from_json(data)
    with pytest.raises(ScheduleError, match="schedule fingerprint does not match its contents"):
        validate(edited)
    with pytest.raises(ScheduleError, match="fingerprint does not match"):
        validate(dataclasses.replace(mlp3, fingerprint="0" * 16))


def test_unknown_schedule_version_is_refused(mlp3):
    data = json.loads(mlp3.dumps())
    data["version"] = SCHEDULE_VERSION + 1
    expected = f"schedule version {SCHEDULE_VERSION + 1} is not {SCHEDULE_VERSION}"
    with pytest.raises(ValueError, match=expected):
        Schedule.from_json(data)


def test_instruction_json_round_trip():
    ins = Instruction(
        "x", "compute", "compute", reads=("a", "b"), deps=(0, 1), unit="u", touches=("w",), numel=3, bytes=12
    )
    assert Instruction.from_json(json.loads(json.dumps(ins.to_json()))) == ins


# ---------------------------------------------------------------------------------------------
# Fingerprints across ranks


def test_differing_collective_sequences_raise_naming_the_ranks_and_the_first_difference():
    a = ("forward: all_gather of root (8 x float32)", "forward: all_gather of blocks.0 (16 x float32)")
    b = ("forward: all_gather of root (8 x float32)", "forward: all_gather of blocks.1 (16 x float32)")
    message = str(first_difference([a, a, b], rank=2))
    assert message.startswith("[rank 2]") and "at collective 1" in message
    assert "ranks [0, 1] issue forward: all_gather of blocks.0" in message
    assert "ranks [2] issue forward: all_gather of blocks.1" in message
    shorter = str(first_difference([a, a[:1]], rank=0))
    assert "at collective 1" in shorter and "ranks [1] issue (nothing: its step ends)" in shorter

"""The stream rules the validator checks on every schedule ([Note: stream rules] in
`fxzero/schedule/validate.py`): a test per rule, each on a real schedule with one dependency
removed, so only the rule it targets can fail. (Reading a collective's result before its wait
and using a buffer after its free: `test_schedule.py`.)"""

from __future__ import annotations

import dataclasses

import pytest

import fxzero
from fxzero.schedule import ScheduleError, validate
from tests.passes.test_schedule import _index, _with_program
from tests.passes.toys import baseline_config, build, example_inputs

pytestmark = pytest.mark.timeout(300)


def _schedule(**config):
    cfg = dataclasses.replace(baseline_config(3), **config)
    return fxzero.compile_program(build("mlp"), example_inputs("mlp"), cfg, world_size=2).schedule


def _with_deps(schedule, program_name: str, index: int, deps: tuple[int, ...]):
    program = schedule.program(program_name)
    instructions = list(program.instructions)
    instructions[index] = dataclasses.replace(instructions[index], deps=deps)
    return _with_program(schedule, dataclasses.replace(program, instructions=tuple(instructions)))


def test_built_schedules_keep_every_stream_rule():
    for config in ({}, {"offload": fxzero.Offload(params=fxzero.Cpu(), optimizer=fxzero.Cpu())}):
        validate(_schedule(**config))  # (build_schedule validated them too)


def test_a_side_stream_reading_what_compute_made_without_an_event_is_rejected():
    schedule = _schedule()
    backward = schedule.program("backward")
    at = _index(backward, "reduce_scatter")
    scatter = backward.instructions[at]
    maker = next(i for i, ins in enumerate(backward.instructions) if ins.name == scatter.reads[0])
    assert backward.instructions[maker].stream == "compute" and maker in scatter.deps
    broken = _with_deps(schedule, "backward", at, tuple(d for d in scatter.deps if d != maker))
    with pytest.raises(ScheduleError, match=r"backward program, instruction \d+ \(reduce_scatter \S+, on the comm "
                                            r"stream\): reads \S+, made by instruction \d+ on the compute stream, "
                                            r"without depending on it"):
        validate(broken)


def test_a_free_before_a_compute_reader_is_ordered_is_rejected():
    schedule = _schedule()
    forward = schedule.program("forward")
    at = _index(forward, "free")
    (buffer,) = forward.instructions[at].reads
    made_by = next(i for i, ins in enumerate(forward.instructions) if ins.name == buffer)
    broken = _with_deps(schedule, "forward", at, (made_by,))  # after the wait, not after the readers
    with pytest.raises(ScheduleError, match=rf"forward program, instruction {at} \(free \S+\): frees {buffer} without "
                                            r"depending on compute \S+ \(instruction \d+\), which reads it"):
        validate(broken)


def test_a_free_before_a_side_streams_read_has_finished_is_rejected():
    """A fetched parameter shard is read by the all-gather on the comm stream: freeing it after
    the gather was issued but before its wait would let the fetch buffer be reused mid-gather."""
    schedule = _schedule(offload=fxzero.Offload(params=fxzero.Cpu()))
    forward = schedule.program("forward")
    frees = [i for i, ins in enumerate(forward.instructions) if ins.kind == "free"]
    at, gather = next((f, g) for f in frees for g, ins in enumerate(forward.instructions[:f])
                      if ins.kind == "all_gather" and forward.instructions[f].reads[0] in ins.reads)
    broken = _with_deps(schedule, "forward", at, (gather,))
    with pytest.raises(ScheduleError, match=r"frees \S+ without depending on the wait of all_gather \S+ "
                                            r"\(instruction \d+\), which reads it on the comm stream"):
        validate(broken)

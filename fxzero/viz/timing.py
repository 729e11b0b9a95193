"""When each instruction of a step ran, or would run: what the table and the trace draw.

Two sources, one shape (`Timeline`, a tuple of `fxzero.cost.Event`):

- `simulated(schedule, cost_model)`: `fxzero.cost.simulate`, the project's one estimator, for
  a hardware preset (`fxzero.cost.PRESETS`). Nothing here estimates anything.
- `recorded(art)`: what `fxzero train` measured on every rank in its last step
  (`Artifacts.timeline`, from `Engine.record_timeline`). A collective is drawn on the comm
  stream from when it was issued to when its wait returned (the executor learns nothing
  closer about when the collective itself finished); everything else, waits included, on the
  compute stream. The optimizer step is not recorded per instruction, only as a whole.

Times are seconds from the start of the step: for recorded timelines, from the earliest
instruction of any rank, so that the ranks line up (all ranks of `fxzero train` share one
machine's monotonic clock).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from fxzero.artifacts import ArtifactError
from fxzero.cost import CostModel, Event, SimResult, simulate
from fxzero.ir.instruction import COLLECTIVES
from fxzero.schedule import Schedule

__all__ = ["Timeline", "recorded", "simulated"]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One rank's step: an event per instruction that has a time, and each program's span."""

    label: str
    """What it is, for titles: "simulated for cpu-loopback", "rank 1 (recorded, step 20)"."""
    events: tuple[Event, ...]
    programs: dict[str, tuple[float, float]]
    """Program name -> (start, end), in the order the programs ran."""
    rank: Optional[int] = None
    """The rank it was recorded on; None when simulated."""
    sim: Optional[SimResult] = None
    """The simulator's result (busy, exposed communication), when simulated."""

    def at(self) -> dict[tuple[str, int], Event]:
        """(program, index) -> event."""
        return {(e.program, e.index): e for e in self.events}


def _spans(events: tuple[Event, ...]) -> dict[str, tuple[float, float]]:
    spans: dict[str, tuple[float, float]] = {}
    for e in events:
        start, end = spans.get(e.program, (e.start, e.end))
        spans[e.program] = (min(start, e.start), max(end, e.end))
    return spans


def simulated(schedule: Schedule, cost_model: CostModel) -> Timeline:
    """The step as `fxzero.cost.simulate` replays it on `cost_model`."""
    sim = simulate(schedule, cost_model)
    return Timeline(f"simulated for {cost_model.name}", sim.events, _spans(sim.events), sim=sim)


def _bad(art, what: str) -> ArtifactError:
    where = f"{art.directory}/timeline.json" if art.directory else "the recorded timeline"
    return ArtifactError(f"{where}: {what}; record it again with `fxzero train`")


def recorded(art) -> list[Timeline]:
    """The timelines `fxzero train` recorded, one per rank in rank order ([] if there are none).

    Raises:
        ArtifactError: the recording is malformed or names an instruction the schedule does
            not have.
    """
    rec = art.timeline
    if not rec:
        return []
    try:
        return _recorded(art, rec)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise _bad(art, f"not a recorded timeline ({e!r})") from e


def _recorded(art, rec: dict) -> list[Timeline]:
    programs = {p.name: p for p in art.schedule.programs}
    # (program, collective) -> index of its wait
    wait_of = {(p.name, ins.reads[0]): j for p in art.schedule.programs
               for j, ins in enumerate(p.instructions) if ins.kind == "wait" and ins.reads}
    ranks = sorted(rec["ranks"], key=lambda r: r["rank"])
    starts = [t[2] for r in ranks for t in r["instructions"]] + [r["step_program"][0] for r in ranks if r.get("step_program")]
    t0 = min(starts, default=0.0)
    out = []
    for r in ranks:
        ran: dict[tuple[str, int], tuple[float, float]] = {}
        for program, index, start, end in r["instructions"]:
            p = programs.get(program)
            if p is None or not 0 <= index < len(p.instructions):
                raise _bad(art, f"rank {r['rank']} ran {program} #{index}, which the schedule does not have")
            ran[(program, index)] = (start - t0, end - t0)
        events = []
        for (program, index), (start, end) in ran.items():  # in the order they ran
            ins = programs[program].instructions[index]
            stream = "compute"
            if ins.kind in COLLECTIVES:
                stream = "comm"
                wait = wait_of.get((program, ins.name))
                if (program, wait) in ran:
                    end = max(end, ran[(program, wait)][1])
            events.append(Event(program, index, ins.name, ins.kind, stream, start, end))
        spans = _spans(tuple(events))
        if r.get("step_program"):
            start, end = r["step_program"]
            spans["step"] = (start - t0, end - t0)
        label = f"rank {r['rank']} (recorded by fxzero train, step {rec.get('step', '?')})"
        out.append(Timeline(label, tuple(events), spans, rank=r["rank"]))
    return out


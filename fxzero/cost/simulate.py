"""The simulator: a Schedule replayed under a cost model, without running it.

`simulate` replays a Schedule on a compute, a comm and an io stream and returns the step time,
the communication and storage I/O left exposed (compute waiting on them) and the peak of
gathered memory.
"""

from __future__ import annotations

import dataclasses

from fxzero.cost.model import CostModel
from fxzero.ir.instruction import COLLECTIVES, IO
from fxzero.schedule.types import Schedule

__all__ = ["Event", "SimResult", "simulate"]


@dataclasses.dataclass(frozen=True)
class Event:
    program: str
    index: int
    name: str
    kind: str
    stream: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    step_seconds: float
    compute_seconds: float
    """Busy time of the compute stream."""
    comm_seconds: float
    """Busy time of the comm stream."""
    exposed_comm_seconds: float
    """Time the compute stream sat waiting for collectives."""
    peak_gathered_bytes: int
    events: tuple[Event, ...]
    io_seconds: float = 0.0
    """Busy time of the io stream (reads and writes of offloaded states)."""
    exposed_io_seconds: float = 0.0
    """Time the compute stream sat waiting for reads or writes."""

    def summary(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "events"}


def _priced_as(ins, cost: CostModel) -> str:
    """The link a collective is priced on: how it is carried out (a reduce-scatter done as an
    all-reduce costs an all-reduce), falling back to the all-gather link a model may only have."""
    kind = ins.algorithm or ins.kind
    return kind if kind in cost.links else "all_gather"


def simulate(schedule: Schedule, cost: CostModel) -> SimResult:
    """Replay `schedule`'s programs (forward, backward, step) on compute, comm and io streams.

    Each instruction starts when its stream is free and its dependencies have ended; a
    collective runs on the comm stream, a fetch or offload on the io stream, one at a time in
    issue order; its wait (on the compute stream) ends when it has. Programs run back to back
    on the compute stream; a collective one program leaves in flight (a gradient the step waits
    for) goes on on its stream.
    """
    world = schedule.world_size
    clock = {"compute": 0.0, "comm": 0.0, "io": 0.0}
    busy = {"compute": 0.0, "comm": 0.0, "io": 0.0}
    exposed = {"comm": 0.0, "io": 0.0}
    events: list[Event] = []
    stream_of: dict[str, str] = {}
    end: dict[str, float] = {}
    for program in schedule.programs:
        start_of_program = clock["compute"]
        clock = {stream: max(t, start_of_program) for stream, t in clock.items()}
        by_index: list[float] = []
        names = [i.name for i in program.instructions]
        for idx, ins in enumerate(program.instructions):
            waited = ins.reads[0] if ins.kind == "wait" and ins.reads else None
            ready = max((by_index[d] for d in ins.deps if names[d] != waited), default=start_of_program)
            if ins.kind in COLLECTIVES or ins.kind in IO:
                # Issued by the compute stream in program order, carried out by the comm stream
                # (collectives) or the io stream (transfers to and from storage tiers).
                stream = "comm" if ins.kind in COLLECTIVES else "io"
                begin = max(clock[stream], ready, clock["compute"])
                if stream == "comm":
                    duration = cost.collective_seconds(_priced_as(ins, cost), ins.bytes, world)
                else:
                    duration = cost.io_seconds(ins)
                stream_of[ins.name] = stream
            else:
                begin = max(clock["compute"], ready)
                duration = cost.compute_seconds(ins)
                stream = "compute"
                # Communication and storage I/O in flight while this op computes take part of its
                # CPU.
                overlap = max(0.0, min(clock["comm"], begin + duration) - begin)
                io_overlap = max(0.0, min(clock["io"], begin + duration) - begin)
                duration += cost.comm_interference * overlap + cost.io_interference * io_overlap
                if waited is not None:
                    collective_end = end.get(waited, begin)
                    if collective_end > begin:
                        exposed[stream_of.get(waited, "comm")] += collective_end - begin
                        begin = collective_end
            finish = begin + duration
            clock[stream] = finish
            busy[stream] += duration
            end[ins.name] = finish
            by_index.append(finish)
            events.append(Event(program.name, idx, ins.name, ins.kind, stream, begin, finish))
    return SimResult(
        step_seconds=max(clock.values()),
        compute_seconds=busy["compute"],
        comm_seconds=busy["comm"],
        exposed_comm_seconds=exposed["comm"],
        peak_gathered_bytes=schedule.peak_gathered_bytes,
        events=tuple(events),
        io_seconds=busy["io"],
        exposed_io_seconds=exposed["io"],
    )

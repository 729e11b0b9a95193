"""Estimated start and end of every scheduled instruction on some hardware.

This is the CLI's small, self-contained estimator; its one entry point,
`instruction_times(schedule, hardware)`, is kept narrow so that it can be replaced by the
project's cost model and simulator (`fxzero.cost.simulate`) without touching the viewers.

The model, in one paragraph: a compute instruction takes the slower of its FLOPs at the
hardware's FLOP rate and its bytes (read + written) at its memory bandwidth, plus a fixed
dispatch overhead; ops without FLOPs are taken as copies (twice their output bytes), since the
schedule does not say which ops are free views. A collective moves (N-1)/N of its buffer over a
ring at the link's bandwidth, plus a latency. Instructions run in program order on their
stream (compute or comm); each starts when its stream is free and its dependencies have ended;
a collective is issued by the compute stream in program order, so it cannot start before the
compute instructions ahead of it have ended; a wait ends when its collective has. Programs
(forward, backward, step) run back to back.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from fxzero.schedule import Instruction, Schedule

__all__ = ["DEFAULT_HARDWARE", "HARDWARE", "Hardware", "hardware", "instruction_times", "summarize"]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """Rough effective rates of one rank and its link, for estimates."""

    name: str
    description: str
    flops_per_s: float
    """Sustained FLOP rate of one rank on the model's dtype."""
    mem_bytes_per_s: float
    """Bytes per second one rank reads plus writes in memory-bound ops."""
    op_overhead_s: float
    """Fixed cost of dispatching one op."""
    link_bytes_per_s: float
    """Bytes per second one rank moves in a ring collective."""
    link_latency_s: float
    """Seconds added to every collective."""
    world_size: Optional[int] = None
    """Ranks the collectives run over; None: the schedule's own world size."""

    def compute_seconds(self, ins: Instruction) -> float:
        if ins.kind == "optim_step":
            # AdamW reads param, grad and two moments and writes three: ~7 passes over the shard.
            return 10 * self.op_overhead_s + 7 * ins.bytes / self.mem_bytes_per_s
        if ins.kind in ("wait", "free"):
            return 0.0
        if ins.flops:
            moved = ins.read_bytes + ins.bytes
            return self.op_overhead_s + max(ins.flops / self.flops_per_s, moved / self.mem_bytes_per_s)
        return self.op_overhead_s + 2 * ins.bytes / self.mem_bytes_per_s

    def collective_seconds(self, nbytes: int, world_size: int) -> float:
        world = self.world_size or world_size
        if world <= 1:
            return self.link_latency_s
        return self.link_latency_s + nbytes * (world - 1) / world / self.link_bytes_per_s


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            name="cpu-loopback",
            description="this kind of box: 2 CPU cores, gloo over loopback, one thread per rank",
            flops_per_s=90e9, mem_bytes_per_s=5e9, op_overhead_s=25e-6,
            link_bytes_per_s=1.0e9, link_latency_s=100e-6,
        ),
        Hardware(
            name="h100x8-nvlink",
            description="8 x H100 SXM on NVLink 4, fp32 without tensor cores",
            flops_per_s=50e12, mem_bytes_per_s=3e12, op_overhead_s=5e-6,
            link_bytes_per_s=360e9, link_latency_s=15e-6, world_size=8,
        ),
        Hardware(
            name="h100x64-ib400",
            description="64 x H100 (8 nodes) on 400 Gb/s InfiniBand, fp32 without tensor cores",
            flops_per_s=50e12, mem_bytes_per_s=3e12, op_overhead_s=5e-6,
            link_bytes_per_s=45e9, link_latency_s=40e-6, world_size=64,
        ),
    )
}
"""Named hardware for `--simulate`."""

DEFAULT_HARDWARE = "cpu-loopback"


def hardware(name: str) -> Hardware:
    """The preset called `name`.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name]


Times = dict[tuple[str, int], tuple[float, float, str]]


def instruction_times(schedule: Schedule, hw: Hardware) -> Times:
    """(program, index) -> (start, end, stream), in seconds from the start of the step."""
    out: Times = {}
    t0 = 0.0
    for program in schedule.programs:
        clock = {"compute": t0, "comm": t0}
        ends: list[float] = []
        end_of: dict[str, float] = {}
        for idx, ins in enumerate(program.instructions):
            ready = max((ends[d] for d in ins.deps), default=t0)
            if ins.kind in COLLECTIVE_KINDS:
                stream = "comm"
                start = max(clock["comm"], clock["compute"], ready)
                finish = start + hw.collective_seconds(ins.bytes, schedule.world_size)
            else:
                stream = ins.stream if ins.stream != "comm" else "compute"
                start = max(clock.get(stream, t0), ready)
                if ins.kind == "wait" and ins.reads:
                    start = max(start, end_of.get(ins.reads[0], start))
                finish = start + hw.compute_seconds(ins)
            clock[stream] = finish
            ends.append(finish)
            end_of[ins.name] = finish
            out[(program.name, idx)] = (start, finish, stream)
        t0 = max(clock.values())
    return out


def summarize(schedule: Schedule, times: Times) -> dict:
    """Step time, busy time per stream, exposed communication and each program's span.

    Exposed communication is the time the compute stream sits idle waiting for a collective.
    """
    busy: dict[str, float] = {}
    exposed = 0.0
    programs = {}
    for program in schedule.programs:
        spans = [times[(program.name, i)] for i in range(len(program.instructions))]
        begin = min((s for s, _, _ in spans), default=0.0)
        finish = max((e for _, e, _ in spans), default=begin)
        compute_free = begin
        for ins, (s, e, stream) in zip(program.instructions, spans):
            busy[stream] = busy.get(stream, 0.0) + (e - s if ins.kind != "wait" else 0.0)
            if stream == "compute":
                exposed += max(0.0, s - compute_free)
                compute_free = max(compute_free, e)
        exposed += max(0.0, finish - compute_free)  # draining outstanding collectives at the end
        programs[program.name] = {"start": begin, "end": finish}
    step = max((p["end"] for p in programs.values()), default=0.0)
    return {"step_seconds": step, "busy_seconds": busy, "exposed_comm_seconds": exposed, "programs": programs}

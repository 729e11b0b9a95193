"""A Chrome / Perfetto trace (JSON "Trace Event Format") of a step.

Open it at ui.perfetto.dev or chrome://tracing. One process per `fxzero.viz.timing.Timeline`:
the step simulated for a hardware preset, or, for a directory written by `fxzero train`, every
rank's recorded step. Each process has a track with the programs' spans, a compute track and a
comm track with one slice per instruction, and a counter of the gathered and resident memory
the schedule implies (`fxzero.liveness`) at each instruction's start.

A recorded collective lasts from its issue to its wait's end, so with prefetch several can be
in flight at once; slices on one track must nest, so overlapping ones go to further comm
tracks ("comm 2", ...).
"""

from __future__ import annotations

from typing import Sequence

from fxzero.viz.series import memory_series
from fxzero.viz.timing import Timeline

__all__ = ["chrome_trace"]

_TIDS = {"programs": 0, "compute": 1, "comm": 2}
_EXTRA_LANES = 10  # tid of "comm 2" and beyond


def _meta(pid: int, tid: int | None, key: str, name: str) -> dict:
    event = {"ph": "M", "pid": pid, "name": key, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


def _comm_lanes(timeline: Timeline) -> dict[tuple[str, int], int]:
    """(program, index) -> tid for comm events: the first lane free when the event starts."""
    lanes: list[float] = []  # end of the last slice on each lane
    tids = {}
    for e in sorted((e for e in timeline.events if e.stream == "comm"), key=lambda e: e.start):
        lane = next((k for k, end in enumerate(lanes) if end <= e.start), len(lanes))
        if lane == len(lanes):
            lanes.append(e.end)
        lanes[lane] = e.end
        tids[(e.program, e.index)] = _TIDS["comm"] if lane == 0 else _EXTRA_LANES + lane
    return tids


def _process(art, pid: int, timeline: Timeline) -> list[dict]:
    s = art.schedule
    events = [_meta(pid, None, "process_name", timeline.label)]
    lanes = _comm_lanes(timeline)
    tracks = dict(_TIDS)
    for tid in sorted(set(lanes.values()) - {_TIDS["comm"]}):
        tracks[f"comm {tid - _EXTRA_LANES + 1}"] = tid
    for name, tid in tracks.items():
        events.append(_meta(pid, tid, "thread_name", name))
    for name, (start, end) in timeline.programs.items():
        events.append({"ph": "X", "pid": pid, "tid": _TIDS["programs"], "name": name, "cat": "program",
                       "ts": start * 1e6, "dur": (end - start) * 1e6})
    at = timeline.at()
    mem = memory_series(art)
    for k, (program, idx) in enumerate(mem.points):
        e = at.get((program, idx))
        if e is None:  # not recorded (the optimizer step runs as a whole)
            continue
        ins = s.program(program).instructions[idx]
        tid = lanes[(program, idx)] if e.stream == "comm" else _TIDS.get(e.stream, _TIDS["compute"])
        events.append({
            "ph": "X", "pid": pid, "tid": tid, "name": ins.name, "cat": ins.kind,
            "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
            "args": {"program": program, "index": idx, "kind": ins.kind, "unit": ins.unit,
                     "bytes": ins.bytes, "flops": ins.flops},
        })
        events.append({"ph": "C", "pid": pid, "name": "memory (bytes, from the schedule)", "ts": e.start * 1e6,
                       "args": {"gathered": mem.gathered[k], "resident": mem.resident(k)}})
    return events


def chrome_trace(art, timelines: Sequence[Timeline], *, source: str, hardware: str | None = None) -> dict:
    """The trace as a JSON-able dict (`{"traceEvents": [...], ...}`); timestamps in microseconds.

    Args:
        timelines: one process each, in order (pid = rank when recorded).
        source: "simulated" or "recorded", written to otherData["timeline"].
        hardware: the preset a simulated timeline is for.
    """
    s = art.schedule
    events: list[dict] = []
    for k, timeline in enumerate(timelines):
        events += _process(art, timeline.rank if timeline.rank is not None else k, timeline)
    other = {"model": art.manifest.get("model"), "world_size": s.world_size, "stage": s.stage,
             "fingerprint": s.fingerprint, "timeline": source}
    if hardware is not None:
        other["hardware"] = hardware
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}

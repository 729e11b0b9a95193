"""A Chrome / Perfetto trace (JSON "Trace Event Format") of a step.

Open it at ui.perfetto.dev or chrome://tracing. One process, "schedule (estimated on HW)",
holds a track per stream with one slice per instruction, in the order and at the times of
`fxzero.timeline.instruction_times`, a track with the programs' spans, and counters of
gathered and resident memory. When the artifacts come from `fxzero train`, one process per
rank adds what was recorded: each step's forward, backward and optimizer-step spans.
"""

from __future__ import annotations

from fxzero.timeline import Hardware, Times, summarize
from fxzero.viz.series import memory_series

__all__ = ["chrome_trace"]

SCHEDULE_PID = 0
_TIDS = {"programs": 0, "compute": 1, "comm": 2, "io": 3}


def _meta(pid: int, tid: int | None, key: str, name: str) -> dict:
    event = {"ph": "M", "pid": pid, "name": key, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


def chrome_trace(art, times: Times, hw: Hardware) -> dict:
    """The trace as a JSON-able dict (`{"traceEvents": [...], ...}`); timestamps in microseconds."""
    s = art.schedule
    events: list[dict] = [_meta(SCHEDULE_PID, None, "process_name", f"schedule (estimated on {hw.name})")]
    streams = sorted({stream for _, _, stream in times.values()}, key=lambda x: _TIDS.get(x, 9))
    for stream in ("programs", *streams):
        events.append(_meta(SCHEDULE_PID, _TIDS.get(stream, 9), "thread_name", stream))
    for name, span in summarize(s, times)["programs"].items():
        events.append({"ph": "X", "pid": SCHEDULE_PID, "tid": 0, "name": name, "cat": "program",
                       "ts": span["start"] * 1e6, "dur": (span["end"] - span["start"]) * 1e6})
    mem = memory_series(art)
    for k, ((program, idx), _) in enumerate(zip(mem.points, mem.gathered)):
        ins = s.program(program).instructions[idx]
        start, end, stream = times[(program, idx)]
        events.append({
            "ph": "X", "pid": SCHEDULE_PID, "tid": _TIDS.get(stream, 9), "name": ins.name, "cat": ins.kind,
            "ts": start * 1e6, "dur": (end - start) * 1e6,
            "args": {"program": program, "index": idx, "kind": ins.kind, "unit": ins.unit,
                     "bytes": ins.bytes, "flops": ins.flops},
        })
        events.append({"ph": "C", "pid": SCHEDULE_PID, "name": "memory (bytes)", "ts": start * 1e6,
                       "args": {"gathered": mem.gathered[k], "resident": mem.resident(k)}})
    if art.run:
        events += _recorded(art.run)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"model": art.manifest.get("model"), "world_size": s.world_size, "stage": s.stage,
                      "fingerprint": s.fingerprint, "hardware": hw.name},
    }


def _recorded(run: dict) -> list[dict]:
    """Per-rank spans measured by `fxzero train`, starting at the first one."""
    spans = run.get("spans", [])
    if not spans:
        return []
    t0 = min(sp["start"] for sp in spans)
    events = []
    for rank in sorted({sp["rank"] for sp in spans}):
        pid = 1 + rank
        events.append(_meta(pid, None, "process_name", f"rank {rank} (recorded by fxzero train)"))
        events.append(_meta(pid, 0, "thread_name", "steps"))
    for sp in spans:
        events.append({"ph": "X", "pid": 1 + sp["rank"], "tid": 0, "name": sp["name"], "cat": "recorded",
                       "ts": (sp["start"] - t0) * 1e6, "dur": (sp["end"] - sp["start"]) * 1e6,
                       "args": {"step": sp["step"]}})
    return events

"""The schedule explorer: one offline HTML page of a step, per stream, rank and program.

`fxzero schedule DIR --html out.html` (and `--html out.html DIR_A DIR_B`, both on one time
axis). Record, then view: Python turns the artifacts into one JSON value (`explorer_data`) and
the page (`explorer.html`, a template beside this module) only draws it:

- every program's instructions (kind, stream, unit, bytes) in the order the runtime runs them;
  an instruction's unit is its own (`Instruction.unit`) or, for a compute instruction without
  one, the unit module whose forward made it (graph.json's `owner`), so the unit filter shows a
  unit's gather, compute, free and reduce-scatter;
- per hardware preset (`fxzero.cost.PRESETS`), when each instruction starts and ends as
  `fxzero.cost.simulate` replays it, and the summary `fxzero schedule --simulate PRESET` prints
  (its own lines, `fxzero.viz.table.summary_lines`): the page computes no figure of its own;
- after `fxzero train`, what each rank measured (`fxzero.viz.timing.recorded`), one lane group
  per rank;
- the memory the schedule implies at each instruction (`fxzero.viz.series.memory_series`), with
  the time it is reached on each timeline (`_memory_times`).

The page inlines uPlot (vendor/uplot, pinned with its license and checksums; refreshed by
scripts/refresh_uplot.sh) for the memory curve; the lanes are drawn on a plain canvas.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Callable, Optional, Sequence

from fxzero.cost import CostModel
from fxzero.viz.series import memory_series
from fxzero.viz.table import recorded_lines, summary_lines
from fxzero.viz.timing import Timeline, recorded, simulated

__all__ = ["explorer_data", "render_explorer", "unit_of"]

VENDOR = "vendor/uplot"
MARKERS = {"data": "/*EXPLORER_DATA*/{}", "css": "/*UPLOT_CSS*/", "js": "/*UPLOT_JS*/"}


def unit_of(ins, owners: dict[str, str]) -> Optional[str]:
    """The unit an instruction belongs to: its own, else its owner module's (compute)."""
    return ins.unit or owners.get(ins.name)


def _summary(lines: list[str]) -> dict[str, str]:
    """`summary_lines`' "  label  value" lines as {label: value}: the text the CLI prints."""
    out = {}
    for line in lines[1:]:
        label, value = line[2:20].strip(), line[21:]
        out[label] = value
    return out


def _memory_times(art, timeline: Timeline) -> list[Optional[float]]:
    """When the compute stream reaches each instruction, in program order (the memory curve's x).

    The schedule's memory changes as instructions are issued, in program order. A compute
    instruction is reached when it starts; an asynchronous one (a collective, a fetch) is issued
    when the compute instruction before it ended, though its stream may carry it out later.
    The times never go back, so the curve is a function of time. None where nothing was timed.
    """
    at = timeline.at()
    out: list[Optional[float]] = []
    last = 0.0
    for p in art.schedule.programs:
        start, _ = timeline.programs.get(p.name, (last, last))
        issued = max(last, start)
        for i in range(len(p.instructions)):
            e = at.get((p.name, i))
            if e is None:
                out.append(None)
                continue
            t = e.start if e.stream == "compute" else issued
            last = max(last, t)
            if e.stream == "compute":
                issued = max(issued, e.end)
            out.append(last)
    return out


def _times(art, timeline: Timeline) -> list[Optional[list]]:
    """[start, end, stream] per instruction in program order (None where not timed)."""
    at = timeline.at()
    rows = []
    for p in art.schedule.programs:
        for i in range(len(p.instructions)):
            e = at.get((p.name, i))
            rows.append(None if e is None else [e.start, e.end, e.stream])
    return rows


def _timeline(art, timeline: Timeline) -> dict:
    return {"label": timeline.label, "times": _times(art, timeline), "memory_x": _memory_times(art, timeline),
            "programs": [[name, start, end] for name, (start, end) in timeline.programs.items()]}


def _run(art, source: str, label: str, presets: dict[str, CostModel], describe: Callable[[CostModel], str]) -> dict:
    s, m = art.schedule, art.manifest
    owners = {n["name"]: n.get("owner") for n in art.graph["nodes"] if n.get("owner")}
    mem = memory_series(art)
    peak, at = mem.peak()
    run = {
        "label": label,
        "source": source,
        "title": f"{m.get('model')}: ZeRO-{s.stage} on {s.world_size} ranks, {len(s.units)} units, "
                 f"fingerprint {s.fingerprint}",
        "units": [{"name": u.name, "numel": sum(p.numel for p in u.slots), "bytes": u.padded_numel * u.itemsize}
                  for u in s.units],
        "programs": [{"name": p.name, "instructions": [
            {"name": ins.name, "kind": ins.kind, "stream": ins.stream, "unit": unit_of(ins, owners),
             "bytes": ins.bytes, "numel": ins.numel, "flops": ins.flops, "tier": ins.tier, "state": ins.state,
             "algorithm": ins.algorithm} for ins in p.instructions]} for p in s.programs],
        "memory": {"states": mem.states, "gathered": list(mem.gathered),
                   "resident": [mem.resident(k) for k in range(len(mem.points))],
                   "peak": {"bytes": peak, "at": at}},
        "simulated": {},
        "recorded": None,
    }
    for name, cost_model in presets.items():
        sim = simulated(s, cost_model)
        summary = _summary(summary_lines(art, sim, describe(cost_model)))
        run["simulated"][name] = dict(_timeline(art, sim), summary=summary, figures=sim.sim.summary())
    ranks = recorded(art)
    if ranks:
        step = (art.timeline or {}).get("step", "?")
        lines = recorded_lines(ranks, step)[1:]
        run["recorded"] = {"step": step, "ranks": [
            dict(_timeline(art, t), rank=t.rank, summary=line.strip()) for t, line in zip(ranks, lines)]}
    return run


def explorer_data(runs: Sequence[tuple[str, object]], presets: dict[str, CostModel], *, default_preset: str,
                  describe: Callable[[CostModel], str] = lambda cm: cm.name) -> dict:
    """Everything the page draws, as JSON-able values.

    Args:
        runs: (source as given, `fxzero.artifacts.Artifacts`) per directory; two are compared.
        presets: the hardware presets the page offers, by name.
        default_preset: the one shown first (`fxzero schedule --simulate`).
        describe: a preset in words, for the summary's "hardware" line.
    """
    if default_preset not in presets:
        raise ValueError(f"unknown hardware {default_preset!r}; choose one of {sorted(presets)}")
    labels = ["A", "B", "C", "D"] if len(runs) > 1 else [""]
    return {
        "version": 1,
        "presets": {name: {"label": name, "describe": describe(cm)} for name, cm in presets.items()},
        "default_preset": default_preset,
        "runs": [_run(art, source, label, presets, describe) for (source, art), label in zip(runs, labels)],
    }


def _vendored(name: str) -> str:
    return resources.files("fxzero.viz").joinpath(f"{VENDOR}/{name}").read_text(encoding="utf-8")


def render_explorer(data: dict) -> str:
    """The page: the template with uPlot and `data` inlined (no external reference of any kind)."""
    template = resources.files("fxzero.viz").joinpath("explorer.html").read_text(encoding="utf-8")
    for marker in MARKERS.values():
        assert template.count(marker) == 1, f"explorer.html must hold {marker} once"
    # "</" inside a script or style element would end it; JSON allows "<\/".
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    js, css = _vendored("uPlot.iife.min.js"), _vendored("uPlot.min.css")
    assert "</script" not in js.lower() and "</style" not in css.lower()
    # Substituted in one pass, so nothing inlined is searched for the other markers.
    parts = {MARKERS["data"]: payload, MARKERS["css"]: css, MARKERS["js"]: js}
    out, rest = [], template
    while True:
        found = [(rest.find(m), m) for m in parts if rest.find(m) >= 0]
        if not found:
            break
        pos, marker = min(found)
        out += [rest[:pos], parts.pop(marker)]
        rest = rest[pos + len(marker):]
    return "".join(out) + rest

"""The schedule as text: one row per instruction (compute runs folded), one column per stream.

    #    start     time  compute                               comm                       bytes
    0        0   111 us                                        all_gather root         14.2 KiB
    1   111 us        0  wait root (all_gather)
    2   111 us  1.27 ms  root: 12 ops (embedding x2, add, ...)                           9.3 KiB
"""

from __future__ import annotations

import collections
from typing import Optional

from fxzero.viz.fmt import human_bytes, human_count, human_seconds
from fxzero.viz.series import memory_series
from fxzero.viz.timing import Timeline

__all__ = ["recorded_lines", "schedule_table", "summary_lines"]

STREAM_ORDER = ("compute", "comm", "io")
WIDTH = {"compute": 54, "comm": 30, "io": 30}


def _short(target: str) -> str:
    return target.split(".", 1)[-1] if target.startswith(("aten.", "fxzero.")) else target


def _cell(text: str, width: int) -> str:
    """`text` padded to `width`, cut with an ellipsis when longer."""
    if len(text) >= width:
        text = text[: width - 2] + "~"
    return f"{text:<{width}}"


def _describe(ins) -> str:
    if ins.kind == "wait":
        return f"wait {ins.unit}"
    if ins.kind == "optim_step":
        return f"optimizer step {ins.unit}"
    if ins.kind in ("fetch", "offload"):
        return f"{ins.kind} {ins.state} {ins.unit} ({ins.tier})"
    if ins.kind in ("all_gather", "reduce_scatter", "free"):
        how = ins.algorithm
        return f"{ins.kind} {ins.unit}" + (f" (as {how})" if how and how != ins.kind else "")
    return ins.name


def _rows(program, times: dict, nodes: dict[str, dict], full: bool):
    """(first index, last index, stream, text, bytes, flops, start, duration) per row."""
    run: list[int] = []
    run_owner: Optional[str] = None

    def flush():
        nonlocal run
        if not run:
            return None
        counts = collections.Counter(_short(nodes.get(program.instructions[i].name, {}).get("target", "?")) for i in run)
        top = ", ".join(f"{t} x{c}" if c > 1 else t for t, c in counts.most_common(3))
        more = ", ..." if len(counts) > 3 else ""
        start = times[(program.name, run[0])].start
        end = max(times[(program.name, i)].end for i in run)
        text = f"{run_owner}: {len(run)} ops ({top}{more})"
        row = (run[0], run[-1], "compute", text,
               sum(program.instructions[i].bytes for i in run), sum(program.instructions[i].flops for i in run),
               start, end - start)
        run = []
        return row

    for i, ins in enumerate(program.instructions):
        owner = nodes.get(ins.name, {}).get("owner")
        if ins.kind == "compute" and not full:
            if run and owner != run_owner:
                yield flush()
            run_owner = owner
            run.append(i)
            continue
        if run:
            yield flush()
        e = times[(program.name, i)]
        start, end, stream = e.start, e.end, e.stream
        text = _describe(ins) if ins.kind != "compute" else f"{ins.name} = {_short(nodes.get(ins.name, {}).get('target', '?'))}"
        yield (i, i, stream, text, ins.bytes if ins.kind not in ("wait", "free") else 0, ins.flops, start, end - start)
    if run:
        yield flush()


def schedule_table(art, timeline: Timeline, *, full: bool = False) -> list[str]:
    """Lines of the table: every program, instructions in the order the runtime runs them,
    at the times of `timeline` (which must time every instruction: a simulated one)."""
    times = timeline.at()
    nodes = {n["name"]: n for n in art.graph["nodes"]}
    streams = [s for s in STREAM_ORDER if any(i.stream == s for p in art.schedule.programs for i in p.instructions)]
    streams += sorted({i.stream for p in art.schedule.programs for i in p.instructions} - set(streams))
    lines = []
    for program in art.schedule.programs:
        n = len(program.instructions)
        if n == 0:
            lines.append(f"{program.name} program: empty")
            lines.append("")
            continue
        start, end = timeline.programs[program.name]
        lines.append(f"{program.name} program: {n} instructions, {human_seconds(end - start)} {timeline.label}")
        header = f"{'#':>9} {'start':>9} {'time':>9}  " + "".join(f"{s:<{WIDTH.get(s, 30)}}" for s in streams) + f"{'bytes':>10} {'flops':>7}"
        lines.append(header)
        for first, last, stream, text, nbytes, flops, start, dur in _rows(program, times, nodes, full):
            idx = f"{first}" if first == last else f"{first}-{last}"
            cells = "".join(_cell(text if s == stream else "", WIDTH.get(s, 30)) for s in streams)
            lines.append(
                f"{idx:>9} {human_seconds(start):>9} {human_seconds(dur):>9}  {cells}"
                f"{human_bytes(nbytes) if nbytes else '':>10} {human_count(flops) if flops else '':>7}"
            )
        lines.append("")
    return lines


def summary_lines(art, timeline: Timeline, hardware: str) -> list[str]:
    """Step time, exposed communication, bytes per collective kind, peak memory.

    Args:
        timeline: the simulated step (`fxzero.viz.timing.simulated`).
        hardware: what the simulation is for, in words.
    """
    s = art.schedule
    sim = timeline.sim
    assert sim is not None, "summary_lines needs a simulated timeline"
    step = sim.step_seconds
    parts = " + ".join(f"{name} {human_seconds(end - start)}" for name, (start, end) in timeline.programs.items())
    exposed = sim.exposed_comm_seconds
    lines = [
        f"summary (per rank; times {timeline.label} by fxzero.cost)",
        f"  hardware           {hardware}",
        f"  step time          {human_seconds(step)} = {parts}",
        f"  busy               compute {human_seconds(sim.compute_seconds)}, comm {human_seconds(sim.comm_seconds)}",
        f"  exposed comm       {human_seconds(exposed)} ({100 * exposed / step if step else 0:.0f}% of the step: compute waiting for collectives)",
    ]
    per_kind: dict[str, dict] = {}
    for program, ins in s.collectives():
        k = per_kind.setdefault(ins.kind, {"calls": 0, "bytes": 0, "elements": 0, "by_program": collections.Counter()})
        k["calls"] += 1
        k["bytes"] += ins.bytes
        k["elements"] += ins.numel
        k["by_program"][program] += 1
    for kind, k in per_kind.items():
        where = ", ".join(f"{p} {c}" for p, c in k["by_program"].items())
        lines.append(f"  {kind:<18} {k['calls']} calls, {human_bytes(k['bytes'])} ({k['elements']:,} elements; {where})")
    mem = memory_series(art)
    peak, at = mem.peak()
    where = f"{mem.points[at][0]} #{mem.points[at][1]}" if at >= 0 else "-"
    lines.append(
        f"  peak gathered      {human_bytes(s.peak_gathered_bytes)} (params gathered at once, from the schedule)"
    )
    if s.kept_for_backward:
        units = {u.name: u.padded_numel * u.itemsize for u in s.units}
        kept = sum(units[u] for u in s.kept_for_backward)
        lines.append(f"  kept for backward  {', '.join(s.kept_for_backward)} ({human_bytes(kept)}: gathered once, "
                     "alive from the forward into the backward)")
    if s.shards_kept_for_backward:
        lines.append(f"  shards kept        {', '.join(s.shards_kept_for_backward)} (parameter shards read once from "
                     "their tier, kept from the forward for the backward)")
    lines.append(
        f"  peak resident      {human_bytes(peak)} at {where} = params + optimizer {human_bytes(mem.states)}"
        + (f" + gathered {human_bytes(mem.gathered[at])} + activations {human_bytes(mem.activations[at])}"
           f" + gradients {human_bytes(mem.gradients[at])}" if at >= 0 else "")
    )
    return lines


def recorded_lines(recorded: list[Timeline], step: object) -> list[str]:
    """Each rank's recorded step (`fxzero.viz.timing.recorded`): program times and time in waits."""
    ranks = f"{len(recorded)} rank" + ("s" if len(recorded) != 1 else "")
    lines = [f"recorded by fxzero train on {ranks} (step {step}, measured per rank):"]
    for t in recorded:
        start = min((a for a, _ in t.programs.values()), default=0.0)
        end = max((b for _, b in t.programs.values()), default=0.0)
        # Between the programs the step also runs the caller's code (the loss), so the parts
        # do not add up to the whole.
        parts = ", ".join(f"{name} {human_seconds(b - a)}" for name, (a, b) in t.programs.items())
        waits = sum(e.end - e.start for e in t.events if e.kind == "wait")
        share = f" ({100 * waits / (end - start):.0f}% of the step)" if end > start else ""
        lines.append(f"  rank {t.rank:<13} {human_seconds(end - start)} ({parts}); waiting for collectives "
                     f"{human_seconds(waits)}{share}")
    return lines

"""The schedule as text: one row per instruction (compute runs folded), one column per stream.

    #    start     time  compute                               comm                       bytes
    0        0   111 us                                        all_gather root         14.2 KiB
    1   111 us        0  wait root (all_gather)
    2   111 us  1.27 ms  root: 12 ops (embedding x2, add, ...)                           9.3 KiB
"""

from __future__ import annotations

import collections
from typing import Optional

from fxzero.timeline import Hardware, Times, summarize
from fxzero.viz.fmt import human_bytes, human_count, human_seconds
from fxzero.viz.series import memory_series

__all__ = ["schedule_table", "summary_lines"]

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
        return f"AdamW step {ins.unit}"
    if ins.kind in ("all_gather", "reduce_scatter", "free", "fetch", "offload"):
        how = getattr(ins, "algorithm", "")
        return f"{ins.kind} {ins.unit}" + (f" (as {how})" if how and how != ins.kind else "")
    return ins.name


def _rows(program, times: Times, nodes: dict[str, dict], full: bool):
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
        start = times[(program.name, run[0])][0]
        end = max(times[(program.name, i)][1] for i in run)
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
        start, end, stream = times[(program.name, i)]
        text = _describe(ins) if ins.kind != "compute" else f"{ins.name} = {_short(nodes.get(ins.name, {}).get('target', '?'))}"
        yield (i, i, stream, text, ins.bytes if ins.kind not in ("wait", "free") else 0, ins.flops, start, end - start)
    if run:
        yield flush()


def schedule_table(art, times: Times, *, full: bool = False) -> list[str]:
    """Lines of the table: every program, instructions in the order the runtime runs them."""
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
        span = times[(program.name, n - 1)][1] - times[(program.name, 0)][0]
        lines.append(f"{program.name} program: {n} instructions, {human_seconds(span)} estimated")
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


def summary_lines(art, times: Times, hw: Hardware) -> list[str]:
    """Step time, exposed communication, bytes per collective kind, peak memory."""
    s = art.schedule
    summ = summarize(s, times)
    progs = summ["programs"]
    step = summ["step_seconds"]
    parts = " + ".join(f"{name} {human_seconds(v['end'] - v['start'])}" for name, v in progs.items())
    busy = ", ".join(f"{k} {human_seconds(v)}" for k, v in summ["busy_seconds"].items())
    exposed = summ["exposed_comm_seconds"]
    lines = [
        f"summary (per rank; times estimated for {hw.name}: {hw.description})",
        f"  step time          {human_seconds(step)} = {parts}",
        f"  busy               {busy}",
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
    lines.append(
        f"  peak resident      {human_bytes(peak)} at {where} = params + optimizer {human_bytes(mem.states)}"
        + (f" + gathered {human_bytes(mem.gathered[at])} + activations {human_bytes(mem.activations[at])}"
           f" + gradients {human_bytes(mem.gradients[at])}" if at >= 0 else "")
    )
    return lines

"""prefetch: start all-gathers early, within a budget of gathered bytes; sink reduce-scatter waits.

Gathers. Before (each gather right before its unit's first use)::

    ag0 = all_gather(unit_0); w0 = wait(ag0); ...block 0...; free(w0)
    ag1 = all_gather(unit_1); w1 = wait(ag1); ...block 1...; free(w1)

After (unit 1's gather issued while block 0 computes; its wait stays at the first use)::

    ag0 = all_gather(unit_0); ag1 = all_gather(unit_1); w0 = wait(ag0); ...block 0...; free(w0)
    w1 = wait(ag1); ...block 1...; free(w1)

Each gather moves up, one node at a time, while the bytes of gathered buffers alive at every
point it passes, plus its own, stay within the budget; it never passes the previous gather (so
units are gathered in the order they are used) nor leaves its phase. The budget defaults to the
peak without prefetch plus the largest unit: one unit of lookahead.

Reduce-scatters. Before: rs_k = reduce_scatter(g_k); gshard_k = wait(rs_k) right away. After:
the wait sinks to just before the next reduce-scatter is issued (or the end of the backward), so
unit k's reduction overlaps unit k-1's backward compute, with at most two in flight.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch.fx as fx

from fxzero.passes.analysis import is_kind, output_node, phase, positions
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"params_gathered", "grads_reduced"})
PROVIDES = frozenset({"prefetched"})


def _gather_intervals(graph: fx.Graph, ctx: PassContext) -> dict[fx.Node, tuple[fx.Node, fx.Node, int]]:
    """all_gather node -> (it, its free, bytes of the gathered buffer)."""
    out = {}
    for g in graph.nodes:
        if not is_kind(g, "all_gather"):
            continue
        (wait,) = [u for u in g.users if is_kind(u, "wait")]
        (free,) = [u for u in wait.users if is_kind(u, "free")]
        layout = ctx.layout(g.meta["fxzero"]["unit"])
        out[g] = (g, free, layout.padded_numel * layout.itemsize)
    return out


def _live_after(nodes: list[fx.Node], pos: dict[fx.Node, int], intervals, skip: Optional[fx.Node] = None) -> list[int]:
    """Bytes of gathered buffers alive after each node (a buffer lives from its gather to its free)."""
    delta = [0] * (len(nodes) + 1)
    for g, (start, free, nbytes) in intervals.items():
        if g is skip:
            continue
        delta[pos[start]] += nbytes
        delta[pos[free]] -= nbytes
    live, out = 0, []
    for d in delta[:-1]:
        live += d
        out.append(live)
    return out


def _prefetch_gathers(graph: fx.Graph, ctx: PassContext, budget: int) -> int:
    moved = 0
    gathers = [n for n in graph.nodes if is_kind(n, "all_gather")]
    for i, g in enumerate(gathers):
        intervals = _gather_intervals(graph, ctx)
        nodes = list(graph.nodes)
        pos = positions(graph)
        live = _live_after(nodes, pos, intervals, skip=g)
        nbytes = intervals[g][2]
        previous = gathers[i - 1] if i > 0 and phase(gathers[i - 1]) == phase(g) else None
        target = g
        j = pos[g] - 1
        while j >= 0:
            candidate = nodes[j]
            if candidate is previous or candidate.op == "placeholder" or phase(candidate) != phase(g):
                break
            # Issued before `candidate`, g's buffer is alive from the point after the node before
            # it (where a buffer that candidate frees is still alive) to g's old position.
            if max(live[j], live[j - 1] if j > 0 else 0) + nbytes > budget:
                break
            target = candidate
            j -= 1
        if target is not g:
            target.prepend(g)
            moved += 1
    return moved


def _sink_reduce_scatter_waits(graph: fx.Graph) -> int:
    scatters = [n for n in graph.nodes if is_kind(n, "reduce_scatter")]
    out = output_node(graph)
    sunk = 0
    for i, rs in enumerate(scatters):
        (wait,) = [u for u in rs.users if is_kind(u, "wait")]
        anchor = scatters[i + 1] if i + 1 < len(scatters) else out
        users_before_anchor = [u for u in wait.users if u is not out]
        if users_before_anchor:
            continue  # something reads the shard inside the program: leave the wait where it is
        if wait.next is not anchor:
            anchor.prepend(wait)
            sunk += 1
    return sunk


def prefetch_pass(gm: fx.GraphModule, ctx: PassContext, *, max_live_bytes: Optional[int]) -> PassResult:
    graph = gm.graph
    intervals = _gather_intervals(graph, ctx)
    nodes, pos = list(graph.nodes), positions(graph)
    peak_before = max(_live_after(nodes, pos, intervals), default=0)
    largest = max((b for _, _, b in intervals.values()), default=0)
    budget = max_live_bytes if max_live_bytes is not None else peak_before + largest
    moved = _prefetch_gathers(graph, ctx, budget) if intervals else 0
    sunk = _sink_reduce_scatter_waits(graph)
    intervals = _gather_intervals(graph, ctx)
    peak_after = max(_live_after(list(graph.nodes), positions(graph), intervals), default=0)
    ctx.outputs["prefetch_budget_bytes"] = budget
    return PassResult(
        gm,
        changed=bool(moved or sunk),
        summary={
            "budget_bytes": budget,
            "gathers_moved": moved,
            "reduce_scatter_waits_sunk": sunk,
            "peak_gathered_bytes_before": peak_before,
            "peak_gathered_bytes_after": peak_after,
        },
    )


def make(*, max_live_bytes: Optional[int]) -> Pass:
    return Pass(
        "prefetch",
        functools.partial(prefetch_pass, max_live_bytes=max_live_bytes),
        requires=REQUIRES,
        provides=PROVIDES,
    )

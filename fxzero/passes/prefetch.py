"""prefetch: start all-gathers early and sink reduce-scatter waits, within a budget of live bytes.

Gathers. Before (each gather right before its unit's first use)::

    ag0 = all_gather(unit_0); w0 = wait(ag0); ...block 0...; free(w0)
    ag1 = all_gather(unit_1); w1 = wait(ag1); ...block 1...; free(w1)

After (unit 1's gather issued while block 0 computes; its wait stays at the first use)::

    ag0 = all_gather(unit_0); ag1 = all_gather(unit_1); w0 = wait(ag0); ...block 0...; free(w0)
    w1 = wait(ag1); ...block 1...; free(w1)

Each gather moves up its program (the nodes of its phase; the joint graph interleaves a few
nodes of the other phase, which the split drops), one node at a time, while the bytes alive at
every point it passes, plus its own, stay within the budget; it never passes the previous
gather (so units are gathered in the order they are used) nor leaves its phase. The budget
defaults to the peak without prefetch plus the largest unit (one unit of lookahead), and to at
least `MIN_DEFAULT_BUDGET` (see `Prefetch.max_live_bytes`).

Reduce-scatters. Before: rs_k = reduce_scatter(g_k); gshard_k = wait(rs_k) right away. After:
the wait sinks at least to just before the next reduce-scatter is issued, so unit k's reduction
overlaps unit k-1's backward compute, whatever the budget (one flat gradient more than the budget
where the budget cannot hold it: the overlap is what the budget is for); and further, past later
reduce-scatters or to the end of the backward, while the flat gradients in flight plus the
gathered buffers stay within the budget. A wait that blocks compute while the link is still busy with prefetched gathers would
leave the link idle later, when the remaining reduce-scatters cannot be issued yet.

"Bytes alive" counts gathered buffers (gather to free) and flat gradients being reduced
(reduce-scatter to its wait): both are per-unit buffers the budget bounds (`passes/budget.py`).
The budget is recorded in `ctx.outputs["prefetch_budget_bytes"]`: `keep_for_backward` keeps
units gathered from the forward into the backward within it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch.fx as fx

from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, output_node, phase, positions, wait_of
from fxzero.passes.budget import gather_intervals, live_after, live_intervals, program_nodes
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"params_gathered", "grads_reduced"})
PROVIDES = frozenset({"prefetched"})

MIN_DEFAULT_BUDGET = 128 << 20
"""The default budget is at least this (bytes). On the 25M benchmark model with an emulated
link as slow as its compute (tools/overlap.py), one unit of lookahead (34 MB) left reductions
waiting at the backward's start; 100 MB and 128 MiB both gave 1.11x max(compute, comm)."""


def _prefetch_gathers(graph: fx.Graph, ctx: PassContext, budget: int) -> int:
    moved = 0
    gathers = [n for n in graph.nodes if is_kind(n, "all_gather")]
    for i, g in enumerate(gathers):
        nodes, pos = program_nodes(graph, phase(g))
        # A backward gather stays below the forward's last node in the joint graph (it gains
        # nothing from passing the few backward nodes among the forward's), so a value the
        # forward hands over (a kept shard) is always defined before it.
        joint = positions(graph)
        floor = max((joint[n] for n in graph.nodes if phase(n) == FORWARD), default=-1) if phase(g) == BACKWARD else -1
        intervals = live_intervals(graph, ctx)
        live = live_after(nodes, pos, intervals, skip=g)
        nbytes = intervals[g][2]
        previous = gathers[i - 1] if i > 0 and phase(gathers[i - 1]) == phase(g) else None
        target = g
        j = pos[g] - 1
        while j >= 0:
            candidate = nodes[j]
            if candidate is previous or candidate.op == "placeholder" or joint[candidate] <= floor:
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


def _sink_reduce_scatter_waits(graph: fx.Graph, ctx: PassContext, budget: int) -> int:
    scatters = [n for n in graph.nodes if is_kind(n, "reduce_scatter")]
    out = output_node(graph)
    sunk = 0
    # Last reduce-scatter first: the last ones have no compute left to hide behind, so their
    # waits claim the budget at the end of the backward before earlier ones do.
    for rs in reversed(scatters):
        wait = wait_of(rs)
        if any(u is not out for u in wait.users):
            continue  # something reads the shard inside the program: leave the wait where it is
        nodes, _ = program_nodes(graph, phase(rs))
        nodes = [n for n in nodes if n is not wait]
        pos = {n: i for i, n in enumerate(nodes)}
        intervals = live_intervals(graph, ctx)
        nbytes = intervals[rs][2]
        live = live_after(nodes, pos, intervals, skip=rs)
        # The wait goes before nodes[end]: at least before the next reduce-scatter is issued, so
        # the next unit's backward compute overlaps this reduction whatever the budget (a unit
        # larger than the budget would otherwise wait right away, its reduction exposed); then
        # as late as the budget allows (the flat gradient is alive after each node from the
        # reduce-scatter to end - 1).
        later = [pos[n] for n in scatters if n in pos and pos[n] > pos[rs]]
        end = min(later) if later else pos[rs] + 1
        while end < len(nodes) and max(live[pos[rs] : end + 1]) + nbytes <= budget:
            end += 1
        anchor = nodes[end] if end < len(nodes) else out
        if wait.next is not anchor:
            anchor.prepend(wait)
            sunk += 1
    return sunk


def prefetch_pass(gm: fx.GraphModule, ctx: PassContext, *, max_live_bytes: Optional[int]) -> PassResult:
    graph = gm.graph
    gathers = gather_intervals(graph, ctx)
    peak_before = max((max(live_after(*program_nodes(graph, which), gathers), default=0)
                       for which in (FORWARD, BACKWARD)), default=0)
    largest = max((b for _, _, b in gathers.values()), default=0)
    budget = max_live_bytes if max_live_bytes is not None else max(peak_before + largest, MIN_DEFAULT_BUDGET)
    moved = _prefetch_gathers(graph, ctx, budget) if gathers else 0
    sunk = _sink_reduce_scatter_waits(graph, ctx, budget)

    def peak(spans) -> int:
        return max(max(live_after(*program_nodes(graph, which), spans), default=0) for which in (FORWARD, BACKWARD))

    peak_after = peak(gather_intervals(graph, ctx))
    peak_live = peak(live_intervals(graph, ctx))
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
            "peak_live_bytes_after": peak_live,
        },
    )


def make(*, max_live_bytes: Optional[int]) -> Pass:
    return Pass(
        "prefetch",
        functools.partial(prefetch_pass, max_live_bytes=max_live_bytes),
        requires=REQUIRES,
        provides=PROVIDES,
    )

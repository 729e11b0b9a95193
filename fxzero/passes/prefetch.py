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
overlaps unit k-1's backward compute; and further, past later reduce-scatters or to the end of
the backward, while the flat gradients in flight plus the gathered buffers stay within the same
budget. A wait that blocks compute while the link is still busy with prefetched gathers would
leave the link idle later, when the remaining reduce-scatters cannot be issued yet.

Kept for the backward (`Prefetch.keep_for_backward`). The backward starts with the units the
forward ended with (the last block, a tied head), and prefetch issues their gathers first thing.
Instead, their forward buffers are not freed: the backward reads them (see
`_keep_for_backward`), within the budget at the forward's end and in the backward until their
old gather. Each kept unit is gathered once per step, not twice.

"Bytes alive" counts gathered buffers (gather to free) and flat gradients being reduced
(reduce-scatter to its wait): both are per-unit buffers the budget bounds.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch.fx as fx

from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, output_node, phase, positions, tag
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"params_gathered", "grads_reduced"})
PROVIDES = frozenset({"prefetched"})

MIN_DEFAULT_BUDGET = 128 << 20
"""The default budget is at least this (bytes). On the 25M benchmark model with an emulated
link as slow as its compute (tools/overlap.py), one unit of lookahead (34 MB) left reductions
waiting at the backward's start; 100 MB and 128 MiB both gave 1.11x max(compute, comm)."""


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


def _reduce_intervals(graph: fx.Graph, ctx: PassContext) -> dict[fx.Node, tuple[fx.Node, fx.Node, int]]:
    """reduce_scatter node -> (it, its wait, bytes of the flat gradient it reads)."""
    out = {}
    for rs in graph.nodes:
        if is_kind(rs, "reduce_scatter"):
            (wait,) = [u for u in rs.users if is_kind(u, "wait")]
            layout = ctx.layout(rs.meta["fxzero"]["unit"])
            out[rs] = (rs, wait, layout.padded_numel * layout.itemsize)
    return out


def _program_nodes(graph: fx.Graph, which: str) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """The nodes of one phase in graph order (what the split makes its program), and positions."""
    nodes = [n for n in graph.nodes if n.op != "output" and phase(n) == which]
    return nodes, {n: i for i, n in enumerate(nodes)}


def _live_after(nodes: list[fx.Node], pos: dict[fx.Node, int], intervals, skip: Optional[fx.Node] = None) -> list[int]:
    """Bytes alive after each node of a program: each interval (start, end, bytes) holds its bytes
    from its start to its end; intervals of other programs (not in `pos`) are ignored."""
    delta = [0] * (len(nodes) + 1)
    for key, (start, end, nbytes) in intervals.items():
        if key is skip or (start not in pos and end not in pos):
            continue
        # A buffer kept from the forward into the backward (keep_for_backward) is alive from
        # the backward's start, and to the forward's end.
        delta[pos.get(start, 0)] += nbytes
        delta[pos.get(end, len(nodes))] -= nbytes
    live, out = 0, []
    for d in delta[:-1]:
        live += d
        out.append(live)
    return out


def _intervals(graph: fx.Graph, ctx: PassContext) -> dict:
    return {**_gather_intervals(graph, ctx), **_reduce_intervals(graph, ctx)}


def _prefetch_gathers(graph: fx.Graph, ctx: PassContext, budget: int) -> int:
    moved = 0
    gathers = [n for n in graph.nodes if is_kind(n, "all_gather")]
    for i, g in enumerate(gathers):
        nodes, pos = _program_nodes(graph, phase(g))
        # A backward gather stays below the forward's last node in the joint graph (it gains
        # nothing from passing the few backward nodes among the forward's), so a value the
        # forward hands over (a kept shard) is always defined before it.
        joint = positions(graph)
        floor = max((joint[n] for n in graph.nodes if phase(n) == FORWARD), default=-1) if phase(g) == BACKWARD else -1
        intervals = _intervals(graph, ctx)
        live = _live_after(nodes, pos, intervals, skip=g)
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
        wait = _wait_of(rs)
        if any(u is not out for u in wait.users):
            continue  # something reads the shard inside the program: leave the wait where it is
        nodes, _ = _program_nodes(graph, phase(rs))
        nodes = [n for n in nodes if n is not wait]
        pos = {n: i for i, n in enumerate(nodes)}
        intervals = _intervals(graph, ctx)
        nbytes = intervals[rs][2]
        live = _live_after(nodes, pos, intervals, skip=rs)
        # The wait goes before nodes[end]: as late as the budget allows (the flat gradient is
        # alive after each node from the reduce-scatter to end - 1), at least right after it.
        end = pos[rs] + 1
        while end < len(nodes) and max(live[pos[rs] : end + 1]) + nbytes <= budget:
            end += 1
        anchor = nodes[end] if end < len(nodes) else out
        if wait.next is not anchor:
            anchor.prepend(wait)
            sunk += 1
    return sunk


def _gathers_of(graph: fx.Graph, which: str) -> dict[str, fx.Node]:
    return {g.meta["fxzero"]["unit"]: g for g in graph.nodes if is_kind(g, "all_gather") and phase(g) == which}


def _keep_for_backward(graph: fx.Graph, ctx: PassContext, budget: int) -> list[str]:
    """Keep the units the backward gathers first from the forward, while the budget allows.

    Before::                                        After::

        w = wait(all_gather(u)); ...; free(w)           w = wait(all_gather(u)); ...   # forward
        w_1 = wait(all_gather(u)); ...(w_1); free(w_1)  ...(w); free(w)                 # backward

    Units are taken in the order the backward gathers them; each must fit the budget both at
    the forward's end (its buffer now lives there) and in the backward up to its old gather
    (it now lives from the backward's start). The first that does not fit ends the run. The
    kept buffer crosses the boundary as a saved value, tagged `kept="gathered"`.
    """
    forward = _gathers_of(graph, FORWARD)
    kept = []
    for unit, g_b in _gathers_of(graph, BACKWARD).items():
        g_f = forward.get(unit)
        if g_f is None:
            break
        intervals = _intervals(graph, ctx)
        _, free_f, nbytes = intervals[g_f]
        fwd, fpos = _program_nodes(graph, FORWARD)
        bwd, bpos = _program_nodes(graph, BACKWARD)
        fits_forward = max(_live_after(fwd, fpos, intervals)[fpos[free_f]:], default=0) + nbytes <= budget
        fits_backward = max(_live_after(bwd, bpos, intervals)[: bpos[g_b]], default=0) + nbytes <= budget
        if not (fits_forward and fits_backward):
            break
        w_f, w_b = _wait_of(g_f), _wait_of(g_b)
        graph.erase_node(free_f)
        w_b.replace_all_uses_with(w_f)
        graph.erase_node(w_b)
        graph.erase_node(g_b)
        tag(w_f, kept="gathered")
        kept.append(unit)
    return kept


def _wait_of(node: fx.Node) -> fx.Node:
    (wait,) = [u for u in node.users if is_kind(u, "wait")]
    return wait


def prefetch_pass(gm: fx.GraphModule, ctx: PassContext, *, max_live_bytes: Optional[int],
                  keep_for_backward: bool = True) -> PassResult:
    graph = gm.graph
    intervals = _gather_intervals(graph, ctx)
    peak_before = max((max(_live_after(*_program_nodes(graph, which), intervals), default=0)
                       for which in (FORWARD, BACKWARD)), default=0)
    largest = max((b for _, _, b in intervals.values()), default=0)
    budget = max_live_bytes if max_live_bytes is not None else max(peak_before + largest, MIN_DEFAULT_BUDGET)
    moved = _prefetch_gathers(graph, ctx, budget) if intervals else 0
    sunk = _sink_reduce_scatter_waits(graph, ctx, budget)
    kept = _keep_for_backward(graph, ctx, budget) if keep_for_backward and intervals else []

    def peak(intervals) -> int:
        return max(max(_live_after(*_program_nodes(graph, which), intervals), default=0) for which in (FORWARD, BACKWARD))

    peak_after = peak(_gather_intervals(graph, ctx))
    peak_live = peak(_intervals(graph, ctx))
    ctx.outputs["prefetch_budget_bytes"] = budget
    return PassResult(
        gm,
        changed=bool(moved or sunk or kept),
        summary={
            "budget_bytes": budget,
            "gathers_moved": moved,
            "reduce_scatter_waits_sunk": sunk,
            "peak_gathered_bytes_before": peak_before,
            "peak_gathered_bytes_after": peak_after,
            "peak_live_bytes_after": peak_live,
            "kept_for_backward": kept,
        },
    )


def make(*, max_live_bytes: Optional[int], keep_for_backward: bool = True) -> Pass:
    return Pass(
        "prefetch",
        functools.partial(prefetch_pass, max_live_bytes=max_live_bytes, keep_for_backward=keep_for_backward),
        requires=REQUIRES,
        provides=PROVIDES,
    )

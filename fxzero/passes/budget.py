"""Bytes alive along a program, for passes that keep within a memory budget.

"Bytes alive" counts per-unit buffers as intervals over a program's nodes: a gathered buffer
from its gather to its free, a flat gradient from its reduce-scatter to the wait (the
collective reads it until then). Prefetch and the kept-for-backward analysis measure their
moves against the same budget with these.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from fxzero.ir.sizes import itemsize_of
from fxzero.ir.tags import is_kind, phase, wait_of
from fxzero.passes.runner import PassContext

__all__ = ["gather_intervals", "live_after", "live_intervals", "program_nodes", "reduce_intervals"]


def gather_intervals(graph: fx.Graph, ctx: PassContext) -> dict[fx.Node, tuple[fx.Node, fx.Node, int]]:
    """all_gather node -> (it, its free, bytes of the gathered buffer)."""
    out = {}
    for g in graph.nodes:
        if not is_kind(g, "all_gather"):
            continue
        (free,) = [u for u in wait_of(g).users if is_kind(u, "free")]
        layout = ctx.layout(g.meta["fxzero"]["unit"])
        out[g] = (g, free, layout.padded_numel * itemsize_of(g, layout.itemsize))
    return out


def reduce_intervals(graph: fx.Graph, ctx: PassContext) -> dict[fx.Node, tuple[fx.Node, fx.Node, int]]:
    """reduce_scatter node -> (it, its wait, bytes of the flat gradient it reads)."""
    out = {}
    for rs in graph.nodes:
        if is_kind(rs, "reduce_scatter"):
            wait = wait_of(rs)
            layout = ctx.layout(rs.meta["fxzero"]["unit"])
            out[rs] = (rs, wait, layout.padded_numel * itemsize_of(rs.args[0], layout.itemsize))
    return out


def program_nodes(graph: fx.Graph, which: str) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """The nodes of one phase in graph order (what the split makes its program), and positions."""
    nodes = [n for n in graph.nodes if n.op != "output" and phase(n) == which]
    return nodes, {n: i for i, n in enumerate(nodes)}


def live_after(nodes: list[fx.Node], pos: dict[fx.Node, int], intervals, skip: Optional[fx.Node] = None) -> list[int]:
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


def live_intervals(graph: fx.Graph, ctx: PassContext) -> dict:
    return {**gather_intervals(graph, ctx), **reduce_intervals(graph, ctx)}

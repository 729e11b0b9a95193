"""Selective recompute: which of a unit's values the forward keeps, chosen by a minimum cut.

[Note: selective recompute]
Under `Activations(recompute="selective")` the backward recomputes the cheap operators of each
unit (norms, activations, residual adds, views, softmaxes outside fused attention) and the forward
keeps the outputs of the costly ones: the operators the cost model prices by their FLOPs
(`fxzero.ir.sizes.flops`: matmuls, convolutions, attention), which cost the backward a second
matmul's time to recompute. Which tensors cross the boundary is then a choice: a cheap value the
backward reads can be kept, or recomputed from what is kept. The pass makes it as a minimum cut,
the formulation of AOTAutograd's rematerialization partitioner (Chen et al.'s checkpointing as a
graph cut), over bytes:

    source --inf--> v_in   for each value the backward cannot recompute (a costly or random
                           operator's output, a unit's input, anything outside the unit's interior)
    v_in --bytes(v)--> v_out    keeping v costs its bytes
    u_out --inf--> v_in    v reads u (recomputing v needs u kept or recomputed)
    v_out --inf--> sink    the backward reads v

A cut separates what the forward computes from what the backward has. A value whose v_in->v_out
edge is cut is kept; a value whose v_in lies on the sink's side is recomputed; the cut's capacity
is the bytes kept, the least any such choice keeps. The candidates are a unit's interior by
the rule of `recompute="unit"` ([Note: recomputing a unit] in `fxzero/config/activations.py`),
so the backward's gathers are the resident program's. Values derived from parameters alone are
recomputed as always (no source edge reaches them). Random operators' draws are kept, as under
"unit". Every value is recomputed by the same operators on the same inputs: bit for bit.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov
import torch.fx as fx

from fxzero.ir.sizes import flops, nbytes
from fxzero.ir.tags import BACKWARD, FORWARD, phase

__all__ = ["Cut", "CutGraph", "cut", "selective_cut"]


class Cut:
    """The choice: the forward values the backward recomputes, and what it keeps for them."""

    def __init__(self, recomputed: set[fx.Node], kept: set[fx.Node], costly: set[fx.Node]) -> None:
        self.recomputed, self.kept, self.costly = recomputed, kept, costly

    def summary(self) -> dict[str, int]:
        return {"cut_kept_values": len(self.kept), "cut_kept_bytes": sum(nbytes(n.meta.get("val")) for n in self.kept),
                "cut_recomputed_values": len(self.recomputed), "cut_costly_values": len(self.costly)}


def _costly(node: fx.Node) -> bool:
    """An operator the cost model prices by FLOPs (its output is kept, not recomputed); the
    element of a tuple such an operator returns is its output too."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _costly(node.args[0])
    return flops(node) > 0


def selective_cut(graph: fx.Graph, interior: Callable[[fx.Node], bool],
                  param_only: Callable[[fx.Node], bool]) -> Cut:
    """The minimum cut of [Note: selective recompute] over `graph`'s forward, `interior` telling
    the unit rule's candidates and `param_only` the values recomputed from parameters."""
    return cut(graph, param_only, recompute_cost=lambda n: 0 if interior(n) and not _costly(n) else None,
               keep_cost=lambda n: nbytes(n.meta.get("val")), costly=lambda n: interior(n) and _costly(n))


def cut(graph: fx.Graph, param_only: Callable[[fx.Node], bool], *,
        recompute_cost: Callable[[fx.Node], Optional[int]], keep_cost: Callable[[fx.Node], int],
        costly: Callable[[fx.Node], bool] = lambda n: False) -> Cut:
    """A minimum cut over `graph`'s forward ([Note: selective recompute]): `recompute_cost(v)` is
    what recomputing v costs (None: it cannot be), `keep_cost(v)` what keeping it costs, both
    integers; values derived from parameters alone are free. The cut's value is the least total
    of the two over every way the backward can have what it reads."""
    return CutGraph(graph, param_only, recompute_cost=recompute_cost, costly=costly).solve(keep_cost)


class CutGraph:
    """The flow network of [Note: selective recompute] over `graph`'s forward, built once and cut
    at any keep cost: the budget planner cuts one graph at many prices of memory, which change
    only the keep edges' capacities."""

    def __init__(self, graph: fx.Graph, param_only: Callable[[fx.Node], bool], *,
                 recompute_cost: Callable[[fx.Node], Optional[int]],
                 costly: Callable[[fx.Node], bool] = lambda n: False) -> None:
        g = nx.DiGraph()
        self.candidates, self.costly_kept, self.keep_edges = set(), set(), []
        for node in graph.nodes:
            if node.op == "output" or phase(node) != FORWARD:
                continue
            if param_only(node):
                continue  # (always available in the backward, at no cost: no edges needed)
            price = recompute_cost(node) if node.op == "call_function" else None
            if price is None:
                g.add_edge("source", (node, "in"))
                if costly(node):
                    self.costly_kept.add(node)
            else:
                self.candidates.add(node)
                if price > 0:
                    g.add_edge("source", (node, "in"), capacity=price)
            g.add_edge((node, "in"), (node, "out"))
            if not isinstance(node.meta.get("val"), (tuple, list)):  # (a tuple is kept by its elements, never whole)
                self.keep_edges.append(node)
            for inp in node.all_input_nodes:
                if phase(inp) == FORWARD and (inp, "out") in g:
                    g.add_edge((inp, "out"), (node, "in"))
        for node in graph.nodes:
            if node.op == "output" or phase(node) != BACKWARD:
                continue
            for inp in node.all_input_nodes:
                if (inp, "out") in g:
                    g.add_edge((inp, "out"), "sink")
        self.g = g

    def solve(self, keep_cost: Callable[[fx.Node], int]) -> Cut:
        """The minimum cut with keeping v costing `keep_cost(v)`. (Boykov-Kolmogorov: on these
        graphs about twice as fast as networkx's default preflow-push. The partition is the same
        whichever maximum flow an algorithm finds: networkx takes as the backward's side what can
        still reach the sink in the residual network, which every maximum flow leaves alike.)"""
        g = self.g
        if "sink" not in g or "source" not in g:
            return Cut(set(), set(), self.costly_kept)
        for node in self.keep_edges:
            g.edges[(node, "in"), (node, "out")]["capacity"] = keep_cost(node)
        _, (forward_side, backward_side) = nx.minimum_cut(g, "source", "sink", flow_func=boykov_kolmogorov)
        recomputed = {n for n in self.candidates if (n, "in") in backward_side}
        kept = {n for n in g.nodes if isinstance(n, tuple) and n[1] == "in" and n in forward_side
                and (n[0], "out") in backward_side}
        return Cut(recomputed, {n for n, _ in kept}, self.costly_kept)

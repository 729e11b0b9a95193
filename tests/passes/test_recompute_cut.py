"""The minimum cut of [Note: selective recompute] (`fxzero/passes/recompute_cut.py`), against a
search of every choice on small random graphs.

Each graph is a forward of random operators over earlier values, and a backward that reads some
of them. A choice recomputes a set R of the candidates; every value the backward reads, or a
recomputed value reads, that is not recomputed is kept. Its cost is what R's values cost to
recompute plus what the kept ones cost to keep. The search tries every R; the cut must cost
what the best of them does, and be a choice (everything needed is kept or recomputed). The
budget planner cuts one network at many prices (`CutGraph.solve`), in any order: each must equal
a network built afresh at that price.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.fx as fx

from fxzero.ir.tags import BACKWARD, FORWARD
from fxzero.passes.recompute_cut import CutGraph, cut


def _graph(seed: int, n_forward: int = 9, n_backward: int = 5) -> tuple[fx.Graph, list[fx.Node]]:
    rng = random.Random(seed)
    g = fx.Graph()
    forward = []
    for i in range(2):
        x = g.placeholder(f"x{i}")
        x.meta.update(val=torch.empty(rng.randint(1, 64)), fxzero={"phase": FORWARD})
        forward.append(x)
    for _ in range(n_forward):
        args = rng.sample(forward, min(len(forward), rng.randint(1, 2)))
        node = g.call_function(torch.add if len(args) == 2 else torch.relu, tuple(args))
        node.meta.update(val=torch.empty(rng.randint(1, 64)), fxzero={"phase": FORWARD})
        forward.append(node)
    reads = []
    for _ in range(n_backward):
        node = g.call_function(torch.add, tuple(rng.sample(forward, 2)))
        node.meta.update(val=torch.empty(1), fxzero={"phase": BACKWARD})
        reads.append(node)
    g.output(tuple(reads))
    return g, [n for n in forward if n.op == "call_function"]


def _read(graph: fx.Graph) -> set[fx.Node]:
    """The forward values the backward reads."""
    return {i for n in graph.nodes if n.meta.get("fxzero", {}).get("phase") == BACKWARD for i in n.all_input_nodes}


def _best(graph: fx.Graph, candidates: list[fx.Node], recompute, keep) -> int:
    """The least cost over every set of candidates to recompute."""
    read = _read(graph)
    best = None
    for k in range(len(candidates) + 1):
        for chosen in itertools.combinations(candidates, k):
            recomputed = set(chosen)
            needed = read | {i for n in recomputed for i in n.all_input_nodes}
            cost = sum(recompute(n) for n in recomputed) + sum(keep(n) for n in needed - recomputed)
            best = cost if best is None else min(best, cost)
    return best


def _cost_of(choice, recompute, keep) -> int:
    return sum(recompute(n) for n in choice.recomputed) + sum(keep(n) for n in choice.kept)


@pytest.mark.parametrize("seed", range(12))
def test_the_cut_is_the_cheapest_choice(seed):
    graph, candidates = _graph(seed)
    rng = random.Random(100 + seed)
    ns = {n: rng.randint(1, 200) for n in candidates}
    network = CutGraph(graph, lambda n: False, recompute_cost=lambda n: ns.get(n))
    prices = [0.0, 0.5, 4.0, 0.25, 2.0, 1000.0, 1.0]  # (out of order: each solve starts from nothing)
    for price in prices:
        keep = lambda n, price=price: int(price * n.meta["val"].numel() * 4)  # noqa: E731
        got = network.solve(keep)
        fresh = cut(graph, lambda n: False, recompute_cost=lambda n: ns.get(n), keep_cost=keep)
        assert (got.recomputed, got.kept) == (fresh.recomputed, fresh.kept), price
        assert _cost_of(got, lambda n: ns[n], keep) == _best(graph, candidates, lambda n: ns[n], keep), price
        needed = _read(graph) | {i for n in got.recomputed for i in n.all_input_nodes}
        assert needed - got.recomputed <= got.kept, price
    # (At no price for memory, nothing is recomputed.)
    assert network.solve(lambda n: 0).recomputed == set()

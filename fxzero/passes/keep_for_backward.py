"""keep_for_backward: the buffers the backward needs first stay from the forward, not acquired again.

The backward starts with the units the forward ended with (the last block, a tied head). Such a
unit's buffer, its gathered parameters or, with offloaded parameters, its parameter shard read
from the tier, is not freed at the forward's end; the backward reads it and frees it::

    Before::                                          After::

        b = wait(acquire(u)); ...; free(b)                b = wait(acquire(u)); ...       # forward
        b_1 = wait(acquire(u)); ...(b_1); free(b_1)       ...(b); free(b)                  # backward

where `acquire` is an all_gather (the buffer is "gathered") or the fetch of the shard a gather
reads ("fetched"). The kept buffer crosses the boundary as a saved value tagged `kept` with its
kind; the schedule lists it (`ProgramSchedule.kept`) and the backward frees it. Which units:

- "gathered" (`Prefetch.keep_for_backward`): in the order the backward gathers them, while each
  fits the prefetch pass's budget both at the forward's end (its buffer now lives there) and in
  the backward up to its old gather (it now lives from the backward's start); the first that
  does not fit ends the run. Each kept unit is gathered once per step, not twice.
- "fetched" (offloaded parameters): the units among both the forward's last `count` fetches and
  the backward's first `count + 1` gathers (`count` = lookahead + 1, the fetched shards the
  schedule holds anyway), so a kept shard lives only over the forward's tail, not all of it (a
  root unit used first and last in the forward is read again). With step_in_backward it is what
  the update reads. Each kept shard is read once per step, not twice.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch.fx as fx

from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, phase, tag, wait_of
from fxzero.passes.budget import live_after, live_intervals, program_nodes
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = {"gathered": frozenset({"params_gathered", "prefetched"}), "fetched": frozenset({"params_offloaded"})}
"""Gathered buffers are kept within the prefetch pass's budget; fetched shards after their fetches exist."""
PROVIDES = frozenset({"kept_for_backward"})

Buffer = Literal["gathered", "fetched"]


def _is_fetched(node: fx.Node) -> bool:
    return isinstance(node, fx.Node) and is_kind(node, "wait") and is_kind(node.args[0], "fetch")


def acquired(graph: fx.Graph, which: str, buffer: Buffer) -> dict[str, tuple[fx.Node, fx.Node]]:
    """unit -> (the node that acquires its buffer, its wait) in phase `which`, in gather order
    (a unit gathered twice: its last acquisition)."""
    out = {}
    for g in graph.nodes:
        if not (is_kind(g, "all_gather") and phase(g) == which):
            continue
        if buffer == "gathered":
            out[g.meta["fxzero"]["unit"]] = (g, wait_of(g))
        elif _is_fetched(g.args[0]):
            out[g.meta["fxzero"]["unit"]] = (g.args[0].args[0], g.args[0])
    return out


def _fits_budget(graph: fx.Graph, ctx: PassContext, forward: tuple[fx.Node, fx.Node], backward_start: fx.Node,
                 budget: int) -> bool:
    spans = live_intervals(graph, ctx)
    _, free_f, nbytes = spans[forward[0]]
    fwd, fpos = program_nodes(graph, FORWARD)
    bwd, bpos = program_nodes(graph, BACKWARD)
    fits_forward = max(live_after(fwd, fpos, spans)[fpos[free_f]:], default=0) + nbytes <= budget
    fits_backward = max(live_after(bwd, bpos, spans)[: bpos[backward_start]], default=0) + nbytes <= budget
    return fits_forward and fits_backward


def _keep(graph: fx.Graph, forward: tuple[fx.Node, fx.Node], backward: tuple[fx.Node, fx.Node], buffer: Buffer) -> None:
    """The backward reads the forward's buffer instead of acquiring its own (see the module doc)."""
    kept, (start_b, wait_b) = forward[1], backward
    for free in [u for u in kept.users if is_kind(u, "free")]:
        graph.erase_node(free)
    wait_b.replace_all_uses_with(kept)
    graph.erase_node(wait_b)
    graph.erase_node(start_b)
    tag(kept, kept=buffer)


def keep_for_backward_pass(gm: fx.GraphModule, ctx: PassContext, *, buffer: Buffer, count: int = 0) -> PassResult:
    """Keep buffers of kind `buffer` across the boundary; `count` bounds the fetched shards."""
    graph = gm.graph
    forward = acquired(graph, FORWARD, buffer)
    backward = list(acquired(graph, BACKWARD, buffer).items())
    kept = []
    if buffer == "gathered":
        budget = ctx.outputs["prefetch_budget_bytes"]
        for unit, b in backward:
            if unit not in forward or not _fits_budget(graph, ctx, forward[unit], b[0], budget):
                break
            _keep(graph, forward[unit], b, buffer)
            kept.append(unit)
    else:
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = set(sorted(forward, key=lambda u: order[forward[u][0]])[-count:]) if count else set()
        for unit, b in backward[: count + 1]:
            if unit in last:
                _keep(graph, forward[unit], b, buffer)
                kept.append(unit)
    return PassResult(gm, changed=bool(kept), summary={"buffer": buffer, "kept_for_backward": kept})


def make(*, buffer: Buffer, count: int = 0) -> Pass:
    return Pass(
        "keep_for_backward",
        functools.partial(keep_for_backward_pass, buffer=buffer, count=count),
        requires=REQUIRES[buffer],
        provides=PROVIDES,
    )

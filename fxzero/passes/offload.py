"""offload: fetch offloaded parameter shards before their gathers; write gradient shards out.

Parameters (ZeRO-3 units whose shards live on a tier). Before::

    ag1 = all_gather(unit_1); ...; w1 = wait(ag1); ...block 1...; free(w1)

After (the shard is read from its tier ahead of the gather, and released once gathered)::

    f1 = fetch(unit_1, "param")                # issued `lookahead` gathers earlier
    ...
    s1 = wait(f1); ag1 = all_gather(s1); ...; w1 = wait(ag1); free(s1); ...block 1...; free(w1)

The fetch of a unit's shard is issued right before an earlier gather of the same phase (right
before its own gather for the phase's first unit): `lookahead` gathers back, or, with a cost
model, the nearest one (at least one back, at most `lookahead`) whose predicted compute up to
this gather covers the predicted read. At most `lookahead + 1` fetched shards are in memory at
once. The simulator (`fxzero.cost.simulate`, io stream) shows whether the lead hides the reads.

Gradients (when gradient shards live on a tier). Before::

    gshard_k = wait(rs_k); ...; return [..., gshard_k, ...]

After (written out as soon as reduced; the program returns a token per unit)::

    gshard_k = wait(rs_k); o_k = offload(gshard_k, "grad"); ...; t_k = wait(o_k); return [..., t_k, ...]

The write's wait sits right before the offload `lookahead + 1` units later (or the end of the
backward), bounding the gradient shards held in memory while they are written.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch.fx as fx

from fxzero.ops import OPS
from fxzero.passes.analysis import is_kind, output_node, phase, tag
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.schedule import Instruction, instruction_of

REQUIRES = frozenset({"params_gathered", "grads_reduced"})
PROVIDES = frozenset({"offloaded"})


def _gather_wait(gather: fx.Node) -> fx.Node:
    (wait,) = [u for u in gather.users if is_kind(u, "wait")]
    return wait


def _compute_seconds(graph: fx.Graph, ctx: PassContext, cost_model) -> dict[fx.Node, float]:
    """Predicted compute time of each node (0 for everything but compute)."""
    layouts = {lay.name: lay for lay in ctx.layouts}
    out = {}
    for n in graph.nodes:
        ins = instruction_of(n, layouts) if n.op == "call_function" else None
        out[n] = cost_model.compute_seconds(ins) if ins is not None and ins.kind == "compute" else 0.0
    return out


def _lead(same_phase: list[fx.Node], lookahead: int, read_s: float, seconds, order) -> fx.Node:
    """The gather to issue the fetch before: the nearest earlier one (at least one back, at most
    `lookahead`) whose compute up to this gather covers the read; without prices, `lookahead` back."""
    k = len(same_phase) - 1
    if seconds is None or lookahead == 0:
        return same_phase[max(0, k - lookahead)]
    nodes = list(order)
    position = {n: i for i, n in enumerate(nodes)}
    for back in range(1, lookahead + 1):
        if k - back < 0:
            return same_phase[0]
        lo, hi = position[same_phase[k - back]], position[same_phase[k]]
        if sum(seconds.get(n, 0.0) for n in nodes[lo:hi]) >= read_s:
            return same_phase[k - back]
    return same_phase[max(0, k - lookahead)]


def _fetch_params(graph: fx.Graph, ctx: PassContext, tier: str, lookahead: int, cost_model) -> int:
    gathers = [n for n in graph.nodes if is_kind(n, "all_gather")]
    seconds = _compute_seconds(graph, ctx, cost_model) if cost_model is not None else None
    fetched = 0
    for i, gather in enumerate(gathers):
        unit_node = gather.args[0]
        if not (isinstance(unit_node, fx.Node) and is_kind(unit_node, "unit")):
            continue
        unit, which = gather.meta["fxzero"]["unit"], phase(gather)
        layout = ctx.layout(unit)
        read_s = 0.0
        if cost_model is not None:
            probe = Instruction(name="", kind="fetch", stream="io", algorithm=tier,
                                bytes=layout.shard_numel * layout.itemsize)
            read_s = cost_model.io_seconds(probe)
        # Issue point: an earlier gather of this phase (see _lead), or right before its own.
        same_phase = [g for g in gathers[: i + 1] if phase(g) == which]
        anchor = _lead(same_phase, lookahead, read_s, seconds, graph.nodes)
        with graph.inserting_before(anchor):
            start = graph.call_function(OPS["fetch"], (unit_node, unit, "param"))
        with graph.inserting_before(gather):
            shard = graph.call_function(OPS["wait"], (start,))
        gather.replace_input_with(unit_node, shard)
        with graph.inserting_after(_gather_wait(gather)):
            freed = graph.call_function(OPS["free"], (shard,))
        tag(start, kind="fetch", unit=unit, phase=which, state="param", algorithm=tier)
        tag(shard, kind="wait", unit=unit, phase=which, waits_for=start.name)
        tag(freed, kind="free", unit=unit, phase=which)
        fetched += 1
    return fetched


def _offload_grads(graph: fx.Graph, tier: str, lookahead: int) -> int:
    out = output_node(graph)
    results = list(out.args[0])
    offloads: list[tuple[fx.Node, fx.Node]] = []
    for pos, r in enumerate(results):
        if not (isinstance(r, fx.Node) and is_kind(r, "wait") and is_kind(r.args[0], "reduce_scatter")):
            continue
        if any(u is not out for u in r.users):
            continue  # read inside the program (not the case for ZeRO gradients): leave it
        unit = r.meta["fxzero"]["unit"]
        with graph.inserting_after(r):
            start = graph.call_function(OPS["offload"], (r, unit, "grad"))
        with graph.inserting_before(out):
            done = graph.call_function(OPS["wait"], (start,))
        tag(start, kind="offload", unit=unit, phase=phase(r), state="grad", algorithm=tier)
        tag(done, kind="wait", unit=unit, phase=phase(r), waits_for=start.name)
        results[pos] = done
        offloads.append((start, done))
    out.args = (results,)
    order = {n: i for i, n in enumerate(graph.nodes)}
    offloads.sort(key=lambda pair: order[pair[0]])  # backward order, not the outputs' unit order
    # Bound the writes in flight: unit k's write is waited for before unit k + lookahead + 1's starts.
    for k, (_, done) in enumerate(offloads):
        later = k + lookahead + 1
        if later < len(offloads):
            offloads[later][0].prepend(done)
    return len(offloads)


def offload_pass(gm: fx.GraphModule, ctx: PassContext, *, params: Optional[str], grads: Optional[str],
                 lookahead: int, cost_model=None) -> PassResult:
    graph = gm.graph
    fetched = _fetch_params(graph, ctx, params, lookahead, cost_model) if params else 0
    written = _offload_grads(graph, grads, lookahead) if grads else 0
    return PassResult(
        gm,
        changed=bool(fetched or written),
        summary={"param_fetches": fetched, "grad_offloads": written, "params_tier": params,
                 "grads_tier": grads, "lookahead": lookahead},
    )


def make(*, params: Optional[str], grads: Optional[str], lookahead: int, cost_model=None) -> Pass:
    """`params` / `grads`: the tier name each lives on, or None when on the device; `cost_model`
    (optional) prices reads and compute, so a fetch leads its gather by no more than it needs."""
    return Pass(
        "offload",
        functools.partial(offload_pass, params=params, grads=grads, lookahead=lookahead, cost_model=cost_model),
        requires=REQUIRES,
        provides=PROVIDES,
    )

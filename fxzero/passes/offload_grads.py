"""offload_grads: write gradient shards to their tier as soon as they are reduced.

When gradient shards live on a tier (`Offload(grads=...)`, or with the optimizer states).
Before::

    gshard_k = wait(rs_k); ...; return [..., gshard_k, ...]

After (the program returns a token per unit; the step program fetches the gradient back)::

    gshard_k = wait(rs_k); o_k = offload(gshard_k, "u_k", "grad"); ...; t_k = wait(o_k); return [..., t_k, ...]

A gradient reduced in a lower precision than its unit's master (mixed precision with
`reduce_dtype` bf16/fp16) is written in the master's dtype, cast by a visible node first
(`gm = convert_element_type(gshard_k, float32); o_k = offload(gm, ...)`): the shards on the tier
are fp32, as DeepSpeed's offloaded gradient partitions are, so micro-steps accumulate there in fp32
and the step reads them back as the master's dtype.

The write's wait sits right before the offload `lookahead + 1` units later, or before the end
of the backward (`streaming.retire_behind`), bounding the gradient shards held in memory while
they are written. A gradient read inside the backward (an update in the backward) is not stored.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from fxzero.ir.ops import OPS
from fxzero.ir.tags import is_kind, output_node, phase, tag
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.streaming import retire_behind

REQUIRES = frozenset({"grads_reduced"})
PROVIDES = frozenset({"grads_offloaded"})


def _in_master_dtype(graph: fx.Graph, grad: fx.Node, master: torch.dtype) -> fx.Node:
    """`grad`, or a cast of it to `master` where it was reduced in another floating dtype."""
    val = grad.meta.get("val")
    if val is None or val.dtype == master or not (val.dtype.is_floating_point and master.is_floating_point):
        return grad
    with graph.inserting_after(grad):
        cast = graph.call_function(torch.ops.prims.convert_element_type.default, (grad, master))
    cast.meta["val"] = val.to(master)
    tag(cast, kind="compute", unit=grad.meta["fxzero"]["unit"], phase=phase(grad))
    return cast


def offload_grads_pass(gm: fx.GraphModule, ctx: PassContext, *, tier: str, lookahead: int) -> PassResult:
    """Write each gradient shard the backward returns to `tier` as soon as it is reduced."""
    graph = gm.graph
    out = output_node(graph)
    results = list(out.args[0])
    masters = {layout.name: layout.dtype for layout in ctx.layouts}
    offloads: list[tuple[fx.Node, fx.Node]] = []
    for pos, r in enumerate(results):
        if not (isinstance(r, fx.Node) and is_kind(r, "wait") and is_kind(r.args[0], "reduce_scatter")):
            continue
        if any(u is not out and not is_kind(u, "check") for u in r.users):
            continue  # read inside the program (an update in the backward): nothing to store
        unit = r.meta["fxzero"]["unit"]
        written = _in_master_dtype(graph, r, masters[unit])
        with graph.inserting_after(written):
            start = graph.call_function(OPS["offload"], (written, unit, "grad"))
        with graph.inserting_before(out):
            done = graph.call_function(OPS["wait"], (start,))
        tag(start, kind="offload", unit=unit, phase=phase(r), state="grad", tier=tier)
        tag(done, kind="wait", unit=unit, phase=phase(r), waits_for=start.name)
        results[pos] = done
        offloads.append((start, done))
    out.args = (results,)
    order = {n: i for i, n in enumerate(graph.nodes)}
    offloads.sort(key=lambda pair: order[pair[0]])  # backward order, not the outputs' unit order
    retire_behind([(start, [done]) for start, done in offloads], lookahead)
    return PassResult(gm, changed=bool(offloads), summary={"grad_offloads": len(offloads), "tier": tier})


def make(*, tier: str, lookahead: int) -> Pass:
    return Pass(
        "offload_grads",
        functools.partial(offload_grads_pass, tier=tier, lookahead=lookahead),
        requires=REQUIRES,
        provides=PROVIDES,
    )

"""insert_reduce_scatter: flatten each unit's gradients and reduce-scatter (average) them.

Before (joint outputs: model outputs, one gradient per trainable parameter, new buffers)::

    gw = ...; gb = ...                              # last gradient of unit u0 computed
    return [out, gw, gb, ..., new_bn_mean]

After (right after the unit's last gradient)::

    flat = fxzero.flatten_grads([gw, gb], [n_w, n_b], padded, dtype)
    rs = fxzero.reduce_scatter(flat, "u0", world, keep_full)
    gshard = fxzero.wait(rs)
    return [out, gshard, ..., new_bn_mean]         # one gradient shard per trainable unit

With `keep_full` (ZeRO-1) the averaged shard is written into this rank's slice of `flat`, and
the full flat gradient stays allocated as the unit's gradient buffer.
"""

from __future__ import annotations

import functools

import torch.fx as fx

from fxzero.ir.ops import OPS
from fxzero.ir.tags import BACKWARD, output_node, positions, tag
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"units_partitioned", "phases"})
PROVIDES = frozenset({"grads_reduced"})


def insert_reduce_scatter_pass(gm: fx.GraphModule, ctx: PassContext, *, keep_full: bool) -> PassResult:
    graph = gm.graph
    sig = ctx.signature
    out = output_node(graph)
    results = list(out.args[0])
    n_out, n_grads = sig.num_outputs, len(sig.trainable_fqns)
    grad_of = dict(zip(sig.trainable_fqns, results[n_out : n_out + n_grads]))
    new_buffers = results[n_out + n_grads :]

    grad_shards = []
    for layout in [lay for lay in ctx.layouts if lay.trainable]:
        grads = [grad_of[s.fqn] for s in layout.slots]
        present = [g for g in grads if isinstance(g, fx.Node)]
        pos = positions(graph)
        anchor = max(present, key=pos.__getitem__) if present else out.prev
        with graph.inserting_after(anchor):
            flat = graph.call_function(
                OPS["flatten_grads"],
                (grads, [s.numel for s in layout.slots], layout.padded_numel, layout.dtype),
            )
        with graph.inserting_after(flat):
            start = graph.call_function(
                OPS["reduce_scatter"], (flat, layout.name, ctx.world_size, keep_full)
            )
        with graph.inserting_after(start):
            done = graph.call_function(OPS["wait"], (start,))
        tag(flat, kind="flatten_grads", unit=layout.name, phase=BACKWARD)
        tag(start, kind="reduce_scatter", unit=layout.name, phase=BACKWARD, keep_full=keep_full)
        tag(done, kind="wait", unit=layout.name, phase=BACKWARD, waits_for=start.name)
        grad_shards.append(done)

    out.args = ([*results[:n_out], *grad_shards, *new_buffers],)
    ctx.outputs["grad_units"] = [lay.name for lay in ctx.layouts if lay.trainable]
    graph.eliminate_dead_code()
    return PassResult(gm, changed=bool(grad_shards), summary={"reduce_scatters": len(grad_shards)})


def make(*, keep_full: bool) -> Pass:
    return Pass(
        "insert_reduce_scatter",
        functools.partial(insert_reduce_scatter_pass, keep_full=keep_full),
        requires=REQUIRES,
        provides=PROVIDES,
    )

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
the full flat gradient stays allocated as the unit's gradient buffer. With mixed precision the
gradients (in the compute dtype) are flattened into a buffer of the reduce dtype: that flatten
is the cast (tagged `cast`, its instruction's dtype the reduce dtype), one pass over the bytes.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.fx as fx

from fxzero.ir.ops import OPS
from fxzero.ir.tags import BACKWARD, output_node, positions, tag
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"units_partitioned", "phases"})
PROVIDES = frozenset({"grads_reduced"})


def _fake(like: Optional[fx.Node], numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    val = like.meta.get("val") if like is not None else None
    if val is None or not hasattr(val, "fake_mode"):
        return None
    with val.fake_mode:
        return torch.empty(numel, dtype=dtype)


def insert_reduce_scatter_pass(gm: fx.GraphModule, ctx: PassContext, *, keep_full: bool,
                               dtype: Optional[torch.dtype] = None) -> PassResult:
    """Args:
        keep_full: ZeRO-1: the full flat gradient stays as the unit's gradient buffer.
        dtype: the dtype gradients are flattened into and reduced in (mixed precision's
            reduce_dtype: the flatten is the cast); None: each unit's own dtype.
    """
    graph = gm.graph
    sig = ctx.signature
    out = output_node(graph)
    results = list(out.args[0])
    n_out, n_grads = sig.num_outputs, len(sig.trainable_fqns)
    grad_of = dict(zip(sig.trainable_fqns, results[n_out : n_out + n_grads]))
    new_buffers = sig.new_buffer_results(results, n_grads)

    grad_shards = []
    # (a unit none of whose parameters gets a gradient, `present` empty below, still has a flat
    # gradient of zeros, typed from the graph's fake mode like the others: passes after this one
    # read its dtype, offload_grads to cast it to the master's)
    any_fake = next((n for n in graph.nodes if hasattr(n.meta.get("val"), "fake_mode")), None)
    for layout in [lay for lay in ctx.layouts if lay.trainable]:
        # (a tile's gradient is its own: [Note: tiling] in `passes/tile.py`)
        grads = [grad_of[s.fqn] if s.param_shape is None else ctx.outputs["tile_grads"][s.fqn, s.start]
                 for s in layout.slots]
        present = [g for g in grads if isinstance(g, fx.Node)]
        pos = positions(graph)
        anchor = max(present, key=pos.__getitem__) if present else out.prev
        flat_dtype = dtype or layout.dtype
        with graph.inserting_after(anchor):
            flat = graph.call_function(
                OPS["flatten_grads"],
                (grads, [s.numel for s in layout.slots], layout.padded_numel, flat_dtype),
            )
        with graph.inserting_after(flat):
            start = graph.call_function(
                OPS["reduce_scatter"], (flat, layout.name, ctx.world_size, keep_full)
            )
        with graph.inserting_after(start):
            done = graph.call_function(OPS["wait"], (start,))
        grad_dtype = next((g.meta["val"].dtype for g in present if "val" in g.meta), flat_dtype)
        tag(flat, kind="flatten_grads", unit=layout.name, phase=BACKWARD, cast=grad_dtype != flat_dtype)
        like = present[0] if present else any_fake
        flat_val, shard_val = _fake(like, layout.padded_numel, flat_dtype), _fake(like, layout.shard_numel, flat_dtype)
        if flat_val is not None:
            flat.meta["val"] = flat_val
            start.meta["val"] = done.meta["val"] = shard_val
        tag(start, kind="reduce_scatter", unit=layout.name, phase=BACKWARD, keep_full=keep_full)
        tag(done, kind="wait", unit=layout.name, phase=BACKWARD, waits_for=start.name)
        grad_shards.append(done)

    out.args = ([*results[:n_out], *grad_shards, *new_buffers, *sig.input_grad_results(results)],)
    ctx.outputs["grad_units"] = [lay.name for lay in ctx.layouts if lay.trainable]
    graph.eliminate_dead_code()
    return PassResult(gm, changed=bool(grad_shards), summary={"reduce_scatters": len(grad_shards)})


def make(*, keep_full: bool, dtype: Optional[torch.dtype] = None) -> Pass:
    return Pass(
        "insert_reduce_scatter",
        functools.partial(insert_reduce_scatter_pass, keep_full=keep_full, dtype=dtype),
        requires=REQUIRES,
        provides=PROVIDES,
    )

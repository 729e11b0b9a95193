"""step_in_backward: update each sharded unit inside the backward, as soon as its gradient is reduced.

`Offload(step_in_backward=True)`, with parameters and optimizer states offloaded: the gradient
is never written to a tier, the parameter never read a third time, and the update overlaps the
rest of the backward. The optimizer states read and written are the ones its policy declares
(`states`; [Note: optimizer states] in `fxzero/config/policies.py`). Before (backward), AdamW::

    f = fetch("u_k", "param", ...); s = wait(f); ag = all_gather(s); w = wait(ag); free(s)
    ...; g = wait(reduce_scatter(...)); return [..., g, ...]

After::

    f = fetch("u_k", "param", ...); s = wait(f); ag = all_gather(s); w = wait(ag)   # s is kept
    ...; fm = fetch("u_k", "exp_avg", ...); fv = fetch(...)     # `lookahead` updates ahead
    ...; g = wait(reduce_scatter(...))
    optim_step(s, g, [sm := wait(fm), sv := wait(fv)], "u_k")   # in place (Adagrad: [its sum])
    op, om, ov = offload(s, "param"), offload(sm, "exp_avg"), offload(sv, "exp_avg_sq")
    ...; t = wait(op); wait(om); wait(ov); free(s); free(sm); free(sv)   # retired as for gradients
    return [..., t, ...]

A unit on the tier that the backward does not gather (an embedding: no backward op reads its
weight) gets a fetch of its shard for the update alone, read ahead like its optimizer states.
Units held whole are left to the step program (`passes/step_program.py`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

import torch.fx as fx

from fxzero.ir.instruction import Instruction
from fxzero.ir.ops import OPS
from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, output_node, phase, tag
from fxzero.passes.keep_for_backward import acquired
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.streaming import compute_seconds, issue_point, retire_behind

REQUIRES = frozenset({"params_offloaded", "grads_reduced"})
PROVIDES = frozenset({"updated_in_backward"})


def step_in_backward_pass(gm: fx.GraphModule, ctx: PassContext, *, states: tuple[str, ...], params: str,
                          optimizer: str, lookahead: int, cost_model=None,
                          low_dtype: Optional[torch.dtype] = None,
                          state_dtype: Optional[torch.dtype] = None) -> PassResult:
    """Fuse each sharded unit's optimizer update into the backward (see the module doc).

    Args:
        states: the optimizer's per-element states, in the order its update takes them.
        params, optimizer: the tiers of the parameter shards and of the optimizer states.
        low_dtype: mixed precision's: the backward's shard is the low-precision copy; the update
            reads the fp32 master ("param") ahead with the optimizer states, casts it into that
            shard and writes both back.
        state_dtype: the optimizer states' dtype (`MixedPrecision.optimizer_dtype`); None: the
            masters' (the layout's).
    """
    graph = gm.graph
    mp = low_dtype is not None
    shard_state = "low" if mp else "param"
    out = output_node(graph)
    results = list(out.args[0])
    # unit -> the backward's fetched parameter shard (read in the backward, or kept from the forward)
    shard_of = {unit: wait for unit, (_, wait) in acquired(graph, BACKWARD, "fetched").items()}
    # A unit on the tier that the backward does not gather (an embedding: no backward op reads its
    # weight) gets a fetch of its shard for the update alone, read ahead like its optimizer states.
    in_forward = acquired(graph, FORWARD, "fetched")
    read_for_update: dict[str, fx.Node] = {}
    writes: list[tuple[fx.Node, list[fx.Node]]] = []
    fused = []
    scatters = [n for n in graph.nodes if is_kind(n, "reduce_scatter") and phase(n) == BACKWARD]
    for pos, r in enumerate(results):
        if not (isinstance(r, fx.Node) and is_kind(r, "wait") and is_kind(r.args[0], "reduce_scatter")):
            continue
        unit = r.meta["fxzero"]["unit"]
        layout = ctx.layout(unit)
        if unit not in shard_of and unit not in in_forward or any(u is not out for u in r.users):
            continue  # a persistent unit (no fetched shard): updated by the step program
        # The update runs while the next unit's backward computes, not in a burst at the end
        # (prefetch may have sunk the reduce-scatter's wait there): its wait goes right before
        # the next reduce-scatter is issued, if it is later than that. (Moved first: a shard read for
        # the update alone is waited for right before it.)
        later = scatters[scatters.index(r.args[0]) + 1 :]
        if later:
            order = {n: i for i, n in enumerate(graph.nodes)}
            if order[r] > order[later[0]]:
                later[0].prepend(r)
        if unit not in shard_of:
            with graph.inserting_before(r):  # the fetch moves ahead below, with the optimizer states'
                fetch_param = graph.call_function(OPS["fetch"], (unit, shard_state, layout.shard_numel,
                                                                 low_dtype or layout.dtype))
                shard = graph.call_function(OPS["wait"], (fetch_param,))
            tag(fetch_param, kind="fetch", unit=unit, phase=BACKWARD, state=shard_state, tier=params)
            fetch_param.meta["val"] = shard.meta["val"] = torch.empty(
                layout.shard_numel, dtype=low_dtype or layout.dtype, device="meta")
            tag(shard, kind="wait", unit=unit, phase=BACKWARD, waits_for=fetch_param.name)
            read_for_update[unit] = fetch_param
        else:
            shard = shard_of[unit]
        fetch_param = shard.args[0]
        for free in [u for u in shard.users if is_kind(u, "free")]:
            graph.erase_node(free)  # the shard lives on until its update
        fetches = []  # the optimizer's states, and with mixed precision the fp32 master after them
        read = states + (("param",) if mp else ())
        with graph.inserting_after(fetch_param):
            for state in reversed(read):  # inserted in reverse: the first state comes first
                dtype = layout.dtype if state == "param" or state_dtype is None else state_dtype
                f = graph.call_function(OPS["fetch"], (unit, state, layout.shard_numel, dtype))
                tag(f, kind="fetch", unit=unit, phase=BACKWARD, state=state, tier=params if state == "param" else optimizer)
                f.meta["val"] = torch.empty(layout.shard_numel, dtype=dtype, device="meta")
                fetches.insert(0, f)
        done = []
        first_write = None
        with graph.inserting_before(r.next):  # everything below, in order, right after g
            waits = []
            for f in fetches:
                waits.append(graph.call_function(OPS["wait"], (f,)))
                tag(waits[-1], kind="wait", unit=unit, phase=BACKWARD, waits_for=f.name)
                waits[-1].meta["val"] = f.meta["val"]
            state_values = waits[: len(states)]
            master = waits[len(states)] if mp else shard
            update = graph.call_function(OPS["optim_step"], (master, r, state_values, unit))  # in place
            tag(update, kind="optim_step", unit=unit, phase=BACKWARD)
            written = [(master, "param", params)] + [(v, k, optimizer) for v, k in zip(state_values, states)]
            if mp:  # the master into the backward's low-precision shard, written back beside it
                cast = graph.call_function(OPS["cast_into"], (shard, master, unit))
                tag(cast, kind="cast", unit=unit, phase=BACKWARD)
                written.insert(1, (shard, "low", params))
            for value, state, tier in written:
                write = graph.call_function(OPS["offload"], (value, unit, state))
                tag(write, kind="offload", unit=unit, phase=BACKWARD, state=state, tier=tier)
                first_write = first_write or write
                with graph.inserting_before(out):
                    done.append(graph.call_function(OPS["wait"], (write,)))
                tag(done[-1], kind="wait", unit=unit, phase=BACKWARD, waits_for=write.name)
        # The fetched buffers are released once their new values are on the tier.
        with graph.inserting_before(out):
            for buffer in dict.fromkeys((shard, *waits)):
                done.append(graph.call_function(OPS["free"], (buffer,)))
                tag(done[-1], kind="free", unit=unit, phase=BACKWARD)
        results[pos] = done[0]  # the unit's token: its parameter is written back
        writes.append((first_write, done))
        fused.append(unit)
    out.args = (results,)
    ctx.outputs["updated_in_backward"] = fused
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes.sort(key=lambda w: order[w[0]])
    retire_behind(writes, lookahead)
    # The optimizer states are read `lookahead` updates ahead: before the reduce-scatter of the unit
    # updated that many places earlier (the first ones: before their own reduce-scatter); with a
    # cost model, one more back where the compute in between would not cover their read (the
    # last updates come close together: the embedding's backward is short).
    updates = sorted((n for n in graph.nodes if is_kind(n, "optim_step")), key=order.__getitem__)
    scatters = [u.args[1].args[0] for u in updates]  # optim_step(shard, wait(reduce_scatter), ...)
    seconds = compute_seconds(graph, {lay.name: lay for lay in ctx.layouts}, cost_model) if cost_model is not None else None
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for j, u in enumerate(updates):
        back = j - issue_point(j, lookahead)
        if seconds is not None:
            layout = ctx.layout(u.args[3])
            tensors = len(states) + mp + (u.args[3] in read_for_update)
            probe = Instruction(name="", kind="fetch", stream="io", tier=optimizer,
                                bytes=tensors * layout.shard_numel * layout.itemsize)
            read_s = cost_model.io_seconds(probe)
            while back < min(j, lookahead + 1) and sum(
                    seconds[n] for n in nodes[position[scatters[j - back]] : position[u]]) < read_s:
                back += 1
        reads = tuple(w.args[0] for w in u.args[2])  # optim_step(.., [wait(fetch state), ...], unit)
        if mp:
            reads += (u.args[0].args[0],)  # optim_step(wait(fetch master), ...)
        if u.args[3] in read_for_update:
            reads = (read_for_update[u.args[3]],) + reads
        for fetch in reads:
            scatters[j - back].prepend(fetch)
    return PassResult(gm, changed=bool(fused), summary={"updated_in_backward": fused})


def make(*, states: tuple[str, ...], params: str, optimizer: str, lookahead: int, cost_model=None,
         low_dtype: Optional[torch.dtype] = None, state_dtype: Optional[torch.dtype] = None) -> Pass:
    return Pass(
        "step_in_backward",
        functools.partial(step_in_backward_pass, states=states, params=params, optimizer=optimizer,
                          lookahead=lookahead, cost_model=cost_model, low_dtype=low_dtype, state_dtype=state_dtype),
        requires=REQUIRES,
        provides=PROVIDES,
    )

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
import operator
from typing import Optional

import torch.fx as fx

from fxzero.ir.ops import OPS
from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, output_node, phase, tag
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.ir.instruction import Instruction
from fxzero.ir.lower import instruction_of

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
            # Issuing takes an instruction's overhead anyway: a read shorter than that is hidden
            # by the issue alone (adjacent gathers, as prefetch bunches them, have no compute
            # between them to cover anything).
            read_s = max(0.0, cost_model.io_seconds(probe) - cost_model.op_overhead_s)
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


def _fetched_shards(graph: fx.Graph, which: str) -> dict[str, fx.Node]:
    """unit -> the fetched parameter shard its gather in phase `which` reads, in gather order."""
    out = {}
    for g in graph.nodes:
        if is_kind(g, "all_gather") and phase(g) == which:
            shard = g.args[0]
            if isinstance(shard, fx.Node) and (is_kind(shard.args[0], "fetch") if shard.args else False):
                out[g.meta["fxzero"]["unit"]] = shard
    return out


def _keep_shards_for_backward(graph: fx.Graph, count: int) -> list[str]:
    """Keep the parameter shards the backward reads first from the forward, which read them last.

    Before::                                          After::

        s = wait(fetch(u)); ag(s); ...; free(s)           s = wait(fetch(u)); ag(s); ...     # forward
        s_1 = wait(fetch(u)); ag_1(s_1); ...; free(s_1)   ag_1(s); ...; free(s)              # backward

    Kept: the units among both the forward's last `count` fetches and the backward's first
    `count + 1` gathers (`count` = lookahead + 1, the fetched shards the schedule holds anyway),
    so a kept shard lives only over the forward's tail, not all of it (a root unit used first
    and last in the forward is read again). The kept shard crosses the boundary as a saved
    value, tagged `kept="fetched"`; with step_in_backward it is what the update reads.
    """
    forward = _fetched_shards(graph, FORWARD)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_fetched = set(sorted(forward, key=lambda u: order[forward[u].args[0]])[-count:]) if count else set()
    kept = []
    for unit, s_b in list(_fetched_shards(graph, BACKWARD).items())[: count + 1]:
        if unit not in last_fetched:
            continue
        s_f = forward[unit]
        for free in [u for u in s_f.users if is_kind(u, "free")]:
            graph.erase_node(free)
        fetch_b = s_b.args[0]
        s_b.replace_all_uses_with(s_f)
        graph.erase_node(s_b)
        graph.erase_node(fetch_b)
        tag(s_f, kept="fetched")
        kept.append(unit)
    return kept


def _offload_grads(graph: fx.Graph, tier: str, lookahead: int) -> int:
    out = output_node(graph)
    results = list(out.args[0])
    offloads: list[tuple[fx.Node, fx.Node]] = []
    for pos, r in enumerate(results):
        if not (isinstance(r, fx.Node) and is_kind(r, "wait") and is_kind(r.args[0], "reduce_scatter")):
            continue
        if any(u is not out for u in r.users):
            continue  # read inside the program (an update in the backward): nothing to store
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
    _bound_in_flight(graph, [(start, [done]) for start, done in offloads], lookahead)
    return len(offloads)


def _bound_in_flight(graph: fx.Graph, writes: list[tuple[fx.Node, list[fx.Node]]], lookahead: int) -> None:
    """Per unit (in program order): its first write and its writes' waits. Unit k's waits move
    to just before unit k + lookahead + 1's first write (or stay before the output)."""
    for k, (_, waits) in enumerate(writes):
        later = k + lookahead + 1
        if later < len(writes):
            for w in waits:
                writes[later][0].prepend(w)


def _fuse_steps(graph: fx.Graph, ctx: PassContext, params: str, optimizer: str, lookahead: int,
                cost_model=None) -> list[str]:
    """Update each sharded unit right after its gradient is reduced; see `step_in_backward`.

    Before (backward)::

        f = fetch(unit_k, "param"); s = wait(f); ag = all_gather(s); w = wait(ag); free(s)
        ...; g = wait(reduce_scatter(...)); return [..., g, ...]

    After::

        f = fetch(unit_k, "param"); s = wait(f); ag = all_gather(s); w = wait(ag)   # s is kept
        ...; fm = fetch(unit_k, "exp_avg"); fv = fetch(unit_k, "exp_avg_sq")   # lookahead updates
        ...; g = wait(reduce_scatter(...))                                      # ahead
        p, m, v = adamw(s, g, sm := wait(fm), sv := wait(fv), "unit_k")
        op, om, ov = offload(p, "param"), offload(m, "exp_avg"), offload(v, "exp_avg_sq")
        ...; t = wait(op); wait(om); wait(ov); free(s); free(sm); free(sv)   # bounded as for
        return [..., t, ...]                                                  # gradients
    """
    out = output_node(graph)
    results = list(out.args[0])
    # unit -> the backward's fetched parameter shard (read in the backward, or kept from the forward)
    shard_of = _fetched_shards(graph, BACKWARD)
    # A unit on the tier that the backward does not gather (an embedding: no backward op reads its
    # weight) gets a fetch of its shard for the update alone, read ahead like its moments.
    in_forward = _fetched_shards(graph, FORWARD)
    read_for_update: dict[str, fx.Node] = {}
    writes: list[tuple[fx.Node, list[fx.Node]]] = []
    fused = []
    scatters = [n for n in graph.nodes if is_kind(n, "reduce_scatter") and phase(n) == BACKWARD]
    for pos, r in enumerate(results):
        if not (isinstance(r, fx.Node) and is_kind(r, "wait") and is_kind(r.args[0], "reduce_scatter")):
            continue
        unit = r.meta["fxzero"]["unit"]
        if unit not in shard_of and unit not in in_forward or any(u is not out for u in r.users):
            continue  # a persistent unit (no fetched shard): updated by the step program
        if unit not in shard_of:
            unit_node = in_forward[unit].args[0].args[0]
            with graph.inserting_before(r):  # the fetch moves ahead below, with the moments'
                fetch_param = graph.call_function(OPS["fetch"], (unit_node, unit, "param"))
                shard = graph.call_function(OPS["wait"], (fetch_param,))
            tag(fetch_param, kind="fetch", unit=unit, phase=BACKWARD, state="param", algorithm=params)
            tag(shard, kind="wait", unit=unit, phase=BACKWARD, waits_for=fetch_param.name)
            read_for_update[unit] = fetch_param
        else:
            shard = shard_of[unit]
        fetch_param, unit_node = shard.args[0], shard.args[0].args[0]
        # The update runs while the next unit's backward computes, not in a burst at the end
        # (prefetch may have sunk the reduce-scatter's wait there): its wait goes right before
        # the next reduce-scatter is issued, if it is later than that.
        later = scatters[scatters.index(r.args[0]) + 1 :]
        if later:
            order = {n: i for i, n in enumerate(graph.nodes)}
            if order[r] > order[later[0]]:
                later[0].prepend(r)
        for free in [u for u in shard.users if is_kind(u, "free")]:
            graph.erase_node(free)  # the shard lives on until its update
        moments = []
        with graph.inserting_after(fetch_param):
            for state in ("exp_avg_sq", "exp_avg"):  # inserted in reverse: exp_avg comes first
                f = graph.call_function(OPS["fetch"], (unit_node, unit, state))
                tag(f, kind="fetch", unit=unit, phase=BACKWARD, state=state, algorithm=optimizer)
                moments.insert(0, f)
        done = []
        first_write = None
        with graph.inserting_before(r.next):  # everything below, in order, right after g
            waits = []
            for f in moments:
                waits.append(graph.call_function(OPS["wait"], (f,)))
                tag(waits[-1], kind="wait", unit=unit, phase=BACKWARD, waits_for=f.name)
            update = graph.call_function(OPS["adamw"], (shard, r, waits[0], waits[1], unit))
            tag(update, kind="optim_step", unit=unit, phase=BACKWARD)
            for index, (state, tier) in enumerate((("param", params), ("exp_avg", optimizer), ("exp_avg_sq", optimizer))):
                value = graph.call_function(operator.getitem, (update, index))
                tag(value, kind="compute", unit=unit, phase=BACKWARD)
                write = graph.call_function(OPS["offload"], (value, unit, state))
                tag(write, kind="offload", unit=unit, phase=BACKWARD, state=state, algorithm=tier)
                first_write = first_write or write
                with graph.inserting_before(out):
                    done.append(graph.call_function(OPS["wait"], (write,)))
                tag(done[-1], kind="wait", unit=unit, phase=BACKWARD, waits_for=write.name)
        # The fetched buffers are released once their new values are on the tier.
        with graph.inserting_before(out):
            for buffer in (shard, *waits):
                done.append(graph.call_function(OPS["free"], (buffer,)))
                tag(done[-1], kind="free", unit=unit, phase=BACKWARD)
        results[pos] = done[0]  # the unit's token: its parameter is written back
        writes.append((first_write, done))
        fused.append(unit)
    out.args = (results,)
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes.sort(key=lambda w: order[w[0]])
    _bound_in_flight(graph, writes, lookahead)
    # The moments are read `lookahead` updates ahead: before the reduce-scatter of the unit
    # updated that many places earlier (the first ones: before their own reduce-scatter); with a
    # cost model, one more back where the compute in between would not cover their read (the
    # last updates come close together: the embedding's backward is short).
    updates = sorted((n for n in graph.nodes if is_kind(n, "optim_step")), key=order.__getitem__)
    scatters = [u.args[1].args[0] for u in updates]  # adamw(shard, wait(reduce_scatter), ...)
    seconds = _compute_seconds(graph, ctx, cost_model) if cost_model is not None else None
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for j, u in enumerate(updates):
        back = min(j, lookahead)
        if seconds is not None:
            layout = ctx.layout(u.args[4])
            states = 3 if u.args[4] in read_for_update else 2
            probe = Instruction(name="", kind="fetch", stream="io", algorithm=optimizer,
                                bytes=states * layout.shard_numel * layout.itemsize)
            read_s = cost_model.io_seconds(probe)
            while back < min(j, lookahead + 1) and sum(
                    seconds[n] for n in nodes[position[scatters[j - back]] : position[u]]) < read_s:
                back += 1
        reads = (u.args[2].args[0], u.args[3].args[0])  # adamw(.., wait(fetch m), wait(fetch v))
        if u.args[4] in read_for_update:
            reads = (read_for_update[u.args[4]],) + reads
        for fetch in reads:
            scatters[j - back].prepend(fetch)
    return fused


def offload_pass(gm: fx.GraphModule, ctx: PassContext, *, params: Optional[str], grads: Optional[str],
                 lookahead: int, cost_model=None, step_in_backward: Optional[str] = None) -> PassResult:
    graph = gm.graph
    fetched = _fetch_params(graph, ctx, params, lookahead, cost_model) if params else 0
    kept = _keep_shards_for_backward(graph, lookahead + 1) if params else []
    fused = _fuse_steps(graph, ctx, params, step_in_backward, lookahead, cost_model) if step_in_backward else []
    written = _offload_grads(graph, grads, lookahead) if grads else 0
    ctx.outputs["updated_in_backward"] = fused
    return PassResult(
        gm,
        changed=bool(fetched or written or fused or kept),
        summary={"param_fetches": fetched, "grad_offloads": written, "params_tier": params,
                 "grads_tier": grads, "lookahead": lookahead, "updated_in_backward": len(fused),
                 "shards_kept_for_backward": kept},
    )


def make(*, params: Optional[str], grads: Optional[str], lookahead: int, cost_model=None,
         step_in_backward: Optional[str] = None) -> Pass:
    """`params` / `grads`: the tier name each lives on, or None when on the device; `cost_model`
    (optional) prices reads and compute, so a fetch leads its gather by no more than it needs;
    `step_in_backward`: the optimizer states' tier, to update units in the backward."""
    return Pass(
        "offload",
        functools.partial(offload_pass, params=params, grads=grads, lookahead=lookahead, cost_model=cost_model,
                          step_in_backward=step_in_backward),
        requires=REQUIRES,
        provides=PROVIDES,
    )

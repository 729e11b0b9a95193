"""offload_params: fetch offloaded parameter shards from their tier before their gathers.

ZeRO-3 units whose shards live on a tier (`Offload(params=Cpu() | Nvme(...))`). Before::

    ag1 = all_gather(unit_1); ...; w1 = wait(ag1); ...block 1...; free(w1)

After (the shard is read from its tier ahead of the gather, and released once gathered)::

    f1 = fetch("unit_1", "param", n, dtype)    # issued `lookahead` gathers earlier
    ...
    s1 = wait(f1); ag1 = all_gather(s1); ...; w1 = wait(ag1); free(s1); ...block 1...; free(w1)

The fetch of a unit's shard is issued right before an earlier gather of the same phase (right
before its own gather for the phase's first unit): `lookahead` gathers back (`streaming.
issue_point`), or, with a cost model, the nearest one (at least one back, at most `lookahead`)
whose predicted compute up to this gather covers the predicted read. At most `lookahead + 1`
fetched shards are in memory at once. The simulator (`fxzero.cost.simulate`, io stream) shows
whether the lead hides the reads. The unit's placeholder is then read by nothing: the engine
binds it to nothing.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

import torch.fx as fx

from fxzero.ir.instruction import Instruction
from fxzero.ir.ops import OPS
from fxzero.ir.tags import is_kind, phase, tag, wait_of
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.streaming import compute_seconds, issue_point

REQUIRES = frozenset({"params_gathered"})
PROVIDES = frozenset({"params_offloaded"})


def _lead(same_phase: list[fx.Node], lookahead: int, read_s: float, seconds, order) -> fx.Node:
    """The gather to issue the fetch before: the nearest earlier one (at least one back, at most
    `lookahead`) whose compute up to this gather covers the read; without prices, `lookahead` back."""
    k = len(same_phase) - 1
    if seconds is None or lookahead == 0:
        return same_phase[issue_point(k, lookahead)]
    nodes = list(order)
    position = {n: i for i, n in enumerate(nodes)}
    for back in range(1, lookahead + 1):
        if k - back < 0:
            return same_phase[0]
        lo, hi = position[same_phase[k - back]], position[same_phase[k]]
        if sum(seconds.get(n, 0.0) for n in nodes[lo:hi]) >= read_s:
            return same_phase[k - back]
    return same_phase[issue_point(k, lookahead)]


def offload_params_pass(gm: fx.GraphModule, ctx: PassContext, *, tier: str, lookahead: int, cost_model=None,
                        low_dtype: Optional[torch.dtype] = None) -> PassResult:
    """Fetch each sharded unit's parameter shard from `tier` ahead of every gather of it (with
    mixed precision, `low_dtype`: the shard's low-precision copy, state "low", not the master)."""
    graph = gm.graph
    state = "low" if low_dtype is not None else "param"
    gathers = [n for n in graph.nodes if is_kind(n, "all_gather")]
    seconds = compute_seconds(graph, {lay.name: lay for lay in ctx.layouts}, cost_model) if cost_model is not None else None
    fetched = 0
    for i, gather in enumerate(gathers):
        unit_node = gather.args[0]
        if not (isinstance(unit_node, fx.Node) and is_kind(unit_node, "unit")):
            continue
        unit, which = gather.meta["fxzero"]["unit"], phase(gather)
        layout = ctx.layout(unit)
        read_s = 0.0
        if cost_model is not None:
            probe = Instruction(name="", kind="fetch", stream="io", tier=tier,
                                bytes=layout.shard_numel * (low_dtype or layout.dtype).itemsize)
            # Issuing takes an instruction's overhead anyway: a read shorter than that is hidden
            # by the issue alone (adjacent gathers, as prefetch bunches them, have no compute
            # between them to cover anything).
            read_s = max(0.0, cost_model.io_seconds(probe) - cost_model.op_overhead_s)
        # Issue point: an earlier gather of this phase (see _lead), or right before its own.
        same_phase = [g for g in gathers[: i + 1] if phase(g) == which]
        anchor = _lead(same_phase, lookahead, read_s, seconds, graph.nodes)
        with graph.inserting_before(anchor):
            start = graph.call_function(OPS["fetch"], (unit, state, layout.shard_numel, low_dtype or layout.dtype))
        with graph.inserting_before(gather):
            shard = graph.call_function(OPS["wait"], (start,))
        gather.replace_input_with(unit_node, shard)
        with graph.inserting_after(wait_of(gather)):
            freed = graph.call_function(OPS["free"], (shard,))
        tag(start, kind="fetch", unit=unit, phase=which, state=state, tier=tier)
        start.meta["val"] = shard.meta["val"] = torch.empty(layout.shard_numel, dtype=low_dtype or layout.dtype,
                                                             device="meta")
        tag(shard, kind="wait", unit=unit, phase=which, waits_for=start.name)
        tag(freed, kind="free", unit=unit, phase=which)
        fetched += 1
    return PassResult(gm, changed=fetched > 0, summary={"param_fetches": fetched, "tier": tier, "lookahead": lookahead})


def make(*, tier: str, lookahead: int, cost_model=None, low_dtype: Optional[torch.dtype] = None) -> Pass:
    """`tier`: where the parameter shards live; `cost_model` (optional) prices reads and compute,
    so a fetch leads its gather by no more than it needs."""
    return Pass(
        "offload_params",
        functools.partial(offload_params_pass, tier=tier, lookahead=lookahead, cost_model=cost_model,
                          low_dtype=low_dtype),
        requires=REQUIRES,
        provides=PROVIDES,
    )

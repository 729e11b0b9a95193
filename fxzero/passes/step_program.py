"""step_program: the optimizer step as a program like the forward and the backward.

For every trainable unit the backward does not update itself (`Offload.step_in_backward`), the
step program reads its states, updates its shard and writes back what changed, streamed unit by
unit ([Note: streaming] in `passes/streaming.py`). The optimizer states are the ones its policy
declares (`states`: AdamW's exp_avg and exp_avg_sq, Adagrad's sum; [Note: optimizer states] in
`fxzero/config/policies.py`). Per unit, with every state on a tier and AdamW::

    f_p = fetch("u", "param", n, dt); f_m = fetch("u", "exp_avg", ...); f_v = ...   # issued ahead
    ...
    p = wait(f_p); m = wait(f_m); v = wait(f_v)
    g = wait(g_u)                                  # g_u: the gradient, left in flight by the backward
    optim_step(p, g, [m, v], "u")                  # in place (Adagrad: [s], its sum)
    o_p = offload(p, "u", "param"); o_m = ...; o_v = ...
    ...
    wait(o_p); free(p); wait(o_m); free(m); ...    # retired `lookahead` units later

A state on the device is a placeholder instead of a fetch (the unit's shard `unit_u`, each
optimizer state `<state>_u`: `exp_avg_u`, `exp_avg_sq_u`) and is updated where it lives; a unit
held whole (ZeRO-1/2, or under the persistence threshold) updates this rank's slice of its full
buffer and then gathers every rank's slice into it: `wait(all_gather_into(unit_u, "u", world))`.

[Note: master and low]
With mixed precision and fp32 masters a unit's parameters live twice on this rank: the fp32 master
shard, which the optimizer updates with its states (the placeholder `unit_u`), and the copy in the compute dtype
that the forward and backward gather (`low_unit_u`: this rank's shard, or a unit held whole's full
buffer). After the update the master is cast into it, once per step and on the shard only
(`cast_into(low_unit_u, unit_u, "u")`); a unit held whole then gathers every rank's slice of it, in
the compute dtype. With masters in the compute dtype ([Note: low-precision masters] in
`fxzero/config/precision.py`) there is no copy: the program is fp32 training's, in that dtype.
The optimizer states' placeholders and fetches carry their own dtype (`state_dtype`).

[Note: gradients carried into the step]
The backward's last reduce-scatters (the embedding's, issued after the last compute) would
otherwise be waited for at the backward's end with nothing left to overlap them. Instead the
waits the backward ends with move into the step (what is in flight when the backward ends does
not change): the collectives complete while the step updates the units whose gradients arrived
first, and the step waits for each gradient right before that unit's update. This pass moves
them: the backward's output becomes the reduce-scatter itself, and the step program's
placeholder for that gradient, named like it, is waited for. Units whose gradients are ready are
updated first, in layout order; then those still in flight, in the order the backward issued them.
Only waits the backward ends with move, so what is in flight when the backward ends, and the
prefetch budget's accounting, do not change.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch
import torch.fx as fx

from fxzero.ir.layout import UnitLayout
from fxzero.ir.ops import OPS
from fxzero.ir.program import Program
from fxzero.ir.tags import STEP, is_kind, output_node, tag
from fxzero.passes.partition import unit_placeholder_name
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.streaming import streamed

REQUIRES = frozenset({"split"})
PROVIDES = frozenset({"step_program"})


def _is_trailing_gradient_wait(node: fx.Node, out: fx.Node) -> bool:
    return (is_kind(node, "wait") and is_kind(node.args[0], "reduce_scatter")
            and all(u is out for u in node.users))


def _carry_gradients(backward: Program, stepped: frozenset[str]) -> list[str]:
    """Drop the waits the backward ends with for gradients the step updates; the backward's
    output for each is then its reduce-scatter, in flight. Returns those units in issue order."""
    graph = backward.gm.graph
    out = output_node(graph)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    last = max((i for i, n in enumerate(nodes) if not is_kind(n, "wait")), default=-1)
    carried = [n for n in nodes[last + 1:] if _is_trailing_gradient_wait(n, out) and n.meta["fxzero"]["unit"] in stepped]
    if not carried:
        return []
    order = {n: i for i, n in enumerate(graph.nodes)}
    units = [w.meta["fxzero"]["unit"] for w in sorted(carried, key=lambda w: order[w.args[0]])]
    results = list(out.args[0])
    for wait in carried:
        results[results.index(wait)] = wait.args[0]
    out.args = (results,)
    for wait in carried:
        graph.erase_node(wait)
    backward.gm.recompile()
    return units


class _Builder:
    """Emits the step program's nodes into a fresh graph, tagged as the IR requires."""

    def __init__(self, world_size: int) -> None:
        self.graph = fx.Graph()
        self.world_size = world_size
        self.inputs: list[tuple[str, str]] = []

    def placeholder(self, name: str, kind: str, key: tuple[str, str], unit: str, val: torch.Tensor,
                    **fields) -> fx.Node:
        node = self.graph.placeholder(name)
        tag(node, kind=kind, unit=unit, phase=STEP, **fields)
        node.meta["val"] = val
        self.inputs.append(key)
        return node

    def call(self, op: str, args: tuple, kind: str, unit: str, val=None, **fields) -> fx.Node:
        node = self.graph.call_function(OPS[op], args)
        tag(node, kind=kind, unit=unit, phase=STEP, **fields)
        if val is not None:
            node.meta["val"] = val
        return node

    def wait(self, start: fx.Node, unit: str) -> fx.Node:
        return self.call("wait", (start,), "wait", unit, start.meta.get("val"), waits_for=start.name)


def _fake(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device="meta")


def step_program_pass(gm: fx.GraphModule, ctx: PassContext, *, states: tuple[str, ...], tiers: dict[str, str],
                      lookahead: int, persistent: frozenset[str], low_dtype: Optional[torch.dtype] = None,
                      grad_dtype: Optional[torch.dtype] = None, state_dtype: Optional[torch.dtype] = None
                      ) -> PassResult:
    """Build `ctx.programs["step"]`; move the backward's trailing gradient waits into it.

    Args:
        states: the optimizer's per-element states, in the order its update takes them.
        tiers: state kind -> tier, for the states placed off the device.
        lookahead: units whose states are read ahead of the one being updated.
        persistent: units held whole for the whole step.
        low_dtype: mixed precision's compute dtype: the unit's parameters are an fp32 master
            shard (what the optimizer updates) and a copy in this dtype (what the forward gathers),
            cast from the master after the update ([Note: master and low] above).
        grad_dtype: the dtype gradients are reduced in and held (mixed precision's reduce dtype,
            or its compute dtype when gradients are reduced in it); None: each unit's own.
        state_dtype: the optimizer states' dtype (`MixedPrecision.optimizer_dtype`); None: each
            unit's own (its masters').
    """
    backward = ctx.programs["backward"]
    in_backward = frozenset(ctx.outputs.get("updated_in_backward", ()))
    units = [lay for lay in ctx.layouts if lay.trainable and lay.name not in in_backward]
    carried = _carry_gradients(backward, frozenset(u.name for u in units))
    arrival = {unit: i for i, unit in enumerate(carried)}
    units.sort(key=lambda lay: arrival.get(lay.name, -1))  # stable: the ready ones in layout order
    grad_names = {unit: r.name for (kind, unit), r in zip(backward.outputs, output_node(backward.gm.graph).args[0])
                  if kind == "grad"}

    b = _Builder(ctx.world_size)

    def grad_of(layout: UnitLayout) -> torch.dtype:
        """What the backward left the unit's gradient in (the update casts it to the master's)."""
        return grad_dtype if grad_dtype is not None and layout.dtype.is_floating_point else layout.dtype

    def dtype_of(layout: UnitLayout, kind: str) -> torch.dtype:
        """The dtype state `kind` of the unit is held in (gradients on a tier: the masters')."""
        if kind == "low":
            return low_dtype
        if kind in states and state_dtype is not None:
            return state_dtype
        return layout.dtype

    def fetched(layout: UnitLayout) -> list[str]:
        # With mixed precision and offloaded parameters the low-precision shard is read too, as the
        # buffer the updated master is cast into before both are written back.
        kinds = ("param", "grad", *states) + (("low",) if low_dtype is not None else ())
        return [k for k in kinds if k in tiers and not (k in ("param", "low") and layout.name in persistent)]

    # Placeholders for what lives on the device: the parameter buffer, the gradient, the optimizer states.
    resident: dict[tuple[str, str], fx.Node] = {}
    for lay in units:
        whole = lay.name in persistent
        on_tier = fetched(lay)
        numel = lay.padded_numel if whole else lay.shard_numel
        if "param" not in on_tier and low_dtype is None:
            resident["param", lay.name] = b.placeholder(
                unit_placeholder_name(lay.name), "unit", ("unit", lay.name), lay.name, _fake(numel, lay.dtype), sharded=not whole)
        elif "param" not in on_tier:  # the master is this rank's shard even for a unit held whole
            resident["param", lay.name] = b.placeholder(
                unit_placeholder_name(lay.name), "unit", ("unit", lay.name), lay.name,
                _fake(lay.shard_numel, lay.dtype), sharded=True)
            resident["low", lay.name] = b.placeholder(
                "low_" + unit_placeholder_name(lay.name), "unit", ("low", lay.name), lay.name,
                _fake(numel, low_dtype), sharded=not whole)
        if "grad" not in on_tier:
            resident["grad", lay.name] = b.placeholder(
                grad_names[lay.name], "grad", ("grad", lay.name), lay.name,
                _fake(lay.shard_numel, grad_of(lay)), carried=lay.name in arrival)
        for state in states:
            if state not in on_tier:
                resident[state, lay.name] = b.placeholder(
                    re.sub(r"\W", "_", f"{state}_{lay.name}"), "optim_state", (state, lay.name), lay.name,
                    _fake(lay.shard_numel, dtype_of(lay, state)), state=state)

    reads: dict[str, dict[str, fx.Node]] = {}  # unit -> state -> its fetch
    writes: dict[str, list[tuple[fx.Node, fx.Node]]] = {}  # unit -> (offload, the buffer it wrote)
    for event, i in streamed(len(units), lookahead):
        lay = units[i]
        u = lay.name
        if event == "issue":
            dtype = {k: dtype_of(lay, k) for k in fetched(lay)}
            reads[u] = {k: b.call("fetch", (u, k, lay.shard_numel, dtype[k]), "fetch", u,
                                  _fake(lay.shard_numel, dtype[k]), state=k, tier=tiers[k])
                        for k in fetched(lay)}
        elif event == "run":
            value = {k: b.wait(f, u) for k, f in reads[u].items()}
            for (k, unit), node in resident.items():
                if unit == u:
                    value.setdefault(k, node)
            if "grad" not in reads[u] and u in arrival:
                value["grad"] = b.wait(value["grad"], u)
            b.call("optim_step", (value["param"], value["grad"], [value[k] for k in states], u), "optim_step", u)
            gathered = value["param"]
            if "low" in value:
                b.call("cast_into", (value["low"], value["param"], u), "cast", u)
                gathered = value["low"]
            if u in persistent:
                b.wait(b.call("all_gather_into", (gathered, u, ctx.world_size), "all_gather", u), u)
            if "grad" in reads[u]:
                b.call("free", (value["grad"],), "free", u)  # consumed by the update
            writes[u] = [(b.call("offload", (value[k], u, k), "offload", u, state=k, tier=tiers[k]), value[k])
                         for k in reads[u] if k != "grad"]
        else:  # retire
            for start, buffer in writes[u]:
                b.wait(start, u)
                b.call("free", (buffer,), "free", u)
    b.graph.output([])
    b.graph.lint()
    ctx.programs["step"] = Program(STEP, fx.GraphModule({}, b.graph, class_name="step_program"), b.inputs, [])
    summary = {"units": len(units), "carried_gradients": carried, "lookahead": lookahead, "states": list(states),
               "fetched_states": sorted({k for lay in units for k in fetched(lay)})}
    return PassResult(gm, changed=bool(carried), summary=summary)


def make(*, states: tuple[str, ...], tiers: dict[str, str], lookahead: int, persistent: frozenset[str],
         low_dtype: Optional[torch.dtype] = None, grad_dtype: Optional[torch.dtype] = None,
         state_dtype: Optional[torch.dtype] = None) -> Pass:
    return Pass(
        "step_program",
        functools.partial(step_program_pass, states=states, tiers=tiers, lookahead=lookahead, persistent=persistent,
                          low_dtype=low_dtype, grad_dtype=grad_dtype, state_dtype=state_dtype),
        requires=REQUIRES,
        provides=PROVIDES,
    )

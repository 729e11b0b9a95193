"""separate_phases: tag every node forward or backward; recompute parameter-derived values.

The forward is what the model's outputs and buffer updates need; everything else is backward.
A forward value the backward uses is saved across the boundary, unless it is derived from
parameters alone (a view, a transpose, a cast of a weight): such a value is recomputed in the
backward from the unit's own buffer, so gathered parameters never cross the boundary.

Inside a recompute region (a unit under `Activations(recompute="unit")`, a model's own
torch.utils.checkpoint call: [Note: recompute regions] in `fxzero/trace.py`), a value that stays
in the region is recomputed in the backward the same way, from what the region kept: its inputs
and its random operators' draws ([Note: recomputing a unit] in `fxzero/config/activations.py`);
with `Activations(keep_attention=True)`, its fused attentions' outputs too.

A size (`aten.sym_size` of a forward value, and arithmetic on sizes, in a program traced with
symbolic sizes) that the backward reads is computed in the forward: the backward then saves an
int, not the tensor whose size it is ([Note: any size, one program] in `fxzero/ir/shapes.py`).

Before::                                   After::

    w = as_strided(unit_0, ...)  # fwd          w = as_strided(unit_0, ...)    # fwd
    wt = t(w)                    # fwd          wt = t(w)                      # fwd
    y = mm(x, wt)                # fwd          y = mm(x, wt)                  # fwd
    gx = mm(g, t(wt))            # bwd          w_1 = as_strided(unit_0, ...)  # bwd (recomputed)
                                                wt_1 = t(w_1)                  # bwd
                                                gx = mm(g, t(wt_1))            # bwd
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from fxzero.config.notices import warn_ineffective
from fxzero.ir.alias import alias_root, alias_source
from fxzero.ir.rng import STATE_BYTES, replay, rng_state
from fxzero.ir.sizes import is_fused_attention, nbytes
from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, kind, output_node, phase, positions, tag
from fxzero.passes.activation_budget import plan_recompute
from fxzero.passes.recompute_cut import selective_cut
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.streaming import compute_seconds

REQUIRES = frozenset({"units_partitioned"})
PROVIDES = frozenset({"phases"})


def _forward_roots(graph: fx.Graph, ctx: PassContext) -> list[fx.Node]:
    """The joint outputs that belong to the forward: model outputs and new buffer values."""
    sig = ctx.signature
    results = list(output_node(graph).args[0])
    fwd = results[: sig.num_outputs] + sig.new_buffer_results(results, len(sig.trainable_fqns))
    return [r for r in fwd if isinstance(r, fx.Node)]


def _forward_set(graph: fx.Graph, ctx: PassContext) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = _forward_roots(graph, ctx)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    # Every element of a forward op's multi-output (a norm's mean and rstd) is a forward value:
    # the backward then saves just the elements it reads, not the whole tuple.
    for n in list(seen):
        seen.update(u for u in n.users if u.target is operator.getitem)
    return seen


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _param_only(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """True if node's value is a deterministic function of unit placeholders only (no inputs,
    buffers, grads, and no random op such as dropout's mask: recomputing that would draw anew)."""
    if node in memo:
        return memo[node]
    if node.op == "placeholder":
        result = is_kind(node, "unit")
    elif node.op == "call_function":
        inputs = node.all_input_nodes
        result = bool(inputs) and not _is_random(node) and all(_param_only(i, memo) for i in inputs)
    else:
        result = False
    memo[node] = result
    return result


def _is_size(node: fx.Node) -> bool:
    """A node that computes a size, not a tensor (its traced value is a SymInt, or an int)."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), (int, torch.SymInt))


def _sizes_into_forward(graph: fx.Graph) -> int:
    """Backward sizes of forward values become forward nodes, each right after the value it reads
    (so that value is not kept alive to the forward's end for it). Returns how many moved."""
    moved = 0
    for node in list(graph.nodes):  # (in graph order: a size computed from sizes follows them)
        if not (phase(node) == BACKWARD and _is_size(node) and node.all_input_nodes
                and all(phase(i) == FORWARD for i in node.all_input_nodes)):
            continue
        tag(node, phase=FORWARD)
        order = positions(graph)
        anchor = max(node.all_input_nodes, key=order.__getitem__)
        if anchor.op == "placeholder":  # after the last placeholder, where the program's code starts
            anchor = max((n for n in graph.nodes if n.op == "placeholder"), key=order.__getitem__)
        anchor.append(node)
        moved += 1
    return moved


_SCOPE = "fxzero_scope"


def _sink_backward_views(graph: fx.Graph) -> int:
    """Every backward view of a forward value (a `detach` autograd took of a tensor it saved) moves
    to just before its first reader. The trace leaves such views where the forward made the
    tensor, so the backward program would start with them, and a value a recompute region
    rebuilds for one of them would be recomputed there, every unit's at the backward's start,
    all alive at once (what recomputing is to avoid); views move no data. Returns how many moved."""
    moved = 0
    for n in reversed([n for n in graph.nodes if n.op == "call_function" and phase(n) == BACKWARD]):
        if kind(n) is None and n.users and alias_source(n) is not None and phase(alias_root(n)) == FORWARD:
            order = positions(graph)
            first = min(n.users, key=order.__getitem__)
            if order[first] > order[n] + 1:
                first.prepend(n)
                moved += 1
    return moved


def _interior(node: fx.Node, memo: dict[fx.Node, bool], keep_attention: bool = False) -> bool:
    """[Note: recomputing a unit] A deterministic forward tensor computed inside a recompute
    region (a unit's module, a torch.utils.checkpoint call: [Note: recompute regions] in
    `fxzero/trace.py`) whose every forward use is inside the same region: the backward recomputes
    it from the region's inputs, a random operator's draw from the generator state kept for it
    ([Note: replaying random operators] in `fxzero/ir/rng.py`). A value that leaves the region
    (the next one's input, an output of the program) is kept, and with `keep_attention` so is
    what a fused attention made (its output, its logsumexp: [Note: keeping attention] in
    `fxzero/config/activations.py`)."""
    if node in memo:
        return memo[node]
    scope = node.meta.get(_SCOPE)
    result = (node.op == "call_function" and scope is not None and phase(node) == FORWARD
              and not _is_size(node) and node.target is not rng_state and not _draw_smaller_than_state(node)
              and not (keep_attention and is_fused_attention(node))
              and all(u.op == "call_function" and (phase(u) == BACKWARD or u.meta.get(_SCOPE) == scope)
                      for u in node.users))
    if result and node.target is operator.getitem:  # (an element of a tuple the unit made: recomputed with it)
        result = _interior(node.args[0], memo, keep_attention)
    memo[node] = result
    return result


def _draw_smaller_than_state(node: fx.Node) -> bool:
    """A random operator whose draw takes fewer bytes than the generator state replaying it would
    (a tiny dropout on the CPU, whose state is 5056 bytes): keeping the draw is cheaper."""
    if not _is_random(node):
        return False
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) else val
    device = first.device.type if isinstance(first, torch.Tensor) else "cpu"
    return nbytes(val) <= STATE_BYTES.get(device, 16)


def _state_before(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """The forward node keeping the generator state `node` draws from ([Note: replaying random
    operators] in `fxzero/ir/rng.py`): right before it, reading its inputs, in its region."""
    with graph.inserting_before(node):
        state = graph.call_function(rng_state, tuple(node.args), {"device": node.kwargs.get("device")})
    val = node.meta.get("val")
    device = (val[0] if isinstance(val, (tuple, list)) else val).device.type if val is not None else "cpu"
    state.meta.update({"val": torch.empty(STATE_BYTES.get(device, 16), dtype=torch.uint8),
                       _SCOPE: node.meta.get(_SCOPE)})
    tag(state, phase=FORWARD)
    return state


def _can_recompute(node: fx.Node, memo: dict[fx.Node, bool], interior: dict[fx.Node, bool],
                   keep_attention: bool = False) -> bool:
    if node.op != "call_function":
        return False
    return _param_only(node, memo) or _interior(node, interior, keep_attention)


def separate_phases_pass(gm: fx.GraphModule, ctx: PassContext, recompute: str = "unit", budget: int | None = None,
                         cost_model=None, tier: str | None = None, may_recompute: bool = True,
                         keep_attention: bool = False) -> PassResult:
    """`recompute`: how a recompute region's interior is recomputed: "unit", all of it (but, with
    `keep_attention`, what a fused attention made); "selective",
    what a minimum cut chooses ([Note: selective recompute] in `fxzero/passes/recompute_cut.py`);
    with `budget`, what the planner chooses for that many bytes, priced by `cost_model`, `tier`
    where it may offload the rest ([Note: planning activations under a budget]). A program
    without regions recomputes only values derived from parameters, whatever it says."""
    graph = gm.graph
    forward = _forward_set(graph, ctx)
    for node in graph.nodes:
        if node.op == "placeholder":
            tag(node, phase=BACKWARD if is_kind(node, "grad_output") else FORWARD)
        elif node.op != "output":
            tag(node, phase=FORWARD if node in forward else BACKWARD)
    sizes_moved = _sizes_into_forward(graph)

    # (Only where a region or a budget recomputes: a program that recomputes parameter views
    # alone keeps the order the trace gave it.)
    views_sunk = _sink_backward_views(graph) if budget is not None or recompute == "selective" or any(
        _SCOPE in n.meta for n in graph.nodes) else 0

    memo: dict[fx.Node, bool] = {}
    interior: dict[fx.Node, bool] = {}
    clones: dict[fx.Node, fx.Node] = {}
    recomputed = 0

    def recomputable(node: fx.Node) -> bool:
        return _can_recompute(node, memo, interior, keep_attention)

    cut = None
    if budget is not None:  # ([Note: planning activations under a budget] in activation_budget.py)
        on_cpu = all(v.device.type == "cpu" for v in (n.meta.get("val") for n in graph.nodes)
                     if isinstance(v, torch.Tensor))
        cut = plan_recompute(graph, budget=budget, seconds=compute_seconds(graph, {lay.name: lay for lay in ctx.layouts},
                                                                           cost_model),
                             tier=None if tier == "cpu" and on_cpu else tier, cost_model=cost_model,
                             may_recompute=may_recompute,
                             interior=lambda n: _interior(n, interior), param_only=lambda n: _param_only(n, memo))
    elif recompute == "selective":
        cut = selective_cut(graph, lambda n: _interior(n, interior), lambda n: _param_only(n, memo))
    if cut is not None:
        def recomputable(node: fx.Node) -> bool:  # noqa: F811 (the cut's choice replaces the unit rule)
            return node.op == "call_function" and (_param_only(node, memo) or node in cut.recomputed)

    def backward_copy(node: fx.Node, before: fx.Node) -> fx.Node:
        nonlocal recomputed
        if node.op == "placeholder" or phase(node) == BACKWARD or not recomputable(node):
            return node  # (a value the forward keeps for the backward)
        if node not in clones:
            args = {i: backward_copy(i, before) for i in node.all_input_nodes}
            with graph.inserting_before(before):
                clone = graph.node_copy(node, lambda n: args[n])
            if _is_random(node):  # (drawn again from the state the forward drew from)
                clone.target, clone.args = replay, (_state_before(graph, node), node.target, *clone.args)
            clone.meta = {**node.meta, "fxzero": {**node.meta.get("fxzero", {}), "phase": BACKWARD}}
            clones[node] = clone
            recomputed += 1
        return clones[node]

    for node in list(graph.nodes):
        if node.op == "output" or phase(node) != BACKWARD:
            continue
        for inp in node.all_input_nodes:
            if phase(inp) == FORWARD and recomputable(inp):
                node.replace_input_with(inp, backward_copy(inp, node))

    graph.eliminate_dead_code()
    n_fwd = sum(1 for n in graph.nodes if phase(n) == FORWARD)
    summary = {"forward_nodes": n_fwd, "recomputed_in_backward": recomputed, "sizes_from_forward": sizes_moved,
               "views_sunk": views_sunk}
    if keep_attention:
        kept = sum(1 for n in graph.nodes if phase(n) == FORWARD and n.meta.get(_SCOPE) is not None
                   and is_fused_attention(n))
        summary["attention_kept"] = kept
        if not kept:
            warn_ineffective(["Activations(keep_attention=True) has no effect on this model: no recompute region "
                              "computes a fused attention (torch.nn.functional.scaled_dot_product_attention) whose "
                              "outputs it could keep; leave keep_attention unset"])
    if cut is not None:
        summary.update(cut.summary())
    return PassResult(gm, changed=True, summary=summary)


PASS = Pass("separate_phases", separate_phases_pass, requires=REQUIRES, provides=PROVIDES)


def make(recompute: str = "none", budget: int | None = None, cost_model=None, tier: str | None = None,
         may_recompute: bool = True, keep_attention: bool = False) -> Pass:
    """The pass for an `Activations(recompute=..., memory_budget=..., keep_attention=...)` policy."""
    if recompute != "selective" and budget is None and not keep_attention:
        return PASS
    return Pass("separate_phases", functools.partial(separate_phases_pass, recompute=recompute, budget=budget,
                                                     cost_model=cost_model, tier=tier, may_recompute=may_recompute,
                                                     keep_attention=keep_attention),
                requires=REQUIRES, provides=PROVIDES)

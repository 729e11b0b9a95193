"""split: cut the joint graph into a forward program and a backward program.

Before (one joint graph, nodes tagged forward/backward)::

    unit_0, bn_mean, x, g = placeholders
    ...forward nodes...   ...backward nodes (use g and some forward values)...
    return [out, gshard_0, new_bn_mean]

After (two GraphModules, recorded in ctx.programs)::

    forward(unit_0, ..., bn_mean, ..., x, ...)  -> [out, new_bn_mean, *saved]
    backward(unit_0, ..., *saved, g, ...)       -> [gshard_0, ..., *input_grads]

Saved values are forward values the backward reads. Parameter-derived values were already
recomputed in the backward (separate_phases), and every gathered buffer is freed inside its
phase (insert_gather_free), so no gathered parameter is saved (the pass checks this) except a
whole buffer the prefetch pass kept for the backward (tagged `kept`), which the backward frees.
"""

from __future__ import annotations

import torch.fx as fx

from fxzero.ir.alias import alias_root
from fxzero.ir.program import Program
from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, output_node, phase
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"phases", "grads_reduced"})
PROVIDES = frozenset({"split"})


def _input_key(node: fx.Node) -> tuple[str, str]:
    t = node.meta["fxzero"]
    k = t["kind"]
    return (k, t.get("unit") or t.get("fqn") if k in ("unit", "buffer") else t["index"])


def _build(name: str, joint: fx.Graph, nodes: list[fx.Node], inputs: list[fx.Node],
           results: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output([env[r] if isinstance(r, fx.Node) else r for r in results])
    graph.lint()
    return fx.GraphModule({}, graph, class_name=f"{name}_program")


def split_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    joint = gm.graph
    sig = ctx.signature
    grad_units = ctx.outputs["grad_units"]
    results = list(output_node(joint).args[0])
    n_out, n_grads = sig.num_outputs, len(grad_units)
    model_outputs = results[:n_out]
    grad_shards = results[n_out : n_out + n_grads]
    new_buffers = sig.new_buffer_results(results, n_grads)
    input_grads = sig.input_grad_results(results)  # ([Note: inputs that require grad])

    placeholders = [n for n in joint.nodes if n.op == "placeholder"]
    units = [n for n in placeholders if is_kind(n, "unit")]
    fwd_inputs = [n for n in placeholders if is_kind(n, "unit", "buffer", "input")]
    grad_outputs = [n for n in placeholders if is_kind(n, "grad_output")]
    fwd_nodes = [n for n in joint.nodes if n.op == "call_function" and phase(n) == FORWARD]
    bwd_nodes = [n for n in joint.nodes if n.op == "call_function" and phase(n) == BACKWARD]

    bwd_set = set(bwd_nodes)
    saved = [
        n
        for n in [*fwd_inputs, *fwd_nodes]
        if not is_kind(n, "unit") and any(u in bwd_set for u in n.users)
    ]
    for n in saved:
        root = alias_root(n)
        receipt = is_kind(root, "wait") and is_kind(root.args[0], "offload")  # (an activation's, on its tier)
        assert n.meta.get("fxzero", {}).get("kept") or receipt or not is_kind(root, "wait", "unit"), (
            f"internal error: forward value {n.name} aliases gathered parameters "
            f"({root.name}) and would be saved for backward"
        )

    fwd = _build("forward", joint, fwd_nodes, fwd_inputs, [*model_outputs, *new_buffers, *saved])
    bwd = _build("backward", joint, bwd_nodes, [*units, *saved, *grad_outputs], [*grad_shards, *input_grads])
    ctx.programs["forward"] = Program(
        "forward",
        fwd,
        inputs=[_input_key(n) for n in fwd_inputs],
        outputs=[("output", i) for i in range(n_out)]
        + [("buffer", f) for f in sig.mutated_buffers]
        + [("saved", n.name) for n in saved],
    )
    ctx.programs["backward"] = Program(
        "backward",
        bwd,
        inputs=[_input_key(n) for n in units]
        + [("saved", n.name) for n in saved]
        + [_input_key(n) for n in grad_outputs],
        outputs=[("grad", u) for u in grad_units] + [("input_grad", i) for i in sig.input_grads],
    )
    return PassResult(
        gm,
        changed=True,
        summary={"forward_nodes": len(fwd_nodes), "backward_nodes": len(bwd_nodes), "saved": len(saved)},
    )


PASS = Pass("split", split_pass, requires=REQUIRES, provides=PROVIDES)

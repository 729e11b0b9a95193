"""check_gradients: float16 loss scaling needs to know whether any gradient overflowed.

After each unit's gradient shard is reduced (and before it is written to a tier, if it is), one
node records whether it is finite::

    g = wait(reduce_scatter(flat, "u", ...))
    t = check_finite(g, "u")          # the runtime ORs "not finite" into this step's flag
    ... offload(g, "u", "grad") ...

The step reduces that one flag over the ranks before anything is updated and skips the step on
every rank if any gradient anywhere overflowed ([Note: one flag per step] in
`fxzero/runtime/loss_scale.py`). The check runs where the gradient already is, while the
backward goes on, so gradients on a tier are checked without being read back. It is placed after
`prefetch` has placed the reduce-scatters' waits (a wait with a reader is not moved).
"""

from __future__ import annotations

import torch.fx as fx

from fxzero.ir.ops import OPS
from fxzero.ir.tags import BACKWARD, is_kind, output_node, tag
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"grads_reduced"})
PROVIDES = frozenset({"grads_checked"})


def check_gradients_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    checked = 0
    for r in list(output_node(graph).args[0]):
        if not (isinstance(r, fx.Node) and is_kind(r, "wait") and is_kind(r.args[0], "reduce_scatter")):
            continue
        with graph.inserting_after(r):
            check = graph.call_function(OPS["check_finite"], (r, r.meta["fxzero"]["unit"]))
        tag(check, kind="check", unit=r.meta["fxzero"]["unit"], phase=BACKWARD)
        checked += 1
    return PassResult(gm, changed=checked > 0, summary={"gradients_checked": checked})


PASS = Pass("check_gradients", check_gradients_pass, requires=REQUIRES, provides=PROVIDES)

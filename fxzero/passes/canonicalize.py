"""canonicalize: rewrite ops that are legal in the trace but not always at run time.

Before::                                 After::

    v = aten.view(x, [b, t, h])              v = aten.reshape(x, [b, t, h])

[Note: view strides]
The graph was traced with fake (meta) kernels, whose output strides can differ from the CPU
kernels' (e.g. native_batch_norm_backward), so a view that was legal in the trace may not be
legal at run time. The graph is functional, so a reshape, which views where it can and copies
where it must, computes the same values. The rewrite happens here, at compile time, so the
program `fxzero schedule` shows is exactly the one that runs.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"phases"})
PROVIDES = frozenset({"canonical"})

_REWRITE = {torch.ops.aten.view.default: torch.ops.aten.reshape.default}


def canonicalize_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _REWRITE:
            node.target = _REWRITE[node.target]
            rewritten += 1
    return PassResult(gm, changed=rewritten > 0, summary={"view_to_reshape": rewritten})


PASS = Pass("canonicalize", canonicalize_pass, requires=REQUIRES, provides=PROVIDES)

"""choose_collectives: realize each reduce-scatter the fastest way the cost model knows.

Before::                                   After (when the model says all-reduce is faster)::

    rs = reduce_scatter(flat, "u0", ...)       rs = reduce_scatter(flat, "u0", ...)  # algorithm="all_reduce"

Gloo has no native reduce-scatter (it emulates one), and on loopback an all-reduce of the flat
gradient followed by taking this rank's slice can be faster. The node's `algorithm` tag records
the choice, the schedule shows it, and the runtime carries it out; the logical collective, its
traffic accounting and its place in the program do not change. Without a cost model nothing is
chosen and the native reduce-scatter runs.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch.fx as fx

from fxzero.ir.sizes import itemsize_of
from fxzero.ir.tags import is_kind, tag
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES = frozenset({"grads_reduced"})
PROVIDES = frozenset({"collectives_chosen"})


MARGIN = 0.9
"""All-reduce is chosen only when the model prices it under 0.9 x the native reduce-scatter: a
calibration's timings vary by about that much between runs, and the native one moves half the
bytes (with shared-memory collectives it is the faster by far)."""


def _choice(cost: Any, nbytes: int, world_size: int) -> str:
    native = cost.collective_seconds("reduce_scatter", nbytes, world_size)
    via_all_reduce = cost.collective_seconds("all_reduce", nbytes, world_size)
    return "all_reduce" if via_all_reduce < MARGIN * native else "reduce_scatter"


def choose_collectives_pass(gm: fx.GraphModule, ctx: PassContext, *, cost_model: Optional[Any]) -> PassResult:
    if cost_model is None or ctx.world_size == 1:
        return PassResult(gm, changed=False)
    chosen = {"reduce_scatter": 0, "all_reduce": 0}
    for node in gm.graph.nodes:
        if not is_kind(node, "reduce_scatter"):
            continue
        layout = ctx.layout(node.meta["fxzero"]["unit"])
        algorithm = _choice(cost_model, layout.padded_numel * itemsize_of(node.args[0], layout.itemsize), ctx.world_size)
        tag(node, algorithm=algorithm)
        chosen[algorithm] += 1
    return PassResult(gm, changed=chosen["all_reduce"] > 0, summary={f"via_{k}": v for k, v in chosen.items()})


def make(*, cost_model: Optional[Any]) -> Pass:
    return Pass(
        "choose_collectives",
        functools.partial(choose_collectives_pass, cost_model=cost_model),
        requires=REQUIRES,
        provides=PROVIDES,
    )

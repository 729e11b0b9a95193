"""partition: replace per-parameter placeholders by one flat buffer per unit.

Before::

    p_w = placeholder[param blocks.0.w]     p_b = placeholder[param blocks.0.b]
    y = addmm(p_b, x, t(p_w))

After::

    unit_blocks_0 = placeholder[unit blocks.0]           # flat, padded to a multiple of world
    p_w = as_strided(unit_blocks_0, (o, i), (i, 1), 0)   # param_view
    p_b = as_strided(unit_blocks_0, (o,), (1,), o*i)     # param_view
    y = addmm(p_b, x, t(p_w))

The unit placeholder stands for the unit's full flat buffer. Whether it is held sharded
(ZeRO-3: gathered before use by insert_gather_free) or whole for the whole step (ZeRO-1/2, and
small units under the persistence threshold) is recorded on it as `sharded`: that node is where
the persistence decision is visible. The pass itself is the same for every stage.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.fx as fx

from fxzero.ir.tags import is_kind, positions, tag
from fxzero.passes.runner import Pass, PassContext, PassResult

REQUIRES: frozenset[str] = frozenset()
PROVIDES = frozenset({"units_partitioned"})


def _is_param_placeholder(node: fx.Node) -> bool:
    return node.op == "placeholder" and is_kind(node, "param")


def unit_placeholder_name(unit: str) -> str:
    return "unit_" + re.sub(r"\W", "_", unit)


def _contiguous_stride(shape: tuple[int, ...]) -> list[int]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return list(reversed(stride))


def _plan(gm: fx.GraphModule, ctx: PassContext) -> dict[tuple[str, int], list[fx.Node]]:
    """Map each parameter (FQN, first element: a tile's, [Note: tiling] in `passes/tile.py`) to its
    placeholders (a tile has one per operator reading it), checking the layouts cover them exactly."""
    by_fqn: dict[tuple[str, int], list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if _is_param_placeholder(n):
            by_fqn.setdefault((n.meta["fxzero"]["fqn"], n.meta["fxzero"].get("start", 0)), []).append(n)
    in_layouts = {(s.fqn, s.start) for layout in ctx.layouts for s in layout.slots}
    if set(by_fqn) != in_layouts:
        missing, extra = sorted(set(by_fqn) - in_layouts), sorted(in_layouts - set(by_fqn))
        raise ValueError(
            f"unit layouts do not match the traced parameters (not in any unit: {missing}; "
            f"not in the graph: {extra}); plan units and trace from the same model"
        )
    return by_fqn


def partition_pass(gm: fx.GraphModule, ctx: PassContext, *, persistent: frozenset[str]) -> PassResult:
    """Give every unit one flat placeholder and turn parameters into views of it.

    Args:
        persistent: units held whole for the whole step; the others are held as shards.
    """
    graph = gm.graph
    by_fqn = _plan(gm, ctx)
    if not by_fqn:
        return PassResult(gm, changed=False)
    first = next(n for n in graph.nodes if n.op == "placeholder")
    unit_nodes = []
    for layout in ctx.layouts:
        with graph.inserting_before(first):
            unit_nodes.append(graph.placeholder(unit_placeholder_name(layout.name)))
    for layout, unit_node in zip(ctx.layouts, unit_nodes):
        tag(unit_node, kind="unit", unit=layout.name, sharded=layout.name not in persistent)
        some_val = by_fqn[layout.slots[0].fqn, layout.slots[0].start][0].meta.get("val")
        if some_val is not None:  # the dtype the graph computes in (mixed precision: not the master's)
            with some_val.fake_mode:
                unit_node.meta["val"] = torch.empty(layout.padded_numel, dtype=some_val.dtype)
        for slot, old in [(s, old) for s in layout.slots for old in by_fqn[s.fqn, s.start]]:
            if old.users:
                # The view goes right before the parameter's first use, so that a gather
                # inserted before it later lands where the unit is first needed.
                pos = positions(graph)
                with graph.inserting_before(min(old.users, key=pos.__getitem__)):
                    view = graph.call_function(
                        torch.ops.aten.as_strided.default,
                        (unit_node, list(slot.shape), _contiguous_stride(slot.shape), slot.offset),
                    )
                view.meta["val"] = old.meta.get("val")
                tag(view, kind="param_view", unit=layout.name, fqn=slot.fqn)
                old.replace_all_uses_with(view)
            graph.erase_node(old)
    summary = {"units": len(ctx.layouts), "params": len(by_fqn), "persistent_units": len(persistent)}
    return PassResult(gm, changed=True, summary=summary)


def make(*, persistent: frozenset[str]) -> Pass:
    return Pass(
        "partition",
        functools.partial(partition_pass, persistent=persistent),
        requires=REQUIRES,
        provides=PROVIDES,
    )

"""Lowering: a node of a program's graph as an `Instruction` (kind, stream, bytes, FLOPs)."""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from fxzero.ir.alias import alias_root, alias_source
from fxzero.ir.instruction import ASYNC, COLLECTIVES, IO, STREAM_OF, Instruction
from fxzero.ir.layout import UnitLayout
from fxzero.ir.sizes import flops, nbytes, value_size
from fxzero.ir.tags import kind

__all__ = ["gathered_root", "instruction_of"]


def gathered_root(node: fx.Node) -> Optional[fx.Node]:
    """The gathered buffer (an all_gather's wait, or one kept from the forward) that node's
    value views, if any."""
    root = alias_root(node)
    if root.meta.get("fxzero", {}).get("kept") == "gathered":  # in the backward: a placeholder
        return root
    if kind(root) == "wait" and root.args and kind(root.args[0]) == "all_gather":
        return root
    return None


def instruction_of(node: fx.Node, layouts: dict[str, UnitLayout]) -> Instruction:
    """The instruction a node of a program becomes (kind, stream, bytes, FLOPs; no deps yet)."""
    meta = node.meta.get("fxzero", {})
    k = meta.get("kind")
    unit = meta.get("unit")
    k = k if k in ("all_gather", "reduce_scatter", "wait", "free", "optim_step", *IO) else "compute"
    touches = sorted({r.name for r in map(gathered_root, node.all_input_nodes) if r is not None})
    algorithm = meta.get("algorithm", "") if k in ASYNC else ""
    if k in COLLECTIVES:
        layout = layouts[unit]
        numel = layout.padded_numel
        size = numel * layout.itemsize
    elif k in IO or k == "optim_step":
        layout = layouts[unit]
        numel = layout.shard_numel
        size = numel * layout.itemsize
    else:
        numel, size = value_size(node.meta.get("val"))
    count = flops(node) if k == "compute" else 0
    read_bytes = sum(nbytes(i.meta.get("val")) for i in node.all_input_nodes) if k == "compute" else 0
    if k == "compute" and alias_source(node) is not None:
        size = read_bytes = 0  # a view moves no data
    return Instruction(
        name=node.name,
        kind=k,
        stream=STREAM_OF.get(k, "compute"),
        reads=tuple(n.name for n in node.all_input_nodes),
        unit=unit if k != "compute" else meta.get("unit"),
        touches=tuple(touches),
        numel=numel,
        bytes=size,
        flops=count,
        read_bytes=read_bytes,
        algorithm=algorithm,
        state=meta.get("state", "") if k in IO else "",
    )

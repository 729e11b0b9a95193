"""Lowering: a node of a program's graph as an `Instruction` (kind, stream, bytes, FLOPs, buffer).

Everything the runtime and the validator need to know about an fxzero:: operator is decided
here, from the node and its neighbours, and written into the instruction's typed fields; after
this nothing reads a node's arguments to find out what kind of buffer it handles.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from fxzero.ir.alias import alias_root, alias_source
from fxzero.ir.instruction import COLLECTIVES, IO, STREAM_OF, Instruction
from fxzero.ir.layout import UnitLayout
from fxzero.ir.ops import OPS
from fxzero.ir.sizes import flops, itemsize_of, nbytes, value_size
from fxzero.ir.tags import is_kind, kind

__all__ = ["buffer_of", "gathered_root", "instruction_of", "is_fetched_shard"]

_KINDS = ("all_gather", "reduce_scatter", "wait", "free", "optim_step", "cast", "check", *IO)
"""Node kinds that lower to an instruction of their own kind; every other node computes."""


def gathered_root(node: fx.Node) -> Optional[fx.Node]:
    """The gathered buffer (an all_gather's wait, or one kept from the forward) that node's
    value views, if any."""
    root = alias_root(node)
    if root.meta.get("fxzero", {}).get("kept") == "gathered":  # in the backward: a placeholder
        return root
    if kind(root) == "wait" and root.args and kind(root.args[0]) == "all_gather" and buffer_of(root) == "gathered":
        return root
    return None


def is_fetched_shard(node: fx.Node) -> bool:
    """Whether `node` is a state shard read from a tier: a fetch's wait, or, in the backward, such
    a shard kept from the forward (a placeholder)."""
    if node.meta.get("fxzero", {}).get("kept") == "fetched":
        return True
    return kind(node) == "wait" and bool(node.args) and isinstance(node.args[0], fx.Node) and kind(node.args[0]) == "fetch"


def buffer_of(node: fx.Node) -> str:
    """What buffer an fxzero node makes, waits for, frees or updates (see `BUFFERS`)."""
    k = kind(node)
    if k == "all_gather":
        return "persistent" if node.target is OPS["all_gather_into"] else "gathered"
    if k == "fetch":
        return "fetched"
    if k == "reduce_scatter":
        return "grad_shard"
    if k == "offload":
        return "token"
    if k == "wait":
        src = node.args[0]
        return buffer_of(src) if src.op == "call_function" else "grad_shard"  # a gradient carried in
    if k == "free":
        return "fetched" if is_fetched_shard(node.args[0]) else "gathered"
    if k in ("optim_step", "cast"):  # what they update: a shard, or a unit's whole buffer
        param = alias_root(node.args[0])
        whole = param.op == "placeholder" and is_kind(param, "unit") and not param.meta["fxzero"].get("sharded", True)
        return "persistent" if whole else ""
    if node.op == "call_function" and node.target is OPS["flatten_grads"]:
        return "flat_grad"
    return ""


def _holds_tensors(val: Any) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_holds_tensors(v) for v in val)
    return val is None or isinstance(val, torch.Tensor)


def _dtype(node: fx.Node, layout: Optional[UnitLayout]) -> str:
    if kind(node) == "fetch":
        return str(node.args[3]).removeprefix("torch.")
    val: Any = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return str(val.dtype).removeprefix("torch.")
    return str(layout.dtype).removeprefix("torch.") if layout is not None else ""


def instruction_of(node: fx.Node, layouts: dict[str, UnitLayout]) -> Instruction:
    """The instruction a node of a program becomes (kind, stream, bytes, FLOPs; no deps yet)."""
    meta = node.meta.get("fxzero", {})
    k = meta.get("kind")
    unit = meta.get("unit")
    k = k if k in _KINDS else "compute"
    touches = sorted({r.name for r in map(gathered_root, node.all_input_nodes) if r is not None})
    layout = layouts.get(unit) if unit is not None else None
    if k in COLLECTIVES:
        # The buffer's own dtype: mixed precision gathers in the compute dtype and reduces in the
        # reduce dtype, whatever the master's (the layout's) is.
        numel = layout.padded_numel
        size = numel * itemsize_of(node.args[0], layout.itemsize)  # its operand: the shard, the flat gradient
    elif k in IO and meta.get("state") == "activation":  # a saved activation: its own size, no layout's
        numel, size = value_size((node if k == "fetch" else node.args[0]).meta.get("val"))
    elif k in IO:
        numel = layout.shard_numel
        moved = node if k == "fetch" else node.args[0]
        size = numel * (node.args[3].itemsize if k == "fetch" else itemsize_of(moved, layout.itemsize))
    elif k == "optim_step":
        numel = layout.shard_numel
        size = numel * layout.itemsize
    elif k == "cast":  # reads this rank's master shard, writes its low-precision copy
        numel = layout.shard_numel
        size = numel * itemsize_of(node.args[0], layout.itemsize)
    else:
        numel, size = value_size(node.meta.get("val"))
    count = flops(node) if k == "compute" else 0
    read_bytes = sum(nbytes(i.meta.get("val")) for i in node.all_input_nodes) if k == "compute" else 0
    if k == "cast":
        read_bytes = numel * itemsize_of(node.args[1], layout.itemsize)
    if k == "check":  # reads the gradient shard once
        numel, size = 0, 0
        read_bytes = nbytes(node.args[0].meta.get("val"))
    if k == "compute" and alias_source(node) is not None:
        size = read_bytes = 0  # a view moves no data
    if k == "compute" and not _holds_tensors(node.meta.get("val")):
        read_bytes = 0  # a size (aten.sym_size of a symbolic program) reads no data, only metadata
    scatter = k == "reduce_scatter"
    return Instruction(
        name=node.name,
        kind=k,
        stream=STREAM_OF.get(k, "compute"),
        reads=tuple(n.name for n in node.all_input_nodes),
        unit=unit,
        touches=tuple(touches),
        numel=numel,
        bytes=size,
        flops=count,
        read_bytes=read_bytes,
        algorithm=meta.get("algorithm", "") if k in COLLECTIVES else "",
        tier=meta.get("tier", "") if k in IO else "",
        state=meta.get("state", "") if k in IO else "",
        buffer=buffer_of(node) if k != "compute" or node.target is OPS["flatten_grads"] else "",
        keep_full=bool(node.args[3]) if scatter else False,
        aligned=scatter and any(is_kind(u, "offload") for w in node.users for u in w.users),
        dtype=_dtype(node.args[0] if k in ("cast", *COLLECTIVES) else node, layout),
    )

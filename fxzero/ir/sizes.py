"""Sizes: elements and bytes of traced values, FLOPs of ATen nodes, rounding to a multiple."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from fxzero._compat import pytree

__all__ = ["flops", "itemsize_of", "nbytes", "round_up", "value_size"]


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def value_size(val: Any) -> tuple[int, int]:
    """(elements, bytes) of a traced value: a tensor, or a list or tuple of them (else 0, 0)."""
    if isinstance(val, torch.Tensor):
        return val.numel(), val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        parts = [value_size(v) for v in val]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    return 0, 0


def nbytes(val: Any) -> int:
    """Bytes of a traced value (see `value_size`)."""
    return value_size(val)[1]


def itemsize_of(node: Any, default: int) -> int:
    """Bytes per element of a node's traced value (a buffer's dtype), else `default` (e.g. the
    unit layout's: nodes a pass inserted without a traced value)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.element_size() if isinstance(val, torch.Tensor) else default


def flops(node: fx.Node) -> int:
    """FLOPs of an ATen node by torch's own formulas (matmuls, convolutions, attention)."""
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args, kwargs = pytree.tree_map(val, (node.args, node.kwargs))
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that cannot read these arguments: count nothing, never fail
        return 0

"""Aliasing: which nodes' values are views of another node's storage.

Views are ATen ops whose schema says the result aliases an input (view, t, as_strided,
split, reshape, ...); `getitem` of such a multi-output view is a view too. Every question about
"which buffer does this value live in" walks `alias_source` to its root, here and only here.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch.fx as fx

from fxzero._compat import OpOverload

__all__ = ["alias_closure", "alias_root", "alias_source", "mutated_args"]


def _returns_alias(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def alias_source(node: fx.Node) -> Optional[fx.Node]:
    """The node whose storage `node`'s value views, or None if it owns its storage."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        src = node.args[0]
        return src if isinstance(src, fx.Node) and alias_source(src) is not None else None
    if isinstance(node.target, OpOverload) and _returns_alias(node.target):
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    return None


def alias_root(node: fx.Node) -> fx.Node:
    """The node that owns the storage `node`'s value lives in (`node` itself if not a view)."""
    while (src := alias_source(node)) is not None:
        node = src
    return node


def alias_closure(root: fx.Node) -> list[fx.Node]:
    """`root` and every node whose value views root's storage, transitively."""
    closure, frontier = [root], [root]
    while frontier:
        n = frontier.pop()
        for user in n.users:
            if alias_source(user) is n:
                closure.append(user)
                frontier.append(user)
    return closure


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The arguments an operator changes in place, as its schema declares them (`Tensor(a!)`, or
    each tensor of a `Tensor(a!)[]`)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return []
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            values = value if isinstance(value, (list, tuple)) else [value]  # `Tensor(a!)[]`: each one
            out += [v for v in values if isinstance(v, fx.Node)]
    return out

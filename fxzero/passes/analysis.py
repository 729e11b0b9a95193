"""Graph analyses shared by the passes: tags, aliasing, phases, positions.

Pure functions over an FX graph; the only state they write is `node.meta["fxzero"]`.
"""

from __future__ import annotations

import operator
from typing import Iterable, Optional

import torch
import torch.fx as fx

__all__ = [
    "alias_closure",
    "alias_source",
    "is_kind",
    "kind",
    "last_user",
    "output_node",
    "phase",
    "positions",
    "tag",
]

FORWARD, BACKWARD = "forward", "backward"


def tag(node: fx.Node, **fields) -> fx.Node:
    node.meta.setdefault("fxzero", {}).update(fields)
    return node


def kind(node: fx.Node) -> Optional[str]:
    return node.meta.get("fxzero", {}).get("kind")


def is_kind(node: fx.Node, *kinds: str) -> bool:
    return kind(node) in kinds


def phase(node: fx.Node) -> Optional[str]:
    return node.meta.get("fxzero", {}).get("phase")


def output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _returns_alias(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def alias_source(node: fx.Node) -> Optional[fx.Node]:
    """The node whose storage `node`'s value views, or None if it owns its storage.

    Views are ATen ops whose schema says the result aliases an input (view, t, as_strided,
    split, ...); `getitem` of such a multi-output view is a view too.
    """
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        src = node.args[0]
        return src if isinstance(src, fx.Node) and alias_source(src) is not None else None
    if isinstance(node.target, torch._ops.OpOverload) and _returns_alias(node.target):
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    return None


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


def last_user(nodes: Iterable[fx.Node], pos: dict[fx.Node, int]) -> Optional[fx.Node]:
    """The latest node (in graph order) that uses any of `nodes`."""
    users = [u for n in nodes for u in n.users]
    return max(users, key=pos.__getitem__) if users else None

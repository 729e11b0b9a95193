"""Node tags: what each node of an fxzero graph is, in `node.meta["fxzero"]`.

Every node a pass adds, and every placeholder the trace makes, carries a tag dict with at least
`kind` (one of `NodeKind`) and, for per-unit nodes, `unit`; after `separate_phases` every node
also has `phase`. These helpers read and write those tags; nothing else in a node's meta is
fxzero's.
"""

from __future__ import annotations

from typing import Iterable, Literal, Optional

import torch.fx as fx

__all__ = [
    "BACKWARD",
    "FORWARD",
    "STEP",
    "NodeKind",
    "Phase",
    "is_kind",
    "kind",
    "last_user",
    "output_node",
    "phase",
    "positions",
    "tag",
    "wait_of",
]

NodeKind = Literal[
    # placeholders from the trace
    "param", "buffer", "input", "grad_output",
    # placeholders and views after `partition`
    "unit", "param_view",
    # the fxzero:: operators
    "all_gather", "reduce_scatter", "wait", "free", "flatten_grads", "fetch", "offload", "optim_step",
    # placeholders of the step program: a unit's gradient and its resident AdamW moments
    "grad", "optim_state",
    # everything else an ATen op computes
    "compute",
]
Phase = Literal["forward", "backward", "step"]

FORWARD, BACKWARD, STEP = "forward", "backward", "step"


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


def last_user(nodes: Iterable[fx.Node], pos: dict[fx.Node, int]) -> Optional[fx.Node]:
    """The latest node (in graph order) that uses any of `nodes`."""
    users = [u for n in nodes for u in n.users]
    return max(users, key=pos.__getitem__) if users else None


def wait_of(start: fx.Node) -> fx.Node:
    """The `wait` of an asynchronous node (a collective, a fetch, an offload): its one reader
    of kind wait (IR rule 2)."""
    (wait,) = [u for u in start.users if is_kind(u, "wait")]
    return wait

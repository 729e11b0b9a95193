"""`Program`: one executable graph of a compiled model and what its flat inputs and outputs are."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

__all__ = ["Program"]


@dataclasses.dataclass
class Program:
    """One executable program: its graph and what its flat inputs and outputs are."""

    name: str
    gm: fx.GraphModule
    inputs: list[tuple[str, str]]
    """Per placeholder, in order: (kind, key): ("unit", name), ("buffer", fqn), ("input", i),
    ("saved", node name), ("grad_output", i)."""
    outputs: list[tuple[str, str]]
    """Per output, in order: ("output", i), ("buffer", fqn), ("saved", node name), ("grad", unit)."""

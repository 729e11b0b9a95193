"""Flat layouts: where each parameter of a unit lives in its flat buffer, and each rank's shard.

A unit is the granularity of sharding (FSDP's "wrapping"): its parameters live in one flat
buffer, padded to a multiple of the world size; rank r holds slice r. The layout depends only
on the grouping (`fxzero.units.plan_units`) and the world size, so every rank computes the same
one without talking to the others. Compiler and runtime share these types.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch
import torch.nn as nn

from fxzero.ir.sizes import round_up

__all__ = ["ParamSlot", "UnitLayout", "unique_parameters"]


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter, or a tile of one, lives inside its unit's flat buffer."""

    fqn: str
    shape: tuple[int, ...]
    """What this slot holds: the parameter's shape, or its tile's (some rows)."""
    offset: int
    numel: int
    start: int = 0
    """The first element of the parameter (flattened) this slot holds: 0 but for a tile."""
    param_shape: Optional[tuple[int, ...]] = None
    """The whole parameter's shape where this slot holds a tile of its rows (each tile its own
    unit: [Note: tiling] in `fxzero/passes/tile.py`); None where it holds all of it."""

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The parameter's shape as the user sees it."""
        return self.shape if self.param_shape is None else self.param_shape

    def read_into(self, flat: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Copy this slot's elements of its unit's whole flat buffer `flat` into `values[fqn]`, a new
        tensor of the parameter's full shape (a tile fills its rows of it: the first tile read
        allocates it); returns `values[fqn]`."""
        part = flat[self.offset : self.offset + self.numel]
        if self.param_shape is None:
            values[self.fqn] = part.view(self.shape).clone()
        else:
            whole = values.get(self.fqn)
            if whole is None:
                whole = values[self.fqn] = part.new_empty(self.param_shape)
            whole.view(-1)[self.start : self.start + self.numel].copy_(part)
        return values[self.fqn]


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """One unit's flat buffer: which parameters, where, and how it is split across ranks."""

    name: str
    slots: tuple[ParamSlot, ...]
    dtype: torch.dtype
    world_size: int
    trainable: bool
    """False for units of frozen parameters: gathered, never reduced, no optimizer state."""

    @property
    def numel(self) -> int:
        """Parameter elements, without padding."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        """Length of the flat buffer: numel rounded up to a multiple of the world size."""
        return round_up(self.numel, self.world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's slice in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_ranges(self, rank: int, skip: frozenset[str] = frozenset()) -> list[tuple[int, int]]:
        """[lo, hi) ranges, relative to rank's shard, covered by parameters not in `skip`.

        Padding is never covered; adjacent ranges are merged.
        """
        return [(a, b) for a, b, _ in self.grouped_shard_ranges(rank, {}, skip)]

    def grouped_shard_ranges(self, rank: int, group_of: Mapping[str, int],
                             skip: frozenset[str] = frozenset()) -> list[tuple[int, int, int]]:
        """(lo, hi, group) ranges, relative to rank's shard, covered by parameters not in `skip`,
        each parameter in group `group_of.get(fqn, 0)` (an optimizer's param groups); padding is
        never covered, adjacent ranges of one group are merged."""
        lo, hi = self.shard_range(rank)
        out: list[tuple[int, int, int]] = []
        for s in self.slots:
            if s.fqn in skip:
                continue
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a >= b:
                continue
            g = group_of.get(s.fqn, 0)
            if out and out[-1][1] == a - lo and out[-1][2] == g:
                out[-1] = (out[-1][0], b - lo, g)
            else:
                out.append((a - lo, b - lo, g))
        return out

    def param_shard_ranges(self, rank: int, group_of: Mapping[str, int],
                           skip: frozenset[str] = frozenset()) -> list[tuple[int, int, int, int]]:
        """(lo, hi, group, slot) per parameter not in `skip` with elements in rank's shard: its
        range relative to the shard, its param group (as `grouped_shard_ranges`) and its index in
        `slots`; never merged, so an update can sum over each parameter's own elements."""
        lo, hi = self.shard_range(rank)
        out: list[tuple[int, int, int, int]] = []
        for i, s in enumerate(self.slots):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if s.fqn not in skip and a < b:
                out.append((a - lo, b - lo, group_of.get(s.fqn, 0), i))
        return out

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "world_size": self.world_size,
            "trainable": self.trainable,
            "slots": [[s.fqn, list(s.shape), s.offset, s.numel]
                      + ([s.start, list(s.param_shape)] if s.param_shape is not None else []) for s in self.slots],
        }

    @classmethod
    def from_json(cls, d: dict) -> "UnitLayout":
        slots = tuple(ParamSlot(f, tuple(shape), off, n, *([rest[0], tuple(rest[1])] if rest else []))
                      for f, shape, off, n, *rest in d["slots"])
        return cls(d["name"], slots, getattr(torch, d["dtype"]), d["world_size"], d["trainable"])


def unique_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by their first FQN; a tied parameter appears once."""
    return dict(model.named_parameters(remove_duplicate=True))

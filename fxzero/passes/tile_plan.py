"""Which weights `Config.tiling` tiles, and their units: each tile of rows a unit of its own.

The compiler plans units before it traces (`fxzero.compiler.plan_layouts`), so the tiles are
decided from the module tree: every `nn.Linear` and `nn.Embedding` whose weight, in the dtype the
forward gathers, is over `Tiling.max_bytes`. The tile pass (`passes/tile.py`, [Note: tiling])
then rewrites the operators that read each tiled weight, or refuses one it cannot tile.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch.nn as nn

from fxzero.config import Tiling
from fxzero.config.notices import warn_ineffective
from fxzero.ir.layout import ParamSlot, UnitLayout, unique_parameters

__all__ = ["TILE_SUFFIX", "is_tile", "plan_tiles"]

TILE_SUFFIX = ":tile"
"""Tile units are named `<parameter FQN>:tile<i>`."""

_TILED = (nn.Linear, nn.Embedding)
"""The operators tiled: their weight's rows are output features (Linear) or table rows (Embedding)."""


def is_tile(layout: UnitLayout) -> bool:
    """Whether a unit holds one tile of a tiled parameter."""
    return any(s.param_shape is not None for s in layout.slots)


def _describe(module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return f"Embedding {module.num_embeddings} x {module.embedding_dim}"
    return f"Linear {module.in_features} -> {module.out_features}"


def _tiled_weights(model: nn.Module, tiling: Tiling, itemsize: Optional[int]):
    """{unique weight FQN: (operator FQN, module)} of each weight over the bound (a tied weight
    once, under the first operator that reads it), and the largest weight (FQN, bytes)."""
    unique = {id(p): fqn for fqn, p in unique_parameters(model).items()}
    largest, out = ("", 0), {}
    for name, module in model.named_modules():
        if not isinstance(module, _TILED) or id(module.weight) not in unique:
            continue
        fqn = unique[id(module.weight)]
        nbytes = module.weight.numel() * (itemsize or module.weight.dtype.itemsize)
        largest = max(largest, (fqn, nbytes), key=lambda x: x[1])
        if nbytes > tiling.max_bytes:
            out.setdefault(fqn, (name, module))
    return out, largest


def _rows(name: str, module: nn.Module, tiling: Tiling, itemsize: Optional[int]) -> list[tuple[int, int]]:
    rows, cols = module.weight.shape
    row_bytes = cols * (itemsize or module.weight.dtype.itemsize)
    if row_bytes > tiling.tile_bytes:
        raise ValueError(
            f"Tiling(max_bytes={tiling.max_bytes}): operator {name or 'the model'} ({_describe(module)}) "
            f"has rows of {row_bytes} bytes, and a tile is at least one row and at most max_bytes // 2 = "
            f"{tiling.tile_bytes} bytes (the tile computing and the one prefetched share max_bytes): "
            f"set Tiling(max_bytes={2 * row_bytes}) or more")
    per = tiling.tile_bytes // row_bytes
    count = math.ceil(rows / per)
    per = math.ceil(rows / count)  # (even tiles: the same count, the last not left small)
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


def plan_tiles(model: nn.Module, layouts: list[UnitLayout], tiling: Optional[Tiling], *, stage: int,
               itemsize: Optional[int]) -> list[UnitLayout]:
    """The layouts with each tiled weight taken out of its unit and split into tile units of its
    rows, placed right after that unit ([Note: tiling] in `passes/tile.py`).

    Args:
        itemsize: bytes per element of what the forward gathers (mixed precision's compute dtype);
            None: the model's own dtype.

    Raises:
        ValueError: if a weight's row alone is more than a tile may hold.
    """
    if tiling is None:
        return layouts
    if stage != 3:
        warn_ineffective([f"Config.tiling has no effect at stage {stage}: every rank holds whole parameters, "
                          "nothing is gathered per operator; use stage=3"])
        return layouts
    tiles_of, (largest, largest_bytes) = _tiled_weights(model, tiling, itemsize)
    if not tiles_of:
        warn_ineffective([f"Tiling(max_bytes={tiling.max_bytes}) has no effect: no Linear's or Embedding's "
                          "gathered weight is "
                          f"larger (the largest: {largest or 'none'}, {largest_bytes} bytes); lower max_bytes or "
                          "drop Config.tiling"])
        return layouts
    out: list[UnitLayout] = []
    for layout in layouts:
        kept = [s for s in layout.slots if s.fqn not in tiles_of]
        if kept:
            slots, offset = [], 0
            for s in kept:
                slots.append(dataclasses.replace(s, offset=offset))
                offset += s.numel
            out.append(dataclasses.replace(layout, slots=tuple(slots)))
        for s in layout.slots:
            if s.fqn not in tiles_of:
                continue
            name, module = tiles_of[s.fqn]
            cols = math.prod(s.shape[1:])
            for i, (a, b) in enumerate(_rows(name, module, tiling, itemsize)):
                piece = ParamSlot(s.fqn, (b - a, *s.shape[1:]), 0, (b - a) * cols, start=a * cols, param_shape=s.shape)
                out.append(UnitLayout(f"{s.fqn}{TILE_SUFFIX}{i}", (piece,), layout.dtype, layout.world_size,
                                      layout.trainable))
    return out

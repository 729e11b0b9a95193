"""`Tiling`: memory-centric tiling, ZeRO-Infinity's answer to an operator too wide to gather whole.

A Linear or Embedding whose gathered weight is larger than `max_bytes` (a wide projection, an LM
head, a large vocabulary's table, tied or not) is computed as tiles of its weight's rows (output
features, table rows), one after another, forward and backward: each tile's
rows of the weight are their own sharded unit, gathered, used and freed before the next tile's,
so the operator never holds more than `max_bytes` of its weight gathered (the tile computing and
the one prefetched). No model edit is needed (DeepSpeed's `TiledLinear` replaces the module);
the parameter keeps its name and shape everywhere the user sees it. See docs/tiling.md and
[Note: tiling] in `fxzero/passes/tile.py`.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Tiling"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiling:
    """Split each Linear or Embedding whose gathered weight exceeds `max_bytes` into tiles of rows."""

    max_bytes: int
    """The most bytes of one operator's weight gathered at once: a Linear or Embedding whose weight
    (in the dtype it computes in) is larger is tiled by rows into tiles of at most `max_bytes // 2` bytes,
    so the tile computing and the one prefetched together stay within `max_bytes`."""

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(f"Tiling.max_bytes must be a positive int (bytes), got {self.max_bytes!r}; "
                             "e.g. Tiling(max_bytes=64 << 20) for 64 MiB")

    @property
    def tile_bytes(self) -> int:
        """The most bytes of weight one tile gathers."""
        return self.max_bytes // 2

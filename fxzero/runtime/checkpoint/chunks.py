"""A flat range of a parameter as the boxes torch.distributed.checkpoint describes chunks by.

A rank's shard of a unit's flat buffer cuts its parameters at arbitrary element offsets, so
the part of one parameter a rank holds is a range of that parameter's row-major (flattened)
elements, [lo, hi). DCP describes a chunk as a box, an offset and a size per dimension. A flat
range is the union of at most 2 * (ndim - 1) + 1 boxes, each itself contiguous in row-major
order: a partial last row at each depth on the way in, one block of whole rows, a partial
first row at each depth on the way out. `flat_boxes` cuts a range into those boxes, and
`box_range` reads a box back as the flat range it covers (None for a box that is not
contiguous, which another writer, e.g. a column-sharded one, may have saved).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["Box", "box_range", "flat_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes), one entry per dimension."""


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The boxes, in row-major order, whose union is elements [lo, hi) of a tensor of `shape`."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    head, tail = lo - first * inner, hi - last * inner  # where the range starts / ends within its row

    def within(row: int, a: int, b: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, head, tail)
    out: list[Box] = []
    if head > 0:
        out += within(first, head, inner)
        first += 1
    end = last + 1 if tail == inner else last
    if end > first:
        out.append(((first, *([0] * (len(shape) - 1))), (end - first, *shape[1:])))
    if tail < inner:
        out += within(last, 0, tail)
    return out


def box_range(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Optional[tuple[int, int]]:
    """The flat range [start, end) a box covers, or None if its elements are not contiguous in
    row-major order (leading sizes 1, then any size, then whole trailing dimensions)."""
    shape, offsets, sizes = tuple(shape), tuple(offsets), tuple(sizes)
    k = 0
    while k < len(shape) and sizes[k] == 1:
        k += 1
    if k < len(shape) and (sizes[k + 1 :] != shape[k + 1 :] or any(offsets[k + 1 :])):
        return None
    start = 0
    for dim, off in enumerate(offsets):
        start += off * math.prod(shape[dim + 1 :])
    return start, start + math.prod(sizes)

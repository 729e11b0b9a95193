"""Write-behind for a storage tier: a write is copied into memory of its own and returns at once.

Without it, a program that writes a state waits for the disk before it may reuse the buffer: at
the end of a step-in-backward, the last units' parameters and moments are written with no compute
left to hide behind (25M model, NVMe: 0.09 s of a 1.26 s step waiting on the root's writes). And
the next forward reads first exactly the parameter shards the backward wrote last, back from
disk.

`WriteBehind.write(key, value)` copies `value` into a buffer of its own, starts the tier's write
from that copy, and returns a finished `Pending`: the caller's buffer is free. Until the copy is
reclaimed, `lookup(key)` returns it, so a read of that key needs no disk (the copy holds exactly
what the write puts on disk). Copies take at most `budget_bytes` in all; a write that does not fit
(after reclaiming) goes to the tier as before, with its usual wait.

Reclaiming: a copy whose write has finished is dropped (its buffer kept for reuse), except a
parameter shard not yet read since its write: that is the next forward's first read, so it stays
until read or until room is needed, oldest first. A write that failed raises its error at every
`reclaim()` after it (every store call starts with one) and at `drain()`, and its copy is kept:
the value is never dropped silently, and training stops at the next fetch or write.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch

from fxzero.runtime.storage.aligned import aligned_empty
from fxzero.runtime.storage.tier import Pending, StorageTier

__all__ = ["WriteBehind"]


@dataclasses.dataclass(eq=False)  # (compared by identity: `_retired.remove(copy)`; field-wise, it compared buffers)
class _Copy:
    buffer: torch.Tensor
    write: Pending
    """The tier's write from `buffer`."""
    keep_until_read: bool
    read: bool = False

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class WriteBehind:
    """Copies of the latest writes to `tier`, at most `budget_bytes` of them; see the module doc."""

    def __init__(self, tier: StorageTier, budget_bytes: int) -> None:
        self.tier = tier
        self.budget_bytes = budget_bytes
        self._copies: collections.OrderedDict[str, _Copy] = collections.OrderedDict()
        self._retired: list[_Copy] = []  # replaced by a newer write of their key, still writing
        self._spare: list[torch.Tensor] = []
        self.hits = 0
        """Reads served from a copy."""

    def _held(self) -> int:
        return sum(c.nbytes for c in self._copies.values()) + sum(c.nbytes for c in self._retired) + sum(
            b.numel() * b.element_size() for b in self._spare)

    def write(self, key: str, value: torch.Tensor, *, keep_until_read: bool = False) -> Pending:
        """Write `value` under `key`; from a copy (returns done) if it fits, else straight to the tier."""
        self.reclaim()
        if not self._make_room(value.numel(), value.dtype):
            self.forget(key)  # (else a read would get the copy of an older write)
            return self.tier.write(key, value)
        buffer = self._buffer(value.numel(), value.dtype)
        buffer.copy_(value.reshape(-1))
        old = self._copies.pop(key, None)
        if old is not None:
            self._retired.append(old)  # the tier writes the key in order: the old write ends first
        self._copies[key] = _Copy(buffer, self.tier.write(key, buffer), keep_until_read)
        return Pending(None, value)

    def forget(self, key: str) -> None:
        """Drop `key`'s copy, which a write going to the tier directly makes stale (its own write,
        started first, ends first: the tier writes a key in order)."""
        old = self._copies.pop(key, None)
        if old is not None:
            self._retired.append(old)

    def __contains__(self, key: str) -> bool:
        return key in self._copies

    def lookup(self, key: str) -> Optional[torch.Tensor]:
        """The latest value written under `key`, if a copy of it is still held (flat)."""
        copy = self._copies.get(key)
        if copy is None:
            return None
        copy.read = True
        self.hits += 1
        return copy.buffer

    def reclaim(self) -> None:
        """Drop copies whose writes have finished, but keep unread parameter shards; a failed
        write's error is raised, its copy kept (so the next call raises it again)."""
        for copy in [c for c in self._retired if c.write.done()]:
            self._free(copy)
            self._retired.remove(copy)
        for key, copy in list(self._copies.items()):
            if copy.write.done() and (copy.read or not copy.keep_until_read):
                self._free(copy)
                del self._copies[key]

    def drain(self) -> None:
        """Wait for every write in flight (raising the first error); copies stay readable."""
        for copy in [*self._retired, *self._copies.values()]:
            copy.write.wait()
        self.reclaim()

    def _free(self, copy: _Copy) -> None:
        # Called before the copy is dropped: a failed write raises here and its copy stays.
        copy.write.wait()  # done: returns at once, or raises the write's error
        self._spare.append(copy.buffer)

    def _reusable(self, numel: int, dtype: torch.dtype) -> Optional[int]:
        return next((i for i, b in enumerate(self._spare) if b.numel() == numel and b.dtype == dtype), None)

    def _make_room(self, numel: int, dtype: torch.dtype) -> bool:
        nbytes = numel * dtype.itemsize

        def fits() -> bool:
            new = 0 if self._reusable(numel, dtype) is not None else nbytes
            return self._held() + new <= self.budget_bytes

        def drop_other_spares() -> None:
            for b in [b for b in self._spare if not (b.numel() == numel and b.dtype == dtype)]:
                if fits():
                    return
                self._spare = [s for s in self._spare if s is not b]  # (by identity: == compares tensors)

        if nbytes > self.budget_bytes:
            return False
        drop_other_spares()
        for key, copy in list(self._copies.items()):  # oldest first
            if fits():
                break
            if copy.write.done():
                self._free(copy)
                del self._copies[key]
                drop_other_spares()
        return fits()

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        i = self._reusable(numel, dtype)
        if i is not None:
            return self._spare.pop(i)
        return aligned_empty(numel, dtype)  # aligned: the tier writes it in place (O_DIRECT)

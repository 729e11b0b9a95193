"""Reuse the executor's large per-unit host buffers instead of returning them to the allocator.

Every unit's gathered buffer, flat gradient and fetched shard is allocated and freed once per
unit per step. glibc serves blocks above its mmap threshold with a fresh mapping and unmaps them
on free, so each costs a page fault per 4 KiB and the kernel zeroing it again (on the 1B
offload benchmark: several seconds per step; see fxzero/runtime/host_memory.py). Units of one
model come in few sizes, so keeping the freed buffers of each size removes almost all of it
while bounding what is kept: at most `per_size` buffers of each (bytes, dtype, alignment), and
at most `max_bytes` in all (a 2.2B model on one rank keeps 315 MB buffers of several kinds: two
of each would add 1.9 GB to its resident memory). `per_size` covers the buffers of one size a
prefetched schedule has alive at once (gathers in flight and in use, flat gradients being
reduced, units kept for the backward: 4-7 on the 25M benchmark model); with 2 per size, the
rest were mapped and faulted in afresh every step (25M model, 2 ranks: 1.29-1.64 s against
1.21-1.30 s per step with 8). Large buffers are kept 2 per size only (`size_bytes` bounds the
bytes kept of one size beyond that): 8 of a 1B model's 200 MB units would fill `max_bytes`
with one kind and leave every other kind to fault in afresh.

A buffer handed back is reused for the next buffer of its size, so a use after its free would
read another unit's values: the schedule's validator rules that out statically. Small buffers
(under `min_bytes`) and non-CPU ones are not pooled: they are freed as before (storage resized
to zero, so a stray use fails loudly), and CUDA has its own caching allocator.
"""

from __future__ import annotations

from typing import Optional

import torch

from fxzero.runtime.storage.aligned import ALIGN, aligned_empty

__all__ = ["BufferPool"]


class BufferPool:
    def __init__(self, *, per_size: int = 8, min_bytes: int = 1 << 20, max_bytes: int = 1 << 30,
                 size_bytes: int = 128 << 20, device: torch.device = torch.device("cpu")) -> None:
        self.device = torch.device(device)
        """Where `take` allocates. Only CPU buffers are kept for reuse: a GPU's caching allocator
        already reuses freed blocks without returning them to the driver."""
        self.per_size = per_size
        self.size_bytes = size_bytes
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.kept_bytes = 0
        self.kept_peak = 0
        """The most bytes kept idle at once (memory_report's `pooled_peak`)."""
        self._free: dict[tuple[int, torch.dtype, bool], list[torch.Tensor]] = {}
        self.reused = 0
        """Buffers handed out again instead of allocated (for tests and reports)."""

    def _key(self, numel: int, dtype: torch.dtype, aligned: bool) -> Optional[tuple[int, torch.dtype, bool]]:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return (numel, dtype, aligned) if nbytes >= self.min_bytes else None

    def take(self, numel: int, dtype: torch.dtype, *, aligned: bool = False) -> torch.Tensor:
        """An uninitialized flat tensor on the pool's device (on the CPU, data on an ALIGN boundary
        if `aligned`)."""
        if self.device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=self.device)
        key = self._key(numel, dtype, aligned)
        if key is not None and self._free.get(key):
            self.reused += 1
            t = self._free[key].pop()
            self.kept_bytes -= t.numel() * t.element_size()
            return t
        return aligned_empty(numel, dtype) if aligned else torch.empty(numel, dtype=dtype)

    def give(self, t: torch.Tensor) -> None:
        """Hand `t` back (its caller must not use it again). Kept for reuse when it is a whole
        pooled-size CPU buffer and there is room; otherwise its storage is released now."""
        aligned = t.data_ptr() % ALIGN == 0
        whole = t.untyped_storage().nbytes() >= t.numel() * t.element_size() and t.is_contiguous() and t.dim() == 1
        key = self._key(t.numel(), t.dtype, aligned) if t.device.type == "cpu" and whole else None
        if key is not None and not aligned and t.storage_offset() != 0:
            key = None  # a view into something larger: not ours to reuse
        nbytes = t.numel() * t.element_size()
        if key is not None and self.kept_bytes + nbytes <= self.max_bytes:
            kept = self._free.setdefault(key, [])
            # Counted per size, whatever the alignment (a buffer can be aligned by chance).
            same_size = len(self._free.get((key[0], key[1], not key[2]), ())) + len(kept)
            if same_size < min(self.per_size, max(2, self.size_bytes // max(nbytes, 1))):
                kept.append(t)
                self.kept_bytes += nbytes
                self.kept_peak = max(self.kept_peak, self.kept_bytes)
                return
        t.untyped_storage().resize_(0)

    def clear(self) -> None:
        for kept in self._free.values():
            for t in kept:
                t.untyped_storage().resize_(0)
        self._free.clear()
        self.kept_bytes = 0

"""Keep freed host memory in the process for reuse, instead of returning it to the kernel.

Every unit's gathered buffer, flat gradient, reduce-scatter output and fetched shard is a large
transient allocation (hundreds of MB at the 1B scale), made and freed once per unit per step.
glibc serves allocations above its mmap threshold (at most 32 MB) with a fresh `mmap` and
`munmap`s them on free, so each one costs a page fault per 4 KiB plus the kernel zeroing the
pages again: measured on a 1B-parameter GPT offloaded to NVMe (2 ranks, `tools/profile_step.py`),
`flatten_grads` spent 4-5 s per step in page faults, AdamW 5.5 s and the frees 1.5 s; with the
freed pages kept, 1.5 s, 2 s and 0.6 s, and the step went from 45 s to 39.5 s.

`keep_freed_host_memory()` sets glibc's `M_MMAP_MAX` to 0 (large blocks come from the heap) and
`M_TRIM_THRESHOLD` out of reach (freed blocks stay mapped for the next allocation of their
size). The cost is memory: the heap keeps every freed block, and blocks of other sizes fragment
it, so resident memory grows well past the live bytes (same 1B run: peak RSS per rank 2.5 GB
-> 8.5 GB, 3.6 -> 12.1 GB with step_in_backward). It is therefore opt-in
(`Config(keep_host_memory=True)`), process-wide, applied once when an engine starts on a
CPU-only machine, and a no-op where glibc is not the allocator. A size-keyed pool of the
executor's own buffers would get the speed without the growth; not built yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_host_memory"]

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_host_memory() -> bool:
    """Apply the setting once per process; True if glibc accepted it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok &= mallopt(_M_TOP_PAD, 64 << 20) == 1
    return bool(ok)

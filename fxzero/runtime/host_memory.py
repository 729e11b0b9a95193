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
CPU-only machine, and a no-op where glibc is not the allocator. The executor's own unit-sized
buffers are reused by a size-keyed pool instead (fxzero/runtime/storage/pool.py).

The opposite problem is the default's: below the mmap threshold (which glibc raises, up to 32 MB,
as large blocks are freed) activations and temporaries come from the heap, and freed heap
memory stays resident until it happens to border the heap's top. The step's many sizes
fragment it, so resident memory drifts above the bytes in use, more with every step.
`release_freed_host_memory()` (glibc's `malloc_trim(0)`: free pages anywhere in the heap go
back to the kernel) runs after each of a CPU engine's programs. 25M GPT at sequence 512,
micro-batch 2, ZeRO-3, 2 ranks, 3 steps: peak RSS per rank 1105-1115 -> 1029 MB, between steps
770-840 -> 604 MB. A trim takes milliseconds, and the pages it returns are faulted in again only
where the next program reuses them (sequence 1024, micro-batch 4: the same step time within
run-to-run spread). Not done under `keep_host_memory`, whose point is keeping them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_host_memory", "release_freed_host_memory"]

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4


@functools.cache
def _libc():
    """glibc, or None where it is not the C library (its malloc tunables do not apply)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's own: absent from musl and others)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def release_freed_host_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's `malloc_trim(0)`); True if any were."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


@functools.cache
def keep_freed_host_memory() -> bool:
    """Apply the setting once per process; True if glibc accepted it."""
    libc = _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok &= mallopt(_M_TOP_PAD, 64 << 20) == 1
    return bool(ok)

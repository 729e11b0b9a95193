"""Storage tiers: where flat tensors (optimizer state, fp32 masters, offloaded parameters) live.

Three tiers share one interface, keyed by name (e.g. "optim/blocks.3/exp_avg"):

- `DeviceTier`: tensors held in accelerator memory (CPU memory without CUDA).
- `CpuTier`: tensors held in host memory, pinned when CUDA is available so that copies to and
  from the device can be asynchronous.
- `NvmeTier`: one file per key under a user-given directory, written and read asynchronously
  on a small thread pool through reused, 4096-byte-aligned staging buffers, with O_DIRECT
  where the filesystem allows it. See [Note: NVMe file layout] and [Note: O_DIRECT].

Every tier offers `write(key, tensor) -> Pending`, `read(key, out=None) -> Pending`,
`delete(key)`, `nbytes(key)`, `reserve(total_bytes)` and `report()`; `Pending.wait()` returns
the tensor. A tensor passed to `write` must not be modified, and `out` passed to `read` must not
be used, until the `Pending` has been waited on.

[Note: NVMe file layout]
One file per key, named by the percent-quoted key (so "optim/blocks.3/exp_avg" becomes
"optim%2Fblocks.3%2Fexp_avg.fxz"; quoting is reversible, so two keys never share a file). A file
is a 4096-byte header block, then the tensor's bytes zero-padded to a multiple of 4096:

    [ header: magic, version, dtype, numel, nbytes, xxh3 | zero pad ][ data | zero pad ]
    0                                                      4096       4096 + round_up(nbytes)

Keeping the data at an aligned offset lets O_DIRECT read and write it in place. The header makes
a file self-describing for a human; the in-memory index (`_Record`: size, dtype, shape, and the
64-bit XXH3 hash of the data) is what a read is checked against, so a file changed underneath (truncated, overwritten, a byte
flipped) raises `IOError` naming the key, the file, expected and got, and never returns wrong
data. The index lives only in this process: files are scratch for one run, not a checkpoint
format, and no fsync is issued.

[Note: O_DIRECT]
O_DIRECT bypasses the page cache, so offloaded state does not evict everything else from host
memory and bandwidth figures are the disk's, not the cache's. It requires the buffer address,
the file offset and the length to be aligned (4096 covers common devices), hence the aligned
staging buffers and padded writes. Some filesystems (tmpfs, overlayfs on some kernels) refuse it
with EINVAL at open: with `direct="auto"` the tier probes once at construction, falls back to
buffered I/O and records why in `direct_fallback` (shown by `report()`); `direct=True` makes
that an error instead, and `direct=False` never tries.

[Note: in place]
A tensor whose data starts on a 4096-byte boundary, with its storage running on to the padded
length, is read into and written from directly (no staging copy; `_direct_view`). Reads without
`out` allocate such tensors (`aligned_empty`), so a state fetched from this tier, updated in
place and written back never passes through a staging buffer. Other tensors are staged.

[Note: ordering per key]
Operations on one key run in the order they were issued: each task first waits for the previous
task on the same key. Operations on different keys run concurrently, up to `threads` at a time.

[Note: reads first]
A program waits for its reads soon (a parameter shard before its gather), and for its writes
late or not at all (write-behind), so the workers take reads before writes: a read issued while
writes are queued does not wait behind them. Only a read with no unfinished task on its key is
taken early; every other task is taken first-in first-out. That cannot deadlock: a task waits
only on an earlier task of its key, and that task is either an early read (which waits on
nothing, and was taken before any later task, since early reads go first) or was taken earlier
in first-in first-out order; either way a worker already holds it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import os
import queue
import shutil
import struct
import threading
import time
import urllib.parse
from typing import Literal, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import xxhash

__all__ = ["CpuTier", "DeviceTier", "NvmeTier", "Pending", "StorageTier", "aligned_empty"]

ALIGN = 4096
"""Alignment of staging buffers, file offsets and write lengths (see [Note: O_DIRECT])."""

_MAGIC = b"FXZSTOR1"
_HEADER = struct.Struct("<8sI16sQQQ")  # magic, version, dtype name, numel, nbytes, xxh3_64 of the data
_VERSION = 2
_SUFFIX = ".fxz"


def _rank_prefix() -> str:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"[rank {rank}]"


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage."""
    return t.reshape(-1).view(torch.uint8)


class Pending(NamedTuple):
    """An in-flight write or read: its future (None once done), and the tensor it yields."""

    future: Optional[concurrent.futures.Future]
    result: Optional[torch.Tensor]
    """The tensor `wait()` returns when there is no future (memory tiers complete at once)."""

    def wait(self) -> torch.Tensor:
        if self.future is not None:
            return self.future.result()
        return self.result

    def done(self) -> bool:
        return self.future is None or self.future.done()


@dataclasses.dataclass
class Traffic:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """Sum of each operation's own duration: with operations in flight together this exceeds
    wall time, so bytes / seconds is the bandwidth one stream achieved, not the aggregate."""


class _Record(NamedTuple):
    """What the tier knows about a key; a read is checked against it."""

    dtype: torch.dtype
    shape: torch.Size
    nbytes: int
    checksum: int
    """XXH3-64 of the tensor's bytes (0 for memory tiers, which do not checksum). XXH3 rather
    than zlib's crc32: every byte moved is hashed on the cores that also compute, and XXH3 hashes
    about 5x faster here (21 against 3.9 GB/s on one core), and with 64 bits a changed record
    passes unnoticed with probability 2**-64, not 2**-32."""


class StorageTier:
    """The interface shared by every tier; counters and the index live here."""

    name = "tier"

    def __init__(self) -> None:
        self._index: dict[str, _Record] = {}
        self._traffic = {"read": Traffic(), "write": Traffic()}
        self._lock = threading.Lock()  # guards _index and _traffic against the I/O workers

    def _count(self, kind: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            t = self._traffic[kind]
            t.calls += 1
            t.bytes += nbytes
            t.seconds += seconds

    def _record(self, key: str) -> _Record:
        with self._lock:
            rec = self._index.get(key)
        if rec is None:
            raise KeyError(f"{_rank_prefix()} {self.name} tier has no key {key!r} "
                           f"({len(self._index)} keys stored); write it before reading it")
        return rec

    @staticmethod
    def _check_out(key: str, rec: _Record, out: torch.Tensor) -> None:
        if out.dtype != rec.dtype or out.numel() * out.element_size() != rec.nbytes:
            raise ValueError(f"read({key!r}, out=...): out is {out.dtype} with {out.numel()} elements, "
                             f"but the key holds {rec.dtype} with shape {tuple(rec.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"read({key!r}, out=...): out must be contiguous")

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._index)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def nbytes(self, key: str) -> int:
        """Bytes the tensor stored under `key` occupies (unpadded)."""
        return self._record(key).nbytes

    def write(self, key: str, tensor: torch.Tensor) -> Pending:
        raise NotImplementedError

    def read(self, key: str, out: Optional[torch.Tensor] = None) -> Pending:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def reserve(self, total_bytes: int) -> None:
        raise NotImplementedError

    def report(self, reset: bool = False) -> dict:
        """Bytes, seconds and calls each way; `GBps` is bytes / seconds / 1e9 (0 before any call)."""
        with self._lock:
            out: dict = {"tier": self.name}
            for kind, t in self._traffic.items():
                out[kind] = dataclasses.asdict(t) | {"GBps": t.bytes / t.seconds / 1e9 if t.seconds else 0.0}
            if reset:
                self._traffic = {"read": Traffic(), "write": Traffic()}
        return out

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _MemoryTier(StorageTier):
    """Tensors held in memory on one device; writes copy in, reads copy out."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        super().__init__()
        self.device = device
        self.pin = pin
        self._store: dict[str, torch.Tensor] = {}

    def write(self, key: str, tensor: torch.Tensor) -> Pending:
        start = time.perf_counter()
        flat = tensor.detach().reshape(-1)
        held = self._store.get(key)
        if held is None or held.dtype != flat.dtype or held.numel() != flat.numel():
            # A key rewritten with the same size reuses its buffer (pinned allocations are slow).
            held = torch.empty(flat.numel(), dtype=flat.dtype, device=self.device, pin_memory=self.pin)
        held.copy_(flat)
        nbytes = flat.numel() * flat.element_size()
        with self._lock:
            self._store[key] = held
            self._index[key] = _Record(flat.dtype, tensor.shape, nbytes, 0)
        self._count("write", nbytes, time.perf_counter() - start)
        return Pending(None, tensor)

    def read(self, key: str, out: Optional[torch.Tensor] = None) -> Pending:
        start = time.perf_counter()
        rec = self._record(key)
        if out is None:
            out = torch.empty(rec.shape, dtype=rec.dtype, device=self.device)
        self._check_out(key, rec, out)
        out.view(-1).copy_(self._store[key])
        self._count("read", rec.nbytes, time.perf_counter() - start)
        return Pending(None, out)

    def delete(self, key: str) -> None:
        self._record(key)
        with self._lock:
            del self._index[key]
            del self._store[key]

    def _free_bytes(self) -> int:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def reserve(self, total_bytes: int) -> None:
        """Raise ValueError now if `total_bytes` more cannot fit, rather than fail mid-step."""
        free = self._free_bytes()
        if total_bytes > free:
            raise ValueError(f"{self.name} tier: {total_bytes} bytes needed on {self.device}, only {free} free; "
                             f"offload less to this tier (use a lower one) or free memory")


class DeviceTier(_MemoryTier):
    """Tensors in accelerator memory: the top tier, where a step's working set must fit."""

    name = "device"

    def __init__(self, device: Union[torch.device, str, None] = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(torch.device(device), pin=False)

    def _free_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return super()._free_bytes()


class CpuTier(_MemoryTier):
    """Tensors in host memory, pinned when CUDA is available (asynchronous host-device copies)."""

    name = "cpu"

    def __init__(self, *, pin: Optional[bool] = None) -> None:
        super().__init__(torch.device("cpu"), pin=torch.cuda.is_available() if pin is None else pin)


class _Staging(NamedTuple):
    """One reused, ALIGN-aligned host buffer: a uint8 tensor view and a buffer for os.pread/pwrite."""

    tensor: torch.Tensor
    view: memoryview
    owner: torch.Tensor
    """The over-allocated tensor whose storage the aligned views point into."""


def _aligned_buffer(nbytes: int) -> _Staging:
    # Over-allocate by ALIGN and start at the first aligned address inside (no numpy needed).
    owner = torch.zeros(nbytes + ALIGN, dtype=torch.uint8)
    offset = -owner.data_ptr() % ALIGN
    tensor = owner[offset : offset + nbytes]
    view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    return _Staging(tensor, view, owner)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized flat tensor whose data starts on an ALIGN boundary and whose storage
    extends to a multiple of ALIGN past it, so O_DIRECT can read and write it in place."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    owner = torch.empty(_round_up(nbytes) + ALIGN, dtype=torch.uint8)
    offset = -owner.data_ptr() % ALIGN
    return owner[offset : offset + nbytes].view(dtype) if nbytes else torch.empty(0, dtype=dtype)


def _direct_view(t: torch.Tensor) -> Optional[memoryview]:
    """A writable byte view of t's data padded to ALIGN, if t can be used for O_DIRECT in place
    (data aligned, and its storage extends to the padded length); else None."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % ALIGN:
        return None
    storage = t.untyped_storage()
    available = storage.data_ptr() + storage.nbytes() - t.data_ptr()
    padded = _round_up(nbytes)
    if available < padded:
        return None
    return memoryview((ctypes.c_char * padded).from_address(t.data_ptr())).cast("B")


class _IoPool:
    """Worker threads that take early reads before everything else ([Note: reads first])."""

    def __init__(self, threads: int, name: str) -> None:
        self._cond = threading.Condition()
        self._queues: tuple[collections.deque, collections.deque] = (collections.deque(), collections.deque())
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, early: bool, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{_rank_prefix()} NvmeTier is closed: no more reads or writes")
            self._queues[0 if early else 1].append((future, fn, args))
            self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._queues[0] or self._queues[1] or self._closed):
                    self._cond.wait()
                queue_ = self._queues[0] if self._queues[0] else self._queues[1]
                if not queue_:
                    return  # closed, nothing left
                future, fn, args = queue_.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # delivered to whoever waits on the future
                future.set_exception(e)

    def shutdown(self) -> None:
        """Run what was submitted, then stop the workers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


class NvmeTier(StorageTier):
    """Tensors in files under `path`, one file per key; see [Note: NVMe file layout].

    Args:
        path: an existing, writable directory (the tier creates and deletes only its own files).
        threads: I/O worker threads, hence operations in flight at once.
        block_bytes: size of each staging buffer, the unit of one pread/pwrite; a multiple of 4096.
        direct: "auto" uses O_DIRECT where the filesystem accepts it and falls back to buffered
            I/O otherwise (see `direct_fallback`); True requires it; False never uses it.
    """

    name = "nvme"

    def __init__(self, path: Union[str, os.PathLike], *, threads: int = 4, block_bytes: int = 1 << 20,
                 direct: Union[bool, Literal["auto"]] = "auto") -> None:
        super().__init__()
        if threads < 1:
            raise ValueError(f"NvmeTier threads={threads}: need at least 1")
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"NvmeTier block_bytes={block_bytes}: must be a positive multiple of {ALIGN}")
        if direct not in (True, False, "auto"):
            raise ValueError(f"NvmeTier direct={direct!r}: use True, False or 'auto'")
        self.path = os.fspath(path)
        self.block_bytes = block_bytes
        self._check_dir()
        self.direct_fallback: Optional[str] = None
        """Why O_DIRECT is not used under direct='auto' (None when it is, or was not asked for)."""
        self.direct = self._probe_direct(direct)
        # One staging buffer per worker: a worker holds one for the whole of one operation.
        self._staging: queue.SimpleQueue[_Staging] = queue.SimpleQueue()
        for _ in range(threads):
            self._staging.put(_aligned_buffer(block_bytes))
        self._pool = _IoPool(threads, "fxzero-nvme")
        self._last: dict[str, concurrent.futures.Future] = {}  # see [Note: ordering per key]

    # -- checks before use -------------------------------------------------------------------

    def _check_dir(self) -> None:
        if not os.path.exists(self.path):
            raise ValueError(f"NvmeTier path {self.path!r} does not exist; create it (mkdir -p) "
                             f"or point the tier at an existing directory on the fast disk")
        if not os.path.isdir(self.path):
            raise ValueError(f"NvmeTier path {self.path!r} is not a directory; give a directory")
        probe = os.path.join(self.path, f".fxzero-probe-{os.getpid()}")
        try:
            with open(probe, "wb") as f:
                f.write(b"\0")
        except OSError as e:
            raise ValueError(f"NvmeTier path {self.path!r} is not writable ({e.strerror}); "
                             f"fix its permissions or choose a directory this user can write") from e
        finally:
            if os.path.exists(probe):
                os.unlink(probe)

    def _probe_direct(self, direct: Union[bool, str]) -> bool:
        if direct is False:
            return False
        reason = None
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            reason = "os.O_DIRECT is not available on this platform"
        else:
            probe = os.path.join(self.path, f".fxzero-direct-probe-{os.getpid()}")
            buf = _aligned_buffer(ALIGN)
            try:
                fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
                try:
                    os.pwrite(fd, buf.view, 0)
                finally:
                    os.close(fd)
            except OSError as e:
                reason = f"O_DIRECT refused by the filesystem under {self.path!r}: {e.strerror or e}"
            finally:
                if os.path.exists(probe):
                    os.unlink(probe)
        if reason is None:
            return True
        if direct is True:
            raise ValueError(f"NvmeTier(direct=True): {reason}; use direct='auto' to fall back to buffered I/O")
        self.direct_fallback = reason
        return False

    def reserve(self, total_bytes: int) -> None:
        """Raise ValueError now if the disk under `path` has no room for `total_bytes` more."""
        free = shutil.disk_usage(self.path).free
        if total_bytes > free:
            raise ValueError(f"NvmeTier path {self.path!r}: {total_bytes} bytes needed, only {free} free on "
                             f"that filesystem; free space there, point the tier at a larger disk, or "
                             f"offload less to NVMe")

    # -- files ---------------------------------------------------------------------------------

    def file(self, key: str) -> str:
        """The file that holds `key` (see [Note: NVMe file layout])."""
        return os.path.join(self.path, urllib.parse.quote(key, safe="") + _SUFFIX)

    def _open(self, path: str, flags: int) -> int:
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o644)

    def _error(self, key: str, path: str, what: str) -> IOError:
        return IOError(f"{_rank_prefix()} NvmeTier key {key!r}, file {path!r}: {what}; the file was changed "
                       f"or truncated outside this tier (or the disk failed), refusing to return its data")

    def _submit(self, key: str, fn, *args, read: bool = False) -> concurrent.futures.Future:
        with self._lock:
            before = self._last.get(key)
            early = read and (before is None or before.done())  # see [Note: reads first]
            fut = self._pool.submit(early, self._after, None if early else before, fn, *args)
            self._last[key] = fut
        fut.add_done_callback(lambda f: self._forget(key, f))
        return fut

    def _forget(self, key: str, fut: concurrent.futures.Future) -> None:
        # Drop a finished future unless a later one replaced it: it holds its tensor alive.
        with self._lock:
            if self._last.get(key) is fut:
                del self._last[key]

    @staticmethod
    def _after(before: Optional[concurrent.futures.Future], fn, *args):
        if before is not None:
            concurrent.futures.wait([before])  # its failure is reported by its own Pending
        return fn(*args)

    # -- write ---------------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> Pending:
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        return Pending(self._submit(key, self._write, key, src, tensor), None)

    def _write(self, key: str, src: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        try:
            return self._write_file(key, src, tensor)
        except BaseException:
            # The file no longer holds the old value: forget the key rather than fail its reads later.
            with self._lock:
                self._index.pop(key, None)
            raise

    def _write_file(self, key: str, src: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        data = _as_bytes(src)
        nbytes = data.numel()
        path = self.file(key)
        # [Note: in place] A tensor whose data is aligned (e.g. one this tier read, see
        # aligned_empty) is written straight from its memory; others go through a staging buffer.
        direct = _direct_view(src) if self.direct else None
        stage = self._staging.get()
        try:
            fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                digest = xxhash.xxh3_64()
                block = self.block_bytes
                for off in range(0, nbytes, block):
                    n = min(block, nbytes - off)
                    padded = _round_up(n)
                    if direct is not None:
                        digest.update(direct[off : off + n])
                        self._pwrite_all(fd, direct[off : off + padded], ALIGN + off, key, path)
                        continue
                    stage.tensor[:n].copy_(data[off : off + n])
                    if padded > n:
                        stage.tensor[n:padded].zero_()
                    digest.update(stage.view[:n])
                    self._pwrite_all(fd, stage.view[:padded], ALIGN + off, key, path)
                # The header goes last: a file whose write was interrupted has no valid header.
                dtype_name = str(src.dtype).removeprefix("torch.").encode()
                checksum = digest.intdigest()
                header = _HEADER.pack(_MAGIC, _VERSION, dtype_name, src.numel(), nbytes, checksum)
                stage.tensor[:ALIGN].zero_()
                stage.view[: len(header)] = header
                self._pwrite_all(fd, stage.view[:ALIGN], 0, key, path)
            finally:
                os.close(fd)
        finally:
            self._staging.put(stage)
        with self._lock:
            self._index[key] = _Record(src.dtype, tensor.shape, nbytes, checksum)
        self._count("write", nbytes, time.perf_counter() - start)
        return tensor

    def _pwrite_all(self, fd: int, buf: memoryview, offset: int, key: str, path: str) -> None:
        done = 0
        while done < len(buf):
            n = os.pwrite(fd, buf[done:], offset + done)
            if n <= 0:
                raise self._error(key, path, f"write stalled at byte {offset + done}")
            done += n

    # -- read ----------------------------------------------------------------------------------

    def read(self, key: str, out: Optional[torch.Tensor] = None) -> Pending:
        with self._lock:
            known = key in self._index or key in self._last
        if not known:
            self._record(key)  # raises the KeyError
        if out is not None and not out.is_contiguous():
            raise ValueError(f"read({key!r}, out=...): out must be contiguous")
        return Pending(self._submit(key, self._read, key, out, read=True), None)

    def _read(self, key: str, out: Optional[torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        rec = self._record(key)  # after the write that made it (see [Note: ordering per key])
        if out is None:
            numel = rec.nbytes // torch.empty((), dtype=rec.dtype).element_size()
            out = aligned_empty(numel, rec.dtype).view(rec.shape)  # see [Note: in place]
        self._check_out(key, rec, out)
        dest = _as_bytes(out)
        direct = _direct_view(out) if self.direct else None
        path = self.file(key)
        want_size = ALIGN + _round_up(rec.nbytes)
        stage = self._staging.get()
        try:
            try:
                fd = self._open(path, os.O_RDONLY)
            except FileNotFoundError as e:
                raise self._error(key, path, "file is missing") from e
            try:
                size = os.fstat(fd).st_size
                if size != want_size:
                    raise self._error(key, path, f"expected {want_size} bytes on disk ({rec.nbytes} of data), "
                                                 f"got {size}")
                self._pread_all(fd, stage.view[:ALIGN], 0, key, path)
                self._check_header(key, path, rec, bytes(stage.view[: _HEADER.size]))
                digest = xxhash.xxh3_64()
                block = self.block_bytes
                for off in range(0, rec.nbytes, block):
                    n = min(block, rec.nbytes - off)
                    if direct is not None:
                        self._pread_all(fd, direct[off : off + _round_up(n)], ALIGN + off, key, path)
                        digest.update(direct[off : off + n])
                        continue
                    self._pread_all(fd, stage.view[: _round_up(n)], ALIGN + off, key, path)
                    digest.update(stage.view[:n])
                    dest[off : off + n].copy_(stage.tensor[:n])
            finally:
                os.close(fd)
        finally:
            self._staging.put(stage)
        checksum = digest.intdigest()
        if checksum != rec.checksum:
            raise self._error(key, path, f"checksum mismatch: expected xxh3 {rec.checksum:#018x}, got {checksum:#018x}")
        self._count("read", rec.nbytes, time.perf_counter() - start)
        return out

    def _pread_all(self, fd: int, buf: memoryview, offset: int, key: str, path: str) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise self._error(key, path, f"short read: expected {len(buf)} bytes at offset {offset}, "
                                             f"got {done}")
            done += n

    def _check_header(self, key: str, path: str, rec: _Record, raw: bytes) -> None:
        magic, version, dtype_name, numel, nbytes, checksum = _HEADER.unpack(raw)
        want_dtype = str(rec.dtype).removeprefix("torch.").encode()
        if magic != _MAGIC or version != _VERSION:
            raise self._error(key, path, f"bad header: expected magic {_MAGIC!r} v{_VERSION}, got {magic!r} v{version}")
        if dtype_name.rstrip(b"\0") != want_dtype or nbytes != rec.nbytes or checksum != rec.checksum:
            raise self._error(key, path, f"header says {dtype_name.rstrip(bytes(1)).decode(errors='replace')}, "
                                         f"{nbytes} bytes, xxh3 {checksum:#018x}; expected {want_dtype.decode()}, "
                                         f"{rec.nbytes} bytes, xxh3 {rec.checksum:#018x}")

    # -- the rest ------------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        """Remove `key` and its file, after any operation on it still in flight."""
        with self._lock:
            before = self._last.pop(key, None)
        if before is not None:
            concurrent.futures.wait([before])
        self._record(key)
        with self._lock:
            del self._index[key]
        try:
            os.unlink(self.file(key))
        except FileNotFoundError:
            pass

    def report(self, reset: bool = False) -> dict:
        out = super().report(reset)
        out["direct"] = self.direct
        out["direct_fallback"] = self.direct_fallback
        out["path"] = self.path
        return out

    def close(self) -> None:
        """Finish every operation in flight and stop the workers; files stay until deleted."""
        self._pool.shutdown()

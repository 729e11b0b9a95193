"""`NvmeTier`: tensors in files on a fast disk, one file per key, read and written asynchronously.

Files are written and read on a small thread pool (`io_pool.IoPool`) through reused,
4096-byte-aligned staging buffers, with O_DIRECT where the filesystem allows it; the file format
is `nvme_format`.

[Note: O_DIRECT].

Every tier offers `write(key, tensor) -> Pending`, `read(key, out=None) -> Pending`,
`delete(key)`, `nbytes(key)`, `reserve(total_bytes)` and `report()`; `Pending.wait()` returns
the tensor. A tensor passed to `write` must not be modified, and `out` passed to `read` must not
be used, until the `Pending` has been waited on.

[Note: ordering per key]
Operations on one key run in the order they were issued: each task first waits for the previous
task on the same key. Operations on different keys run concurrently, up to `threads` at a time.

[Note: a failed write]
A write that fails (the disk filled after the start-up check, `reserve`; the disk failed) raises
at its `Pending.wait()`: a full disk (ENOSPC, EDQUOT) as `DiskFull`, naming the tier's path, the
key, the bytes and the way out. The file was truncated when the write began, so the key holds no
value any more: until a later write of it succeeds, the key is still "in" the tier but every read
of it raises, naming the failed write. It never reads as older data, nor as missing (which
`OffloadStore.fetch` would take for a state not written yet, and answer with its initial value).
"""

from __future__ import annotations

import concurrent.futures
import errno
import importlib.util
import os
import queue
import shutil
import time
import zlib
from typing import Literal, Optional, Union

import torch

from fxzero.ir.sizes import round_up
from fxzero.runtime.storage import nvme_format
from fxzero.runtime.storage.aligned import ALIGN, Staging, aligned_buffer, aligned_empty, as_bytes, direct_view
from fxzero.runtime.storage.io_pool import IoPool
from fxzero.runtime.storage.tier import Pending, Record, StorageTier, rank_prefix


class _Crc32:
    """zlib's CRC-32 with xxhash's incremental interface: the checksum where xxhash is not
    installed (the GPU machines' Python 3.12 has no wheel of it here). The files are this run's
    scratch, written and read by this process, so which checksum they carry is this process's
    choice; CRC-32 is about 5x slower to compute ([Note: why xxhash] in pyproject.toml)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


def _checksum():
    try:
        import xxhash
    except ImportError:
        return _Crc32()
    return xxhash.xxh3_64()


CHECKSUM = "xxh3" if importlib.util.find_spec("xxhash") is not None else "crc32"
"""The checksum this process's NVMe files carry."""

__all__ = ["DiskFull", "NvmeTier"]

_FULL = (errno.ENOSPC, errno.EDQUOT)
"""errnos of a write refused for want of room: the disk is full, or this user's quota on it."""


class DiskFull(OSError):
    """A write refused because the disk under an `NvmeTier` is full (`errno` is ENOSPC or EDQUOT);
    see [Note: a failed write]. `str()` is the whole message, without the "[Errno 28]" prefix."""

    def __str__(self) -> str:
        return self.strerror


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
        self._staging: queue.SimpleQueue[Staging] = queue.SimpleQueue()
        for _ in range(threads):
            self._staging.put(aligned_buffer(block_bytes))
        self._pool = IoPool(threads, "fxzero-nvme")
        self._last: dict[str, concurrent.futures.Future] = {}  # see [Note: ordering per key]
        self._failed: dict[str, str] = {}  # key -> why its last write failed ([Note: a failed write])

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
            buf = aligned_buffer(ALIGN)
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
        return os.path.join(self.path, nvme_format.file_name(key))

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index or key in self._failed  # a failed key is lost, not absent

    def _record(self, key: str) -> Record:
        with self._lock:
            why = self._failed.get(key)
        if why is not None:
            raise IOError(f"{rank_prefix()} NvmeTier key {key!r}, file {self.file(key)!r}: its last write "
                          f"failed ({why}), so the tier holds no valid value for it; refusing to return "
                          f"older data. Restart from the last checkpoint")
        return super()._record(key)

    def _open(self, path: str, flags: int) -> int:
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o644)

    def _error(self, key: str, path: str, what: str) -> IOError:
        return IOError(f"{rank_prefix()} NvmeTier key {key!r}, file {path!r}: {what}; the file was changed "
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
        except BaseException as e:
            # The file no longer holds the old value: its reads must fail ([Note: a failed write]).
            full = isinstance(e, OSError) and e.errno in _FULL
            error = self._disk_full(key, src, e) if full else e
            with self._lock:
                self._index.pop(key, None)
                self._failed[key] = "the disk was full" if full else f"{type(e).__name__}: {e}"
            if error is e:
                raise
            raise error from e

    def _disk_full(self, key: str, src: torch.Tensor, e: OSError) -> DiskFull:
        nbytes = src.numel() * src.element_size()
        try:
            free = f"{shutil.disk_usage(self.path).free} bytes are free there now"
        except OSError:
            free = "its free space cannot be read"
        return DiskFull(e.errno, (
            f"{rank_prefix()} NvmeTier {self.path!r}: the disk is full ({os.strerror(e.errno)}): writing key "
            f"{key!r} ({nbytes} bytes, {nvme_format.file_size(nbytes)} on disk) failed, and {free} (another "
            f"process may have filled it since the start-up check). Free space on that filesystem, or point "
            f"Nvme(path=...) at a disk with room, and restart from the last checkpoint"
        ), self.file(key))

    def _write_file(self, key: str, src: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        data = as_bytes(src)
        nbytes = data.numel()
        path = self.file(key)
        # [Note: in place] A tensor whose data is aligned (e.g. one this tier read, see
        # aligned_empty) is written straight from its memory; others go through a staging buffer.
        direct = direct_view(src) if self.direct else None
        stage = self._staging.get()
        try:
            fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                digest = _checksum()
                block = self.block_bytes
                for off in range(0, nbytes, block):
                    n = min(block, nbytes - off)
                    padded = round_up(n, ALIGN)
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
                checksum = digest.intdigest()
                header = nvme_format.pack_header(src.dtype, src.numel(), nbytes, checksum)
                stage.tensor[:ALIGN].zero_()
                stage.view[: len(header)] = header
                self._pwrite_all(fd, stage.view[:ALIGN], 0, key, path)
            finally:
                os.close(fd)
        finally:
            self._staging.put(stage)
        with self._lock:
            self._index[key] = Record(src.dtype, tensor.shape, nbytes, checksum)
            self._failed.pop(key, None)
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
            # A write still in flight decides at the read's turn; a finished one has left the
            # index as it is (its future may linger in _last until its done-callback runs).
            before = self._last.get(key)
            known = key in self._index or (before is not None and not before.done())
        if not known:
            self._record(key)  # raises: never written (KeyError), or its last write failed
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
        dest = as_bytes(out)
        direct = direct_view(out) if self.direct else None
        path = self.file(key)
        want_size = nvme_format.file_size(rec.nbytes)
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
                self._check_header(key, path, rec, bytes(stage.view[:ALIGN]))
                digest = _checksum()
                block = self.block_bytes
                for off in range(0, rec.nbytes, block):
                    n = min(block, rec.nbytes - off)
                    if direct is not None:
                        self._pread_all(fd, direct[off : off + round_up(n, ALIGN)], ALIGN + off, key, path)
                        digest.update(direct[off : off + n])
                        continue
                    self._pread_all(fd, stage.view[: round_up(n, ALIGN)], ALIGN + off, key, path)
                    digest.update(stage.view[:n])
                    dest[off : off + n].copy_(stage.tensor[:n])
            finally:
                os.close(fd)
        finally:
            self._staging.put(stage)
        checksum = digest.intdigest()
        if checksum != rec.checksum:
            raise self._error(key, path,
                              f"checksum mismatch: expected {CHECKSUM} {rec.checksum:#018x}, got {checksum:#018x}")
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

    def _check_header(self, key: str, path: str, rec: Record, raw: bytes) -> None:
        header = nvme_format.unpack_header(raw)
        want_dtype = nvme_format.dtype_name(rec.dtype)
        if header.magic != nvme_format.MAGIC or header.version != nvme_format.VERSION:
            raise self._error(key, path, f"bad header: expected magic {nvme_format.MAGIC!r} v{nvme_format.VERSION}, "
                                         f"got {header.magic!r} v{header.version}")
        if header.dtype != want_dtype or header.nbytes != rec.nbytes or header.checksum != rec.checksum:
            raise self._error(key, path, f"header says {header.dtype}, {header.nbytes} bytes, {CHECKSUM} "
                                         f"{header.checksum:#018x}; expected {want_dtype}, {rec.nbytes} bytes, "
                                         f"{CHECKSUM} {rec.checksum:#018x}")

    # -- the rest ------------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        """Remove `key` and its file, after any operation on it still in flight."""
        with self._lock:
            before = self._last.pop(key, None)
        if before is not None:
            concurrent.futures.wait([before])
        with self._lock:
            failed = self._failed.pop(key, None) is not None
        if not failed:
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

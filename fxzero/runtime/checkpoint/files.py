"""Durable files: written whole or not at all, checksummed, and checked when read.

[Note: a checkpoint is committed by renames]
Every file is written, flushed and fsynced before anything points at it; the checkpoint's
directory is written under a temporary name and renamed to its tag only once every rank's files
and the manifest are on disk; `latest` is replaced (written to a temporary file, fsynced,
renamed) last. A rename is atomic, and each directory holding a renamed entry is fsynced after
it, so a process killed at any moment, or a disk that fills, leaves either the previous state
or the new one, never a mixture: `latest` always names a complete checkpoint.
"""

from __future__ import annotations

import errno
import io
import os
from typing import Iterable, Optional

from fxzero.runtime.checkpoint.format import xxh3, xxh3_hexdigest


__all__ = ["ChecksumWriter", "CheckpointError", "checksum_file", "fsync_dir", "read_exact", "replace_file",
           "space_error"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as it is: names the file and what is wrong."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes) -> None:
    """Write `data` to `path` atomically (a temporary file, fsynced, renamed over it)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


class ChecksumWriter:
    """Appends blobs to one file, hashing the file as a whole and each blob alone (XXH3-64, as the
    NVMe tier: [Note] on `Record` in storage/tier.py); `close()` fsyncs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "wb")
        self._whole = xxh3()
        self.size = 0

    def append(self, blob: bytes | memoryview) -> tuple[int, int, str]:
        """Write `blob`; its (offset, length, checksum)."""
        offset = self.size
        self._file.write(blob)
        self._whole.update(blob)
        self.size += len(blob)
        return offset, len(blob), xxh3_hexdigest(blob)

    @property
    def checksum(self) -> str:
        return self._whole.hexdigest()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()


def checksum_file(path: str, block: int = 16 << 20) -> str:
    h = xxh3()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def read_exact(path: str, offset: int, length: int, checksum: Optional[str], what: str) -> io.BytesIO:
    """`length` bytes of `path` at `offset`, checked against `checksum` (None: unchecked)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise CheckpointError(f"{path}: truncated: {what} needs bytes [{offset}, {offset + length}) and the file "
                              f"has {os.path.getsize(path)}; the checkpoint is incomplete, load another one")
    if checksum is not None and xxh3_hexdigest(data) != checksum:
        raise CheckpointError(f"{path}: {what} (bytes [{offset}, {offset + length})) does not match its checksum: the "
                              "file was changed or damaged after it was written; load another checkpoint")
    return io.BytesIO(data)


def space_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def total_size(paths: Iterable[str]) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.exists(p))

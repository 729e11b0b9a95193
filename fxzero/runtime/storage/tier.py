"""The storage tier interface: keyed flat tensors, asynchronous writes and reads, counters.

Every tier offers `write(key, tensor) -> Pending`, `read(key, out=None) -> Pending`,
`delete(key)`, `nbytes(key)`, `reserve(total_bytes)` and `report()`; `Pending.wait()` returns
the tensor. A tensor passed to `write` must not be modified, and `out` passed to `read` must not
be used, until the `Pending` has been waited on. The tiers: `memory.DeviceTier`,
`memory.CpuTier`, `nvme.NvmeTier`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = ["Pending", "Record", "StorageTier", "Traffic", "rank_prefix"]


def rank_prefix() -> str:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"[rank {rank}]"


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


class Record(NamedTuple):
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
        self._index: dict[str, Record] = {}
        self._traffic = {"read": Traffic(), "write": Traffic()}
        self._lock = threading.Lock()  # guards _index and _traffic against the I/O workers

    def _count(self, kind: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            t = self._traffic[kind]
            t.calls += 1
            t.bytes += nbytes
            t.seconds += seconds

    def _record(self, key: str) -> Record:
        with self._lock:
            rec = self._index.get(key)
        if rec is None:
            raise KeyError(f"{rank_prefix()} {self.name} tier has no key {key!r} "
                           f"({len(self._index)} keys stored); write it before reading it")
        return rec

    @staticmethod
    def _check_out(key: str, rec: Record, out: torch.Tensor) -> None:
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

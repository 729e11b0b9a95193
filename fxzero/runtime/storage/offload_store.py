"""Where this rank's offloaded model states live: one storage tier per placement.

`OffloadStore` turns the config's placements (`fxzero.Offload`) into storage tiers
(`fxzero/runtime/storage/`) and keys ("param/blocks.3", "exp_avg/blocks.3", Adagrad's
"sum/blocks.3", ...), and is what the executor's fetch and offload instructions call. Each NVMe
placement gets its own directory for this rank, `<path>/fxzero-rank<N>-<pid>`, created here and
removed by `close()`.

[Note: stale rank directories]
A process killed before `close()` (kill -9, a crash, the OOM killer) leaves its directory
behind. Each directory holds an `owner.json` (host and boot, pid); when a rank creates its own,
it first removes those whose owner is this host and a process that no longer runs, and warns
naming each with its size. Directories of other hosts (a shared file system), of live processes
or without an owner file are left alone.

[Note: space is checked before training]
Before anything is written, `reserve` asks each tier whether this rank's states fit (with the
NVMe file headers and padding), counting every rank of this machine that shares the disk: a full
disk is an error naming the bytes needed at start-up, not a failed write mid-step. A disk that
something else fills later fails a write mid-step all the same: that is a `DiskFull` error at the
write's next wait (or, with write-behind, at the next fetch, write or drain), naming the path,
the key and its bytes, and the key then reads as an error, never as older data or as zeros
(storage: [Note: a failed write]).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import warnings
import weakref
from typing import Optional

import torch

from fxzero.config import AdamW, Cpu, Nvme, Offload, OptimizerPolicy, Placement, state_kinds
from fxzero.runtime.storage import nvme_format
from fxzero.runtime.storage.aligned import aligned_empty
from fxzero.runtime.storage.memory import CpuTier
from fxzero.runtime.storage.nvme import NvmeTier
from fxzero.runtime.storage.tier import Pending, StorageTier
from fxzero.runtime.storage.write_behind import WriteBehind

__all__ = ["OffloadStore", "bytes_on_tiers", "ranks_per_host"]


def _local_ranks() -> int:
    """Ranks of this job on this machine (they share its disks), as the launcher says."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def ranks_per_host(comm) -> int:
    """Ranks of `comm` on this rank's machine (this boot), counted: two torchrun "nodes" on one
    host each set a LOCAL_WORLD_SIZE of their own, and both share the disk. Collective."""
    hosts = comm.all_gather_object(_host())
    return sum(h == hosts[comm.rank] for h in hosts)


def _nvme_dir(placement: Nvme, rank: int, index: "int | str" = 0) -> str:
    """This rank's directory under the placement's path; `index` tells apart the directories of
    two placements on one path (DeepSpeed configs give offload_param and offload_optimizer the
    same nvme_path, with different buffer counts: two tiers, one disk; "activations": the saved
    activations', `fxzero/runtime/activation_store.py`). A numbered directory another engine of
    this process holds (two engines on one path) is passed over for the next number."""
    if not os.path.isdir(placement.path):
        raise ValueError(
            f"[rank {rank}] Nvme(path={placement.path!r}): no such directory; create it (mkdir -p) "
            "or point nvme_path at an existing directory on the fast disk"
        )
    if not os.access(placement.path, os.W_OK | os.X_OK):
        raise ValueError(
            f"[rank {rank}] Nvme(path={placement.path!r}) is not writable by this user; fix its "
            "permissions or choose another directory"
        )
    _remove_stale_dirs(placement.path, rank)
    base = os.path.join(placement.path, f"fxzero-rank{rank}-{os.getpid()}")
    while True:
        path = base + (f"-{index}" if index else "")
        try:
            os.makedirs(path, exist_ok=False)
            with open(os.path.join(path, _OWNER), "w") as f:
                json.dump({"host": _host(), "pid": os.getpid()}, f)
            return path
        except FileExistsError:
            if not isinstance(index, int):
                raise AssertionError(f"{path} exists: activation stores are numbered per process")
            index += 1  # another engine of this process on this path (a second initialize, actor and critic)
        except OSError as e:
            raise ValueError(
                f"[rank {rank}] Nvme(path={placement.path!r}): cannot create this rank's directory there "
                f"({e.strerror or e}); choose a writable directory on the fast disk"
            ) from e


_OWNER = "owner.json"
_RANK_DIR = re.compile(r"fxzero-rank\d+-\d+(-\d+|-activations\d*)?")


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove_stale_dirs(root: str, rank: int) -> None:
    """[Note: stale rank directories] Remove the rank directories under `root` that a process
    which died without closing its engine (kill -9, a crash) left behind: those whose owner file
    names this host (this boot) and a process that no longer runs. A directory of another host
    (a shared file system) or of a live process is never touched."""
    here = _host()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not _RANK_DIR.fullmatch(name) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, _OWNER)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # not ours to judge (being created now, or from an older fxzero)
        if owner.get("host") != here or _alive(int(owner.get("pid", -1))):
            continue
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        shutil.rmtree(path, ignore_errors=True)
        warnings.warn(f"[rank {rank}] removed {path} ({size} bytes): the offloaded states of process "
                      f"{owner['pid']}, which is no longer running (killed before engine.close())",
                      stacklevel=4)


def _close_all(tiers: list[StorageTier], dirs: list[str]) -> None:
    for tier in tiers:
        tier.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


class OffloadStore:
    """This rank's offloaded states, by (state kind, unit).

    Args:
        offload: the config's placements; kinds on `Device()` are not stored here.
        rank: for error messages and directory names.
        optimizer: the optimizer policy, whose declared states are stored with `offload.optimizer`
            and read as its `initial_value` until first written.
    """

    def __init__(self, offload: Offload, rank: int, optimizer: OptimizerPolicy = AdamW(),
                 local_ranks: Optional[int] = None) -> None:
        self.rank = rank
        self.local_ranks = local_ranks if local_ranks is not None else _local_ranks()
        """Ranks sharing this machine's disks (`ranks_per_host`; the launcher's LOCAL_WORLD_SIZE
        where not counted)."""
        self.offload = offload
        self.optimizer = optimizer
        self._tiers: dict[Placement, StorageTier] = {}
        self._behind: dict[Placement, WriteBehind] = {}
        self._dirs: list[str] = []
        for kind in state_kinds(optimizer):
            placement = offload.placement(kind)
            if not offload.offloaded(kind) or placement in self._tiers:
                continue
            if isinstance(placement, Nvme):
                path = _nvme_dir(placement, rank, len(self._dirs))
                self._dirs.append(path)
                self._tiers[placement] = NvmeTier(
                    path, threads=placement.threads, block_bytes=placement.block_bytes, direct=placement.direct
                )
                if placement.write_behind_bytes:
                    self._behind[placement] = WriteBehind(self._tiers[placement], placement.write_behind_bytes)
            elif isinstance(placement, Cpu):
                self._tiers[placement] = CpuTier(pin=placement.pin_memory and torch.cuda.is_available())
            else:
                raise AssertionError(placement)
        # Files are scratch for this run: removed at close() or when the store is collected.
        self._finalizer = weakref.finalize(self, _close_all, list(self._tiers.values()), list(self._dirs))

    # -- where ---------------------------------------------------------------------------------

    def offloaded(self, kind: str) -> bool:
        return self.offload.offloaded(kind)

    def tier(self, kind: str) -> StorageTier:
        return self._tiers[self.offload.placement(kind)]

    @staticmethod
    def key(kind: str, unit: str) -> str:
        return f"{kind}/{unit}"

    def reserve(self, bytes_per_kind: dict[str, int]) -> None:
        """Check every tier has room for these states (see [Note: space is checked before training])."""
        need: dict[Placement, int] = {}
        for kind, nbytes in bytes_per_kind.items():
            if self.offloaded(kind):
                placement = self.offload.placement(kind)
                need[placement] = need.get(placement, 0) + nbytes
        for placement, nbytes in need.items():
            tier = self._tiers[placement]
            total = nbytes * self.local_ranks if isinstance(placement, Nvme) else nbytes
            try:
                tier.reserve(total)
            except ValueError as e:
                self.close()  # leave nothing behind
                where = placement.path if isinstance(placement, Nvme) else "host memory"
                raise ValueError(
                    f"[rank {self.rank}] not enough room for the offloaded model states in {where}: "
                    f"{total} bytes needed for {self.local_ranks} rank(s) on this machine. {e}"
                ) from None

    @staticmethod
    def stored_bytes(placement: Placement, nbytes: int) -> int:
        """Bytes a tensor of `nbytes` takes on `placement` (NVMe: a header block and padding)."""
        return nvme_format.file_size(nbytes) if isinstance(placement, Nvme) else nbytes

    # -- moving --------------------------------------------------------------------------------

    def put(self, kind: str, unit: str, value: torch.Tensor) -> None:
        """Store `value` now (blocking): initial parameters, a loaded checkpoint's, a value set
        through the state APIs. A write-behind copy of the key is dropped: a read would get it."""
        behind = self._behind.get(self.offload.placement(kind))
        if behind is not None:
            behind.forget(self.key(kind, unit))
        self.tier(kind).write(self.key(kind, unit), value).wait()

    def fetch(self, kind: str, unit: str, numel: int, dtype: torch.dtype, pool=None) -> Pending:
        """Start reading a state (into a buffer from `pool`, a BufferPool, if given); an optimizer
        state never written yet (before the first step) reads as its policy's initial value:
        zeros for AdamW's moments, `initial_accumulator_value` for Adagrad's sum.

        Buffers are aligned, so reading into them and writing them back needs no staging copy
        (storage: [Note: in place]).
        """
        key = self.key(kind, unit)
        tier = self.tier(kind)
        out = pool.take(numel, dtype, aligned=True) if pool is not None else aligned_empty(numel, dtype)
        behind = self._behind.get(self.offload.placement(kind))
        if behind is not None:
            behind.reclaim()
            copy = behind.lookup(key)
            if copy is not None:  # written lately and still in memory: no disk
                out.view(-1).copy_(copy)
                return Pending(None, out)
        if kind in self.optimizer.states and key not in tier:
            return Pending(None, out.fill_(self.optimizer.initial_value(kind)))
        return tier.read(key, out)

    def write(self, kind: str, unit: str, value: torch.Tensor) -> Pending:
        """Start writing a state; `value` must not change until the Pending is waited for
        (with write-behind it is copied, and the Pending is done at once)."""
        behind = self._behind.get(self.offload.placement(kind))
        if behind is not None:
            # A parameter shard (or its low-precision copy) is the next forward's first read.
            return behind.write(self.key(kind, unit), value, keep_until_read=kind in ("param", "low"))
        return self.tier(kind).write(self.key(kind, unit), value)

    def drain(self) -> None:
        """Wait for every write-behind in flight, raising a failed write's error."""
        for behind in self._behind.values():
            behind.drain()

    def get(self, kind: str, unit: str) -> torch.Tensor:
        return self.tier(kind).read(self.key(kind, unit)).wait()

    def has(self, kind: str, unit: str) -> bool:
        behind = self._behind.get(self.offload.placement(kind))
        key = self.key(kind, unit)
        return key in self.tier(kind) or (behind is not None and key in behind)

    # -- reports -------------------------------------------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """Bytes stored per tier name (unpadded tensor bytes)."""
        out: dict[str, int] = {}
        for tier in self._tiers.values():
            out[tier.name] = out.get(tier.name, 0) + sum(tier.nbytes(k) for k in tier.keys())
        return out

    def report(self, reset: bool = False) -> dict[str, dict]:
        """Per tier: bytes, seconds, calls and GB/s each way since the last reset (and reads
        served from write-behind memory)."""
        out = {tier.name: tier.report(reset) for tier in self._tiers.values()}
        for placement, behind in self._behind.items():
            out[self._tiers[placement].name]["write_behind_hits"] = behind.hits
            if reset:
                behind.hits = 0
        return out

    def close(self) -> None:
        """Finish the I/O in flight, stop the workers and remove this rank's NVMe files."""
        self._finalizer()


def bytes_on_tiers(offload: Offload, layouts: list, whole: frozenset[str],
                   low_dtype: Optional[torch.dtype] = None, optimizer: OptimizerPolicy = AdamW(),
                   state_dtype: Optional[torch.dtype] = None) -> dict[str, int]:
    """Bytes each offloadable state kind takes on its tier, for one rank (`OffloadStore.reserve`).

    `whole`: units held whole (their parameters are never offloaded); with step_in_backward only
    those units' gradients are ever stored. `low_dtype`: mixed precision's, whose copy of each
    offloaded parameter shard lives beside its fp32 master. `optimizer`: its declared states,
    one shard each per trainable unit, in `state_dtype` (None: the layouts' dtype).
    """
    sharded = [lay for lay in layouts if lay.name not in whole]
    trainable = [lay for lay in layouts if lay.trainable]

    def on_tier(kind: str, units) -> int:
        placement = offload.placement(kind)
        itemsize = state_dtype.itemsize if kind in optimizer.states and state_dtype is not None else None
        return sum(OffloadStore.stored_bytes(placement, lay.shard_numel * (itemsize or lay.itemsize)) for lay in units)

    stored_grads = [lay for lay in trainable if lay.name in whole] if offload.step_in_backward else trainable
    low = 0
    if low_dtype is not None:
        low = sum(OffloadStore.stored_bytes(offload.placement("low"), lay.shard_numel * low_dtype.itemsize)
                  for lay in sharded if offload.offloaded("param"))
    return {
        "param": on_tier("param", sharded),
        "low": low,
        "grad": on_tier("grad", stored_grads),
        **{state: on_tier(state, trainable) for state in optimizer.states},
    }

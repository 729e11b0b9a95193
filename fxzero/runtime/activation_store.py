"""Saved activations on a storage tier: what the executor's activation offloads and fetches call.

[Note: activations on a tier, at run time]
The offload pass ([Note: activations on a tier] in `fxzero/passes/offload_activations.py`) writes
some saved activations to a tier after their last forward use and reads them back ahead of
their backward use. Here each write goes under a key of its own (a sequence number and the
node's name), never reused: no forward ever reads what another forward wrote. The write's wait
returns a `Receipt`, which the forward saves in the tensor's place (it counts no bytes in
`memory_report()["activations"]`), and the backward's fetch reads the key the receipt names.

The tier is the NVMe store the offloaded model states use (`NvmeTier`: asynchronous reads and
writes on its I/O threads, aligned buffers, a checksum of every file checked at its read), in a
directory of its own beside theirs, `<path>/fxzero-rank<N>-<pid>-activations`. A file is removed

- once its read has finished (the copy is in memory);
- when autograd drops a forward whose backward never ran (the receipt's finalizer);
- at the step's end (`end_step`, called by `engine.step()`): whatever a forward wrote that no
  backward read, so a forward that failed halfway leaves nothing for the next step.

Reads are checked against the size and checksum this process wrote, kept in its memory, so a
file changed underneath is an error, never data; a process that dies leaves its directory, which
the next run on the host removes ([Note: stale rank directories] in `offload_store.py`). On a
CUDA rank `Cpu()` holds them in pinned host memory (`CpuTier`); a CPU rank offloads nothing to
the cpu tier (the pass leaves them: they are in host memory already).
"""

from __future__ import annotations

import functools
import itertools
import shutil
import threading
import weakref
from typing import NamedTuple, Optional, Union

import torch

from fxzero.config import Cpu, Nvme
from fxzero.ir.instruction import Instruction
from fxzero.runtime.storage import nvme_format
from fxzero.runtime.storage.memory import CpuTier
from fxzero.runtime.storage.nvme import NvmeTier
from fxzero.runtime.storage.offload_store import _local_ranks, _nvme_dir
from fxzero.runtime.storage.tier import Pending, StorageTier

__all__ = ["ActivationStore", "Receipt"]

_STORES = itertools.count()
"""This process's activation stores so far: the directory of each is its own (two engines of one
process on one path), `fxzero-rank<N>-<pid>-activations`, then `-activations1`, ... (`_nvme_dir`)."""


class Receipt:
    """What a forward saves for an activation it wrote to the tier: the key to read it back by."""

    __slots__ = ("key", "nbytes", "shape", "stride", "__weakref__")

    def __init__(self, key: str, nbytes: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.key, self.nbytes = key, nbytes
        self.shape, self.stride = shape, stride
        """The layout written (the tensor's own where it was dense): what the read restores."""

    def __repr__(self) -> str:
        return f"Receipt({self.key!r}, {self.nbytes} bytes)"


class _Writing:
    """An activation's write in flight; its wait yields the receipt.

    It lets go of the write's future as soon as the write is done: the future's result is the
    tensor written, and the program waits for its writes only at the forward's end, so holding
    the future until then would hold every offloaded tensor in memory until then."""

    __slots__ = ("future", "error", "receipt", "__weakref__")

    def __init__(self, pending: Pending, receipt: Receipt) -> None:
        self.future, self.error, self.receipt = pending.future, None, receipt
        if self.future is not None:  # (by a weak reference: a done future may outlive this write)
            self.future.add_done_callback(functools.partial(_Writing._done, weakref.ref(self)))

    @staticmethod
    def _done(ref: "weakref.ref[_Writing]", future) -> None:
        writing = ref()
        if writing is not None:
            writing.error = future.exception()
            writing.future = None

    def wait(self) -> Receipt:
        future = self.future
        if future is not None:
            future.result()
        if self.error is not None:
            raise self.error
        return self.receipt


class _Reading(NamedTuple):
    """An activation's read in flight; its wait yields the tensor and removes the file."""

    pending: Pending
    store: "ActivationStore"
    receipt: Receipt

    def wait(self) -> torch.Tensor:
        try:
            return self.pending.wait().as_strided(self.receipt.shape, self.receipt.stride)
        finally:
            self.store._remove(self.receipt.key)


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its storage from its offset on, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((s, d) for d, s in zip(t.shape, t.stride()) if d > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _close(tier: StorageTier, directory: Optional[str]) -> None:
    tier.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class ActivationStore:
    """This rank's saved activations on `placement`'s tier ([Note: activations on a tier, at run time]).

    Args:
        placement: `Activations.offload`.
        rank: for error messages and the directory's name.
    """

    def __init__(self, placement: Union[Cpu, Nvme], rank: int) -> None:
        self.rank = rank
        self._dir: Optional[str] = None
        if isinstance(placement, Nvme):
            n = next(_STORES)
            self._dir = _nvme_dir(placement, rank, f"activations{n or ''}")
            self.tier: StorageTier = NvmeTier(self._dir, threads=placement.threads, block_bytes=placement.block_bytes,
                                              direct=placement.direct)
        else:
            self.tier = CpuTier(pin=placement.pin_memory and torch.cuda.is_available())
        self.current = 0
        """Bytes of activations on the tier now (written or being written, not yet read back)."""
        self.peak = 0
        self._held: dict[str, int] = {}  # key -> bytes, on the tier now
        self._reading: set[str] = set()  # keys whose read is in flight (their receipts may die first)
        self._lock = threading.RLock()  # (receipts' finalizers run on whatever thread collects them)
        self._sequence = itertools.count()
        self._checked: set[str] = set()  # programs whose space was checked
        self._finalizer = weakref.finalize(self, _close, self.tier, self._dir)

    @property
    def tier_name(self) -> str:
        return self.tier.name

    def reserve(self, program: str, instructions: tuple[Instruction, ...]) -> None:
        """Check once per program that its activation writes fit on the tier beside every rank of
        this machine's (a full disk is an error naming the bytes before the first write, not a
        failed write mid-step)."""
        if program in self._checked:
            return
        self._checked.add(program)
        sizes = [i.bytes for i in instructions if i.kind == "offload" and i.state == "activation"]
        if not sizes or not isinstance(self.tier, NvmeTier):
            return
        total = sum(nvme_format.file_size(n) for n in sizes) * _local_ranks()
        try:
            self.tier.reserve(total)
        except ValueError as e:
            raise ValueError(f"[rank {self.rank}] not enough room for the offloaded activations: {total} bytes "
                             f"for {_local_ranks()} rank(s) on this machine. {e}; or keep more of them in memory "
                             "(a larger Activations.offload_min_bytes)") from None

    # -- moving ------------------------------------------------------------------------------------

    def write(self, ins: Instruction, tensor: torch.Tensor) -> _Writing:
        """Start writing a saved activation (the offload instruction `ins`); `tensor` must not
        change until the write's wait (the program is functional: nothing changes it)."""
        key = f"{next(self._sequence)}/{ins.name}"
        nbytes = tensor.numel() * tensor.element_size()
        if not _dense(tensor):  # (the pass chose it dense by its traced layout; this one is not)
            tensor = tensor.contiguous()
        with self._lock:
            self._held[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        receipt = Receipt(key, nbytes, tuple(tensor.shape), tuple(tensor.stride()))
        weakref.finalize(receipt, self._abandon, key)
        # Its storage, in memory order: the read restores the layout (an attention output stays transposed).
        flat = tensor.as_strided((tensor.numel(),), (1,))
        return _Writing(self.tier.write(key, flat), receipt)

    def read(self, receipt: Receipt, numel: int, dtype: torch.dtype, pool) -> _Reading:
        """Start reading an activation back into a buffer from `pool` (the executor's); its wait
        removes the file."""
        with self._lock:
            gone = receipt.key not in self._held
            if not gone:
                self._reading.add(receipt.key)
        if gone:
            raise RuntimeError(
                f"[rank {self.rank}] the saved activation {receipt.key!r} is no longer on the {self.tier.name} tier: "
                "engine.step() ran between its forward and this backward and removed it (a step ends what its "
                "forwards saved); run the backward before step()")
        # A buffer of its own, not the executor's pool's: the backward frees it after its last
        # reader, and the memory goes back to the allocator, for the next forward's activations
        # (a pooled buffer would wait, unused, for the next backward's fetch of its size). Not an
        # aligned buffer either (a view at an offset into a larger one, which O_DIRECT reads into
        # in place): the tensor the backward reads starts its storage, as the one the forward saved
        # did; torch.set_rng_state, given a generator state the forward saved, reads the storage
        # from its start (a replayed dropout's state: [Note: replaying random operators]).
        out = torch.empty(numel, dtype=dtype, device=pool.device)
        return _Reading(self.tier.read(receipt.key, out), self, receipt)

    def _remove(self, key: str) -> None:
        with self._lock:
            nbytes = self._held.pop(key, None)
            self._reading.discard(key)
            if nbytes is None:
                return
            self.current -= nbytes
        try:
            self.tier.delete(key)
        except (KeyError, OSError):
            pass  # (a write that failed left no record; its error was raised at its wait)

    def _abandon(self, key: str) -> None:
        """A receipt died: its forward's backward will not read it (unless the read has begun)."""
        with self._lock:
            if key in self._reading:
                return
        self._remove(key)

    def end_step(self) -> None:
        """Remove whatever this step's forwards wrote that no backward read."""
        with self._lock:
            left = [k for k in self._held if k not in self._reading]
        for key in left:
            self._remove(key)

    def report(self, reset: bool = False) -> dict:
        return self.tier.report(reset)

    def close(self) -> None:
        """Finish the I/O in flight, stop the workers and remove the directory."""
        self._finalizer()

"""Collectives through shared memory, for ranks on one host with CPU buffers.

gloo moves every byte of a collective through TCP over loopback: a copy into the kernel by the
sender, a copy out by the receiver, and gloo's own threads and the kernel's TCP stack on the
same cores that compute. On a two-core box at 1B parameters that was about 8 s of CPU per rank
per step (`tools/profile_step.py`, per-thread CPU time), a quarter of the step. Ranks on one
host can instead read each other's buffers: `ShmComm` maps one segment per rank from /dev/shm
and runs each collective as copies and sums in and out of those segments, with a barrier on a
gloo group of its own between the writes and the reads. What stays on gloo is only that
barrier (a few bytes).

[Note: shared-memory collectives]
Each rank owns a segment of two halves (ping-pong), each `world_size * chunk_bytes` long. A
collective is cut into steps of at most one half; step s uses half s % 2 on every rank:

    write my part of this step into my half;  barrier;  read what I need from every rank's half

A rank writes half s % 2 again only at step s + 2, after barrier s + 1, which every rank enters
only once it has finished reading step s: one barrier per step is enough, and the step counter
runs on across collectives. Collectives run one at a time, in the order they were issued, on a
single worker thread per rank; as with any process group, every rank must issue the same
collectives in the same order (the static schedule does).

- all-gather: write my shard's slice; read every rank's slice into its place in the output.
- reduce-scatter: write the piece of my flat buffer each other rank owns; sum, in rank order,
  every rank's piece of my slice (mine read from my own buffer).
- all-reduce: write my slice of the buffer; every rank sums all ranks' slices in rank order,
  so every rank computes the same bits.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import mmap
import os
import socket
import uuid
from typing import Optional

import torch
import torch.distributed as dist

from fxzero.config import LinkEmulation
from fxzero.runtime.comm.base import Comm

__all__ = ["ShmComm", "shared_memory_unavailable"]

SHM_DIR = "/dev/shm"
CHUNK_BYTES = 8 << 20
"""Bytes of one rank's piece per step: a segment is 2 * world_size * CHUNK_BYTES."""


def _host_id() -> str:
    """Equal for two ranks exactly when they can map each other's files in SHM_DIR: the same
    machine (hostname, boot) and the same shared-memory mount (two containers with one hostname,
    `--network host` say, have one boot id but separate /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(SHM_DIR)
        mount = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        mount = ""
    return f"{socket.gethostname()}/{boot}/{mount}"


def shared_memory_unavailable(comm: Comm, chunk_bytes: int = CHUNK_BYTES) -> Optional[str]:
    """Why the ranks of `comm` cannot share memory (None if they can). Collective: every rank calls it."""
    free = -1
    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:
        pass
    need = 2 * comm.world_size * chunk_bytes
    facts = comm.all_gather_object((_host_id(), free, dist.get_backend(comm.group)))
    hosts = {h for h, _, _ in facts}
    if len(hosts) > 1:
        return f"the ranks run on {len(hosts)} hosts"
    if facts[0][2] != "gloo":
        return f"the process group's backend is {facts[0][2]}, not gloo (CPU buffers)"
    short = [r for r, (_, f, _) in enumerate(facts) if f < need]
    if short:
        return (f"{SHM_DIR} is missing or has under {need} bytes free on rank(s) {short} "
                f"(each rank maps {need} bytes)")
    return None


class _Segment:
    """One rank's shared segment, mapped; `half(p)` is a flat uint8 tensor over half p."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.half_bytes = nbytes // 2

    def half(self, parity: int) -> torch.Tensor:
        return self.bytes[parity * self.half_bytes : (parity + 1) * self.half_bytes]


class _Done:
    """The work handle of a collective queued on the worker (dist.Work's wait())."""

    def __init__(self, future: concurrent.futures.Future, what: str, rank: int) -> None:
        self.future, self.what, self.rank = future, what, rank

    def wait(self) -> bool:
        try:
            self.future.result()
        except Exception as e:
            raise RuntimeError(f"[rank {self.rank}] shared-memory {self.what} failed: {e}") from e
        return True


class _Transport:
    """The segments, the barrier group, the worker and the step counter, shared by every
    `ShmComm` over one process group (engines come and go; collectives stay in issue order)."""

    def __init__(self, comm: Comm, chunk_bytes: int, timeout_s: Optional[float] = None) -> None:
        self.rank, self.world_size, self.chunk_bytes = comm.rank, comm.world_size, chunk_bytes
        # Barriers only, off the data group; they give up after the collective timeout.
        timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        self.sync = dist.new_group(backend="gloo", **timeout)
        token = comm.all_gather_object(uuid.uuid4().hex)[0]
        paths = [os.path.join(SHM_DIR, f"fxzero-{token}-{r}") for r in range(self.world_size)]
        self.paths = tuple(paths)  # (each unlinked below, once every rank mapped them)
        nbytes = 2 * self.world_size * chunk_bytes
        mine = _Segment(paths[self.rank], nbytes, create=True)
        try:
            dist.barrier(group=self.sync)
            self.segments = [mine if r == self.rank else _Segment(p, nbytes, create=False)
                             for r, p in enumerate(paths)]
            dist.barrier(group=self.sync)
        finally:
            os.unlink(paths[self.rank])  # mapped everywhere now (or failed): no file is left behind
        self.step = 0
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fxzero-shm")

    def submit(self, what: str, fn, *args) -> _Done:
        return _Done(self.worker.submit(fn, *args), what, self.rank)

    def halves(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's half for the next step, as `dtype`."""
        parity = self.step % 2
        self.step += 1
        return [seg.half(parity).view(dtype) for seg in self.segments]

    def barrier(self) -> None:
        dist.barrier(group=self.sync)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        n, w = shard.numel(), self.world_size
        step = w * self.chunk_bytes // shard.element_size()
        for a in range(0, n, step):
            b = min(n, a + step)
            halves = self.halves(shard.dtype)
            halves[self.rank][: b - a].copy_(shard[a:b])
            self.barrier()
            for q in range(w):
                out[q * n + a : q * n + b].copy_(halves[q][: b - a])

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        n, w, r = out.numel(), self.world_size, self.rank
        step = self.chunk_bytes // flat.element_size()
        for a in range(0, n, step):
            b = min(n, a + step)
            k = b - a
            halves = self.halves(flat.dtype)
            for q in range(w):
                if q != r:  # rank q reads piece q of my half
                    halves[r][q * k : (q + 1) * k].copy_(flat[q * n + a : q * n + b])
            self.barrier()
            pieces = [flat[r * n + a : r * n + b] if q == r else halves[q][r * k : (r + 1) * k] for q in range(w)]
            _sum_into(out[a:b], pieces)

    def all_reduce(self, flat: torch.Tensor) -> None:
        n, w = flat.numel(), self.world_size
        step = w * self.chunk_bytes // flat.element_size()
        for a in range(0, n, step):
            b = min(n, a + step)
            halves = self.halves(flat.dtype)
            halves[self.rank][: b - a].copy_(flat[a:b])
            self.barrier()
            # Every rank sums the same values in the same order (its own from shared memory too).
            _sum_into(flat[a:b], [h[: b - a] for h in halves])


def _sum_into(out: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """out = pieces[0] + pieces[1] + ..., left to right (a fixed order: deterministic)."""
    if len(pieces) == 1:
        out.copy_(pieces[0])
        return
    torch.add(pieces[0], pieces[1], out=out)
    for p in pieces[2:]:
        out.add_(p)


_TRANSPORTS: dict = {}
"""Process group -> its _Transport (the group is held, so its identity is never reused)."""


class ShmComm(Comm):
    """`Comm` whose collectives on CPU buffers go through shared memory; see the module doc.

    Collective to construct the first time per process group (maps every rank's segment).
    Buffers on other devices fall back to the process group's collectives.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, link: Optional[LinkEmulation] = None,
                 chunk_bytes: int = CHUNK_BYTES, timeout_s: Optional[float] = None) -> None:
        super().__init__(group, link)
        key = (group or dist.group.WORLD, chunk_bytes)
        if key not in _TRANSPORTS:
            _TRANSPORTS[key] = _Transport(self, chunk_bytes, timeout_s)
        self._transport = _TRANSPORTS[key]

    @property
    def mapped_bytes(self) -> int:
        """Every rank's segment, mapped here: 2 * world_size**2 * chunk_bytes."""
        return sum(len(seg.map) for seg in self._transport.segments)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor):
        if shard.device.type != "cpu":
            return super()._all_gather(out, shard)
        return self._transport.submit("all_gather", self._transport.all_gather, out.view(-1), shard.reshape(-1))

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor):
        if flat.device.type != "cpu":
            return super()._reduce_scatter(out, flat)
        return self._transport.submit("reduce_scatter", self._transport.reduce_scatter, out.view(-1), flat.reshape(-1))

    def _all_reduce(self, flat: torch.Tensor):
        if flat.device.type != "cpu":
            return super()._all_reduce(flat)
        return self._transport.submit("all_reduce", self._transport.all_reduce, flat.view(-1))

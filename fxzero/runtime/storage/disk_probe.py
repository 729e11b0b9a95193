"""The disk under an `Nvme` placement, measured as the cost model prices it.

`Config(cost_model="measure")` calibrates this machine's compute and collectives at start-up
(`fxzero/cost/calibrate.py`); a config that places anything on NVMe also has its disk measured
here, so that the passes that weigh a transfer against compute (the activation budget's planner,
the offload pass's lead times) see the disk the run will use, not a preset's. Disks differ far
more than CPUs do: the development machines' virtual disks wrote at 2.3 GB/s on one and at 0.25
GB/s per rank, two ranks writing at once, on another, where the preset priced 2.3 and the
planner offloaded what it should have recomputed.

Every rank writes and reads its own probe files at once, through the `NvmeTier` the run uses
(its threads, block size and O_DIRECT), so each rank measures its share of a disk the ranks of a
host share, as the cost model's `io` links mean it. Then each times matmuls alone and beside a
write in flight: on a CPU rank the I/O threads take cores from the compute (the cost model's
`io_interference`). Every rank takes rank 0's figures, so every rank compiles the same program.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Sequence

import torch

from fxzero.config.placement import Nvme
from fxzero.cost.model import CostModel, Link
from fxzero.runtime.storage.nvme import NvmeTier

__all__ = ["PROBE_BYTES", "measure_disk", "measure_interference", "nvme_placements", "with_measured_disks"]

PROBE_BYTES = 32 << 20
"""Bytes each rank writes and reads back per probe: long enough that the rate, not the latency
of the first block, dominates (0.04 s at 1 GB/s), short enough for a compile."""

LATENCY_S = 1e-4
"""Per transfer, as the presets state it (the probe measures a rate)."""

_MEASURED: dict = {}
"""(io links, io interference) per (directories, world size), or None where no rank could
probe: measured once a process."""


def measure_disk(nvme, nbytes: int = PROBE_BYTES) -> dict[str, Link]:
    """Write `nbytes` under `nvme.path` and read them back (as `threads` tensors in flight at
    once, the tier's workers each taking one); the rates as "nvme_write" / "nvme_read" links."""
    threads = max(1, nvme.threads)
    tensors = _tensors(nbytes, threads)
    with tempfile.TemporaryDirectory(prefix=".fxzero-disk-probe-", dir=nvme.path) as directory:
        tier = NvmeTier(directory, threads=nvme.threads, block_bytes=nvme.block_bytes, direct=nvme.direct)
        try:
            keys = [f"probe{i}" for i in range(threads)]
            start = time.perf_counter()
            for pending in [tier.write(k, t) for k, t in zip(keys, tensors)]:
                pending.wait()
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            for pending in [tier.read(k) for k in keys]:
                pending.wait()
            read_s = time.perf_counter() - start
            for k in keys:
                tier.delete(k)
        finally:
            tier.close()
    moved = sum(t.numel() * 4 for t in tensors)
    return {"nvme_write": Link(bandwidth=moved / max(write_s, 1e-9), latency=LATENCY_S),
            "nvme_read": Link(bandwidth=moved / max(read_s, 1e-9), latency=LATENCY_S)}


def _tensors(nbytes: int, threads: int) -> list[torch.Tensor]:
    per = max(nbytes // threads // 4, 1)
    return [torch.full((per,), float(i), dtype=torch.float32) for i in range(threads)]


def measure_interference(nvme, write: Link, seconds: float = 0.25) -> float:
    """How much a write to the disk under `nvme.path` in flight slows matmuls on this rank:
    compute overlapping one second of the write takes this many seconds longer (the cost model's
    `io_interference`; 0 to 2). The write lasts about `seconds` at the measured `write` rate."""
    g = torch.Generator().manual_seed(0)  # (a generator of its own: compiling never moves the global RNG)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 1536, generator=g)
    a @ b
    per_matmul = min(_seconds(lambda: a @ b) for _ in range(3))
    count = max(1, round(seconds / max(per_matmul, 1e-6)))
    alone = _seconds(lambda: [a @ b for _ in range(count)])
    nbytes = int(min(max(write.bandwidth * seconds, 8 << 20), 128 << 20))
    tensors = _tensors(nbytes, max(1, nvme.threads))
    with tempfile.TemporaryDirectory(prefix=".fxzero-disk-probe-", dir=nvme.path) as directory:
        tier = NvmeTier(directory, threads=nvme.threads, block_bytes=nvme.block_bytes, direct=nvme.direct)
        try:
            start = time.perf_counter()
            pending = [tier.write(f"probe{i}", t) for i, t in enumerate(tensors)]
            with_io = _seconds(lambda: [a @ b for _ in range(count)])
            for p in pending:
                p.wait()
            write_s = time.perf_counter() - start
            for i in range(len(tensors)):
                tier.delete(f"probe{i}")
        finally:
            tier.close()
    overlap = min(write_s, with_io)
    return min(max((with_io - alone) / max(overlap, 1e-9), 0.0), 2.0)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def with_measured_disks(cost_model: CostModel, placements: Sequence, comm=None) -> CostModel:
    """`cost_model` with its NVMe links measured on the disks of `placements` (the config's
    `Nvme` placements; others are ignored): the slowest disk's rates, and how much its writes
    slow this rank's compute (`io_interference`), rank 0's figures on every rank. Collective
    when `comm` spans ranks (every rank takes part, its config naming the same directories);
    once a process per set of directories."""
    paths = tuple(sorted({p.path for p in placements if isinstance(p, Nvme)}))
    if not paths:
        return cost_model
    world = getattr(comm, "world_size", 1)
    key = (paths, world)
    if key not in _MEASURED:
        # (A directory that is missing or not writable here is left to the tier's own check,
        # which names the problem and the fix when the run opens it; this rank still takes its
        # part in the collectives below, so no rank waits on it.)
        usable: dict[str, Nvme] = {}
        for placement in placements:
            if isinstance(placement, Nvme) and os.path.isdir(placement.path) and os.access(placement.path, os.W_OK):
                usable.setdefault(os.path.realpath(placement.path), placement)
        _line_up(comm)  # every rank's probe at once, as the ranks' transfers run
        measured = {path: measure_disk(placement) for path, placement in sorted(usable.items())}
        _line_up(comm)
        figures = None
        if measured:
            slowest = min(measured, key=lambda path: measured[path]["nvme_write"].bandwidth)
            links = {kind: min((m[kind] for m in measured.values()), key=lambda link: link.bandwidth)
                     for kind in ("nvme_write", "nvme_read")}
            figures = (links, measure_interference(usable[slowest], measured[slowest]["nvme_write"]))
        if comm is not None and world > 1:
            figures = next((f for f in comm.all_gather_object(figures) if f is not None), None)
        _MEASURED[key] = figures
    if _MEASURED[key] is None:
        return cost_model
    links, interference = _MEASURED[key]
    return dataclasses.replace(cost_model, io={**cost_model.io, **links}, io_interference=interference)


def _line_up(comm) -> None:
    if comm is not None and comm.world_size > 1:
        comm.all_gather(torch.empty(comm.world_size), torch.zeros(1), count=False).wait()


def nvme_placements(config) -> list:
    """Every `Nvme` placement a config names: offloaded states and activations."""
    offload = config.offload
    found = [offload.params, offload.optimizer, offload.grads_placement, config.activations.offload]
    return [p for p in found if isinstance(p, Nvme)]

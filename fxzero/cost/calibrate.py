"""Calibration: the machine at hand measured as a cost model.

`calibrate()` times a matmul probe, a copy probe and, in a process group, an all-gather /
reduce-scatter / all-reduce sweep; `resolve(spec, comm)` turns `Config.cost_model` into a cost
model (calibrating once per process and link, every rank taking rank 0's figures).
"""

from __future__ import annotations

import time

import torch

from fxzero.cost.model import CostModel, Link
from fxzero.cost.presets import PRESETS, preset

__all__ = ["calibrate", "resolve"]


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _sustained(fn, seconds: float = 0.25) -> float:
    """Mean seconds per call of `fn` over about `seconds` of calls.

    A compute probe's rate is what a step will see, not a best case: on a shared machine the
    rate of one short call swings (back-to-back 10 ms matmul probes a second apart measured 53
    to 100 GFLOP/s on the 2-core development box), so the probe runs long enough to average.
    """
    once = _time(fn, 1)
    calls = max(3, min(200, int(seconds / max(once, 1e-6))))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _fit(points: list[tuple[float, float]]) -> Link:
    """latency + bytes / bandwidth through (bytes, seconds) points: latency from the smallest
    message, bandwidth from the largest (the slope between them; timing noise cannot make it
    faster than the largest message alone allows)."""
    (x0, t0), (x1, t1) = points[0], points[-1]
    latency = t0
    bandwidth = (x1 - x0) / (t1 - t0) if t1 - t0 > 0.1 * t1 else x1 / t1
    return Link(bandwidth=bandwidth, latency=latency)


def calibrate(*, comm=None, sizes: tuple[int, ...] = (1 << 12, 1 << 23), name: str = "measured") -> CostModel:
    """Measure this machine: matmul rate, memory bandwidth, op overhead, and (given a Comm of
    a process group) an all-gather / reduce-scatter / all-reduce sweep fit to latency + bytes/bw.

    Every rank of `comm` must call it together.
    """
    # A transformer-shaped matmul (tokens x width @ width x 3 width), and a copy far larger
    # than the caches, so neither probe measures a best case the model never sees.
    # (Drawn from a generator of its own: compiling never moves the global RNG a script seeded.)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 1536, generator=g)
    big = torch.empty(1 << 24)
    src = torch.randn(1 << 24, generator=g)
    if comm is not None and comm.world_size > 1:  # every rank computes at once, as in a step
        comm.all_gather(torch.empty(comm.world_size), torch.zeros(1), count=False).wait()
    flops = 2 * 512 * 512 * 1536 / _sustained(lambda: a @ b)
    mem = 2 * big.numel() * 4 / _sustained(lambda: big.copy_(src), 0.15)
    tiny = torch.ones(8)
    overhead = _time(lambda: [torch.ops.aten.add.Tensor(tiny, tiny) for _ in range(200)], 3) / 200
    links: dict[str, Link] = {}
    world = 1 if comm is None else comm.world_size
    if comm is not None and world > 1:
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            points = []
            for size in sizes:
                flat = torch.ones(size)
                shard = torch.ones(size // world)
                if kind == "all_gather":
                    op = lambda: comm.all_gather(flat, shard, count=False).wait()  # noqa: E731
                elif kind == "reduce_scatter":
                    op = lambda: comm.reduce_scatter(shard, flat, count=False).wait()  # noqa: E731
                else:
                    op = lambda: comm.all_reduce(flat, count=False).wait()  # noqa: E731
                # Small messages time a barrier or two, noisy: more repeats (the best one counts).
                points.append((size * 4 * (world - 1) / world, _time(op, 5 if size < 1 << 20 else 3)))
            links[kind] = _fit(points)
        interference = _interference(comm, links["all_gather"], lambda: a @ b)
    else:
        links = dict(PRESETS["cpu-loopback"].links)
        interference = PRESETS["cpu-loopback"].comm_interference
    return CostModel(
        name=name, flops_per_s=flops, mem_bytes_per_s=mem, op_overhead_s=overhead, links=links,
        comm_interference=interference,
    )


def _interference(comm, link: Link, matmul) -> float:
    """How much an all-gather in flight slows matmuls on this rank (see CostModel)."""
    world = comm.world_size
    flat = torch.ones(1 << 22)
    shard = torch.ones((1 << 22) // world)
    gather_s = link.seconds(flat.numel() * 4, world)
    per_matmul = _time(matmul, 2)
    count = max(1, round(gather_s / per_matmul))
    alone = _time(lambda: [matmul() for _ in range(count)], 2)
    comm.all_gather(flat, shard, count=False).wait()  # warm, and line the ranks up
    pending = comm.all_gather(flat, shard, count=False)
    start = time.perf_counter()
    for _ in range(count):
        matmul()
    with_comm = time.perf_counter() - start
    pending.wait()
    overlap = min(gather_s, with_comm)
    return min(max((with_comm - alone) / max(overlap, 1e-9), 0.0), 2.0)


_MEASURED: dict = {}
"""Calibrated cost models, per (world size, comm kind, link emulation): measured once a process."""


def resolve(spec, comm=None, link=None) -> "CostModel | None":
    """The cost model `Config.cost_model` names: None, a `CostModel`, a preset name, or
    "measure" (calibrate this machine on `comm`, once per process and link; every rank takes
    rank 0's figures, so every rank makes the same choices). Collective for "measure".

    Raises:
        TypeError: for anything else.
        ValueError: for an unknown preset name.
    """
    if spec is None or isinstance(spec, CostModel):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"Config.cost_model must be 'measure', a preset name, a fxzero.cost.CostModel or None, "
            f"got {type(spec).__name__}"
        )
    if spec != "measure":
        return preset(spec)
    key = (getattr(comm, "world_size", 1), type(comm).__name__, link)
    if key not in _MEASURED:
        measured = calibrate(comm=comm)
        _MEASURED[key] = comm.all_gather_object(measured)[0] if comm is not None else measured
    return _MEASURED[key]

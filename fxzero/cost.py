"""Cost model and simulator: what a schedule would cost on some hardware, without running it.

A `CostModel` prices an instruction: compute from its FLOPs and bytes (the slower of the two,
plus a fixed dispatch overhead per op), a collective from a latency/bandwidth model of the link
(ring algorithms: each rank sends (N-1)/N of the buffer), a fetch or offload from its storage
tier's bandwidth. `simulate` replays a Schedule on a compute, a comm and an io stream and returns
the step time, the communication and storage I/O left exposed (compute waiting on them) and the
peak of gathered memory.

Presets describe hardware we do not have (`PRESETS`); `calibrate()` measures the machine at
hand (a matmul probe, a copy probe and, in a process group, an all-gather sweep).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from fxzero.schedule import COLLECTIVES, IO, Instruction, Schedule

__all__ = ["CostModel", "DEFAULT_IO", "Event", "Link", "PRESETS", "SimResult", "calibrate", "simulate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """One collective kind on one interconnect: time = latency + wire bytes / bandwidth."""

    bandwidth: float
    """Bytes per second one rank moves (algorithm bandwidth of the ring)."""
    latency: float = 0.0
    """Seconds per collective, independent of size."""

    def seconds(self, nbytes: int, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        wire = nbytes * (world_size - 1) / world_size
        return self.latency + wire / self.bandwidth


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    name: str
    flops_per_s: float
    """Sustained matmul FLOP rate of one rank."""
    mem_bytes_per_s: float
    """Bytes per second one rank reads plus writes in memory-bound ops."""
    op_overhead_s: float = 0.0
    """Fixed cost of dispatching one op (the Python executor and ATen dispatch)."""
    links: dict[str, Link] = dataclasses.field(default_factory=dict)
    """Per collective kind: all_gather, reduce_scatter, all_reduce."""
    world_size: Optional[int] = None
    """Ranks the collectives run over; None: the schedule's own world size."""
    comm_interference: float = 0.0
    """How much a running collective slows this rank's compute: compute overlapping one
    second of communication takes this many seconds longer. Near 0 where a DMA engine moves
    the bytes (NVLink, RDMA); large on CPU backends, whose transfers are copies by the CPU."""
    io: dict[str, Link] = dataclasses.field(default_factory=dict)
    """Storage tiers, per "<tier>_read" / "<tier>_write" (e.g. "nvme_read"): bandwidth one rank
    gets from its share of the tier, and latency per transfer. A tier not listed moves at
    `DEFAULT_IO` (the cpu tier: half the memory bandwidth, a copy reads and writes)."""

    def io_seconds(self, ins: Instruction) -> float:
        """Time of a fetch (read) or offload (write) of `ins.bytes` from or to its tier."""
        key = f"{ins.algorithm}_{'read' if ins.kind == 'fetch' else 'write'}"
        link = self.io.get(key) or DEFAULT_IO.get(key)
        if link is None:
            link = Link(bandwidth=self.mem_bytes_per_s / 2)
        return link.latency + ins.bytes / link.bandwidth

    def compute_seconds(self, ins: Instruction) -> float:
        if ins.kind == "optim_step":
            # AdamW reads param, grad, two moments and writes three: ~7 passes over the shard.
            return self.op_overhead_s * 10 + 7 * ins.bytes / self.mem_bytes_per_s
        if ins.kind != "compute":
            return self.op_overhead_s if ins.kind in ("wait", "free") else 0.0
        return self.op_overhead_s + max(ins.flops / self.flops_per_s, (ins.read_bytes + ins.bytes) / self.mem_bytes_per_s)

    def collective_seconds(self, kind: str, nbytes: int, world_size: int) -> float:
        link = self.links.get(kind)
        if link is None:
            raise ValueError(f"cost model {self.name!r} has no link for {kind!r}; add one to links=")
        return link.seconds(nbytes, self.world_size or world_size)

    def latency_bound_bytes(self, kind: str = "all_gather") -> int:
        """Message size below which a collective's time is mostly latency (latency x bandwidth)."""
        link = self.links[kind]
        return int(link.latency * link.bandwidth)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return d


def _gbps(x: float) -> float:
    return x * 1e9


DEFAULT_IO: dict[str, Link] = {
    # One NVMe drive of this project's machines (shared/ANCHORS.md: O_DIRECT, 1 MiB blocks).
    "nvme_read": Link(bandwidth=_gbps(1.05), latency=1e-4),
    "nvme_write": Link(bandwidth=_gbps(2.3), latency=1e-4),
}
"""Storage tier figures for cost models that do not list their own."""


PRESETS: dict[str, CostModel] = {
    # 8 x H100 SXM on NVLink 4 (about 450 GB/s bus bandwidth per GPU for NCCL collectives),
    # fp32 without tensor cores about 50 TFLOP/s, HBM3 3 TB/s.
    "h100x8-nvlink": CostModel(
        name="h100x8-nvlink", flops_per_s=50e12, mem_bytes_per_s=3e12, op_overhead_s=5e-6,
        links={k: Link(bandwidth=_gbps(360), latency=15e-6) for k in ("all_gather", "reduce_scatter", "all_reduce")},
        world_size=8,
        # PCIe 5 host copies (~50 GB/s per GPU); 8 NVMe drives (~25 GB/s read) shared by 8 GPUs.
        io={"cpu_read": Link(bandwidth=_gbps(50)), "cpu_write": Link(bandwidth=_gbps(50)),
            "nvme_read": Link(bandwidth=_gbps(3.1), latency=1e-4), "nvme_write": Link(bandwidth=_gbps(2.5), latency=1e-4)},
    ),
    # 64 GPUs (8 nodes) on 400 Gb/s links: the inter-node ring runs at ~45 GB/s per rank.
    "h100x64-ib400": CostModel(
        name="h100x64-ib400", flops_per_s=50e12, mem_bytes_per_s=3e12, op_overhead_s=5e-6,
        links={k: Link(bandwidth=_gbps(45), latency=40e-6) for k in ("all_gather", "reduce_scatter", "all_reduce")},
        world_size=64,
        io={"cpu_read": Link(bandwidth=_gbps(50)), "cpu_write": Link(bandwidth=_gbps(50)),
            "nvme_read": Link(bandwidth=_gbps(3.1), latency=1e-4), "nvme_write": Link(bandwidth=_gbps(2.5), latency=1e-4)},
    ),
    # This kind of machine: 2 vCPU, gloo over loopback, one thread per rank (shared/ANCHORS.md).
    "cpu-loopback": CostModel(
        name="cpu-loopback", flops_per_s=90e9, mem_bytes_per_s=_gbps(5), op_overhead_s=25e-6,
        comm_interference=0.5,
        links={
            "all_gather": Link(bandwidth=_gbps(1.2), latency=1e-4),
            "reduce_scatter": Link(bandwidth=_gbps(0.8), latency=1e-4),
            "all_reduce": Link(bandwidth=_gbps(1.4) * 2, latency=1e-4),
        },
    ),
}


def preset(name: str) -> CostModel:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


# ---------------------------------------------------------------------------------------------
# Simulation


@dataclasses.dataclass(frozen=True)
class Event:
    program: str
    index: int
    name: str
    kind: str
    stream: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    step_seconds: float
    compute_seconds: float
    """Busy time of the compute stream."""
    comm_seconds: float
    """Busy time of the comm stream."""
    exposed_comm_seconds: float
    """Time the compute stream sat waiting for collectives."""
    peak_gathered_bytes: int
    events: tuple[Event, ...]
    io_seconds: float = 0.0
    """Busy time of the io stream (reads and writes of offloaded states)."""
    exposed_io_seconds: float = 0.0
    """Time the compute stream sat waiting for reads or writes."""

    def summary(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "events"}


def simulate(schedule: Schedule, cost: CostModel) -> SimResult:
    """Replay `schedule`'s programs (forward, backward, step) on compute, comm and io streams.

    Each instruction starts when its stream is free and its dependencies have ended; a
    collective runs on the comm stream, a fetch or offload on the io stream, one at a time in
    issue order; its wait (on the compute stream) ends when it has. Programs run back to back
    on the compute stream; a collective one program leaves in flight (a gradient the step waits
    for) goes on on its stream.
    """
    world = schedule.world_size
    clock = {"compute": 0.0, "comm": 0.0, "io": 0.0}
    busy = {"compute": 0.0, "comm": 0.0, "io": 0.0}
    exposed = {"comm": 0.0, "io": 0.0}
    events: list[Event] = []
    stream_of: dict[str, str] = {}
    end: dict[str, float] = {}
    for program in schedule.programs:
        start_of_program = clock["compute"]
        clock = {stream: max(t, start_of_program) for stream, t in clock.items()}
        by_index: list[float] = []
        names = [i.name for i in program.instructions]
        for idx, ins in enumerate(program.instructions):
            waited = ins.reads[0] if ins.kind == "wait" and ins.reads else None
            ready = max((by_index[d] for d in ins.deps if names[d] != waited), default=start_of_program)
            if ins.kind in COLLECTIVES or ins.kind in IO:
                # Issued by the compute stream in program order, carried out by the comm stream
                # (collectives) or the io stream (transfers to and from storage tiers).
                stream = "comm" if ins.kind in COLLECTIVES else "io"
                begin = max(clock[stream], ready, clock["compute"])
                if stream == "comm":
                    duration = cost.collective_seconds(ins.kind if ins.kind in cost.links else "all_gather", ins.bytes, world)
                else:
                    duration = cost.io_seconds(ins)
                stream_of[ins.name] = stream
            else:
                begin = max(clock["compute"], ready)
                duration = cost.compute_seconds(ins)
                stream = "compute"
                # Communication in flight while this op computes takes part of its CPU.
                overlap = max(0.0, min(clock["comm"], begin + duration) - begin)
                duration += cost.comm_interference * overlap
                if waited is not None:
                    collective_end = end.get(waited, begin)
                    if collective_end > begin:
                        exposed[stream_of.get(waited, "comm")] += collective_end - begin
                        begin = collective_end
            finish = begin + duration
            clock[stream] = finish
            busy[stream] += duration
            end[ins.name] = finish
            by_index.append(finish)
            events.append(Event(program.name, idx, ins.name, ins.kind, stream, begin, finish))
    return SimResult(
        step_seconds=max(clock.values()),
        compute_seconds=busy["compute"],
        comm_seconds=busy["comm"],
        exposed_comm_seconds=exposed["comm"],
        peak_gathered_bytes=schedule.peak_gathered_bytes,
        events=tuple(events),
        io_seconds=busy["io"],
        exposed_io_seconds=exposed["io"],
    )


# ---------------------------------------------------------------------------------------------
# Calibration


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
    a, b = torch.randn(512, 512), torch.randn(512, 1536)
    big = torch.empty(1 << 24)
    src = torch.randn(1 << 24)
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

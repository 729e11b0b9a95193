"""The cost model: what an instruction costs on some hardware.

A `CostModel` prices an instruction: compute from its FLOPs and bytes (the slower of the two,
plus a fixed dispatch overhead per op), a collective from a latency/bandwidth model of the link
(ring algorithms: each rank sends (N-1)/N of the buffer), a fetch or offload from its storage
tier's bandwidth.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from fxzero.ir.instruction import Instruction

__all__ = ["DEFAULT_IO", "CostModel", "Link", "gbps"]


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
        key = f"{ins.tier}_{'read' if ins.kind == 'fetch' else 'write'}"
        link = self.io.get(key) or DEFAULT_IO.get(key)
        if link is None:
            link = Link(bandwidth=self.mem_bytes_per_s / 2)
        return link.latency + ins.bytes / link.bandwidth

    def compute_seconds(self, ins: Instruction) -> float:
        if ins.kind == "optim_step":
            # It reads param, grad and the optimizer's states and writes all but the grad: AdamW's
            # two moments make ~7 passes over the shard, Adagrad's one sum 5.
            passes = 2 * len(ins.reads) - 1
            return self.op_overhead_s * 10 + passes * ins.bytes / self.mem_bytes_per_s
        if ins.kind not in ("compute", "cast", "check"):
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


def gbps(x: float) -> float:
    return x * 1e9


DEFAULT_IO: dict[str, Link] = {
    # One NVMe drive of this project's machines (shared/ANCHORS.md: O_DIRECT, 1 MiB blocks).
    "nvme_read": Link(bandwidth=gbps(1.05), latency=1e-4),
    "nvme_write": Link(bandwidth=gbps(2.3), latency=1e-4),
}
"""Storage tier figures for cost models that do not list their own."""

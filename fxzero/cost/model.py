"""The cost model: what an instruction costs on some hardware.

A `CostModel` prices an instruction: compute from its FLOPs and bytes (the slower of the two,
plus a fixed dispatch overhead per op; or, given `ComputeRates`, at a rate per op kind), a
collective from a latency/bandwidth model of the link (ring algorithms: each rank sends (N-1)/N
of the buffer; given a `Topology`, over the node's network once the ring leaves a node), a fetch
or offload from its storage tier's bandwidth.
"""

from __future__ import annotations

import dataclasses

from fxzero.ir.instruction import Instruction

__all__ = ["DEFAULT_IO", "ComputeRates", "CostModel", "Link", "Topology", "gbps", "op_kind"]


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
class Topology:
    """Where the ranks sit: nodes of `gpus_per_node` GPUs joined by NVLink inside a node and by
    one NIC per GPU between nodes.

    A ring inside one node runs at the `links` of the cost model (NVLink's bus bandwidth). A ring
    that spans nodes crosses each node boundary on every step; NCCL runs one ring per NIC, so the
    bytes leave a node through all of its NICs together: the ring's bandwidth is
    min(NVLink, `nic_efficiency` x gpus_per_node x nic_bytes_per_s), not one GPU's NIC share
    (issue 26: pricing every byte on the sending GPU's own NIC was ~8x too slow on 8-GPU nodes).
    Each of a ring's N-1 steps waits for one network hop: `hop_latency_s` each.
    """

    gpus_per_node: int
    nic_bytes_per_s: float
    """One GPU's NIC (400 Gb/s InfiniBand: 50e9; 8 x 200 Gb/s RoCE per node: 25e9)."""
    nic_efficiency: float = 0.9
    """Fraction of the NICs' line rate a ring of NCCL's achieves."""
    hop_latency_s: float = 5e-6
    """Latency of one step of a ring across nodes (RDMA plus NCCL's proxy)."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nic_bytes_per_s <= 0:
            raise ValueError(f"Topology needs gpus_per_node >= 1 and nic_bytes_per_s > 0, got {self}")

    def network_bytes_per_s(self) -> float:
        """What a ring across nodes moves per second per rank: the node's NICs together."""
        return self.nic_efficiency * self.gpus_per_node * self.nic_bytes_per_s

    def across_nodes(self, link: Link, nvlink_bytes_per_s: float, world_size: int) -> Link:
        """`link` (priced inside a node, where the ring runs at `nvlink_bytes_per_s`) for a ring
        of `world_size` ranks that leaves the node: its bandwidth scaled to the network's, its
        latency that of N-1 network hops."""
        scale = min(1.0, self.network_bytes_per_s() / nvlink_bytes_per_s)
        return Link(bandwidth=link.bandwidth * scale, latency=link.latency + (world_size - 1) * self.hop_latency_s)


MATMUL_PREFIXES = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution")
"""Op names priced as matmuls (the FX node name starts with the ATen op's name)."""


def op_kind(ins: Instruction) -> str:
    """What kind of compute an instruction is, for `ComputeRates`: "attention" (a fused SDPA
    kernel, forward or backward), "matmul" (any other op with FLOPs: torch's formulas cover
    matmuls, convolutions and attention only), "view" (moves no bytes: a view, a transpose, a
    getitem; no kernel runs) or "memory" (element-wise ops and reductions, priced by bytes)."""
    if "attention" in ins.name:
        return "attention"
    if ins.flops > 0 or ins.name.startswith(MATMUL_PREFIXES):
        return "matmul"
    if ins.bytes == 0 and ins.read_bytes == 0:
        return "view"
    return "memory"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputeRates:
    """A GPU's compute, per op kind, device and precision (`CostModel.rates`).

    - matmul: FLOPs at `matmul_efficiency` x the dtype's peak, plus its operands' bytes at the
      memory bandwidth (a smooth roofline: a matmul of low arithmetic intensity, the narrow ones
      of a small model, gets a lower share of the peak; issue 26 found one efficiency for every
      size over-predicted 125M models by 1.33-1.41x);
    - attention (fused SDPA, whose backward recomputes): FLOPs at `attention_efficiency` of the
      matmul rate (issue 26 measured ~0.43x on A100, ~0.33x on H100 per FLOP the kernel does;
      the FLOPs here are torch's SDPA formula's, which counts the whole score matrix, twice a
      causal kernel's work; fitted to MosaicML's published rows: 0.72-0.73 A100, 0.47 H100);
    - memory (element-wise ops, norms, reductions): bytes read and written at
      `memory_efficiency` x the memory bandwidth;
    - view: nothing (no kernel).
    Every kernel also costs `launch_s`.
    """

    peak_flops: dict[str, float]
    """Dense peak FLOP/s by the dtype computed in ("bfloat16", "float16", "float32")."""
    matmul_efficiency: float
    """Fraction of the peak a large matmul sustains (calibrated: `tools/check_published.py`)."""
    attention_efficiency: float
    """Fused attention's FLOP rate as a fraction of the matmul rate."""
    memory_efficiency: float = 0.8
    """Fraction of the memory bandwidth element-wise kernels reach."""
    launch_s: float = 3e-6
    """Per kernel: launch and tail, what a stream of small kernels pays each."""
    default_dtype: str = "bfloat16"
    """The dtype an instruction that names none computes in, unless it makes 4 bytes an element
    (`compute_dtype`)."""

    def __post_init__(self) -> None:
        if not self.peak_flops or self.default_dtype not in self.peak_flops:
            raise ValueError(f"ComputeRates.peak_flops must name default_dtype {self.default_dtype!r}")
        for field in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"ComputeRates.{field} must be in (0, 1], got {getattr(self, field)}")

    def matmul_flops_per_s(self, dtype: str) -> float:
        return self.matmul_efficiency * self.peak_flops.get(dtype or self.default_dtype,
                                                            self.peak_flops[self.default_dtype])

    def compute_dtype(self, ins: Instruction) -> str:
        """The dtype `ins` computes in: its own, or for an op of several outputs that names none
        (attention: its output and a float32 logsumexp) float32 where it makes 4 bytes an element
        (fp32 attention, the memory-efficient kernel), else `default_dtype`."""
        if ins.dtype:
            return ins.dtype
        return "float32" if ins.numel and ins.bytes >= 3 * ins.numel and "float32" in self.peak_flops \
            else self.default_dtype

    def seconds(self, ins: Instruction, mem_bytes_per_s: float) -> float:
        kind = op_kind(ins)
        moved = ins.read_bytes + ins.bytes
        if kind == "view":
            return 0.0
        if kind == "attention":
            return self.launch_s + ins.flops / (self.attention_efficiency * self.matmul_flops_per_s(self.compute_dtype(ins)))
        if kind == "matmul":
            return self.launch_s + ins.flops / self.matmul_flops_per_s(self.compute_dtype(ins)) + moved / mem_bytes_per_s
        return self.launch_s + moved / (self.memory_efficiency * mem_bytes_per_s)


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
    world_size: int | None = None
    """Ranks the collectives run over; None: the schedule's own world size."""
    comm_interference: float = 0.0
    """How much a running collective slows this rank's compute: compute overlapping one
    second of communication takes this many seconds longer. Near 0 where a DMA engine moves
    the bytes (NVLink, RDMA); large on CPU backends, whose transfers are copies by the CPU."""
    io_interference: float = 0.0
    """How much a storage transfer in flight (a fetch or offload on the io stream) slows this
    rank's compute, as `comm_interference` for collectives. Near 0 where the device computes and
    a DMA engine moves the bytes; on a CPU rank the I/O threads (staging copies, checksums, the
    kernel's block layer) take cores from the compute: the 25M GPT with its activations on NVMe
    computed its forward in 6.8 s against 3.7 s resident, waiting 0.7 s on fetches, on the 2-core
    development VM (2026-12-03)."""
    io: dict[str, Link] = dataclasses.field(default_factory=dict)
    """Storage tiers, per "<tier>_read" / "<tier>_write" (e.g. "nvme_read"): bandwidth one rank
    gets from its share of the tier, and latency per transfer. A tier not listed moves at
    `DEFAULT_IO` (the cpu tier: half the memory bandwidth, a copy reads and writes)."""
    topology: Topology | None = None
    """Nodes and their network: a ring of more ranks than one node holds runs over the network
    (`Topology.across_nodes`); None: every ring runs at `links`, however many ranks."""
    rates: ComputeRates | None = None
    """Compute per op kind (GPUs); None: every op at `flops_per_s` / `mem_bytes_per_s`."""
    device_memory_bytes: int | None = None
    """One device's memory, what a plan must fit in (None: not a GPU, or not stated)."""

    def at_world(self, world_size: int) -> CostModel:
        """This hardware with `world_size` ranks: a program compiled for fewer ranks priced at
        more (its collectives move the same bytes per rank; the ring's length and span change)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return dataclasses.replace(self, world_size=world_size)

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
        if self.rates is not None:
            return self.rates.seconds(ins, self.mem_bytes_per_s)
        return self.op_overhead_s + max(ins.flops / self.flops_per_s, (ins.read_bytes + ins.bytes) / self.mem_bytes_per_s)

    def collective_seconds(self, kind: str, nbytes: int, world_size: int) -> float:
        link = self.links.get(kind)
        if link is None:
            raise ValueError(f"cost model {self.name!r} has no link for {kind!r}; add one to links=")
        world = self.world_size or world_size
        if self.topology is not None and world > self.topology.gpus_per_node:
            link = self.topology.across_nodes(link, self.links.get("all_gather", link).bandwidth, world)
        return link.seconds(nbytes, world)

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

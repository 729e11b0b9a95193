"""Hardware we do not have, as cost models: `PRESETS` by name.

The GPU cluster presets ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb") are nodes of 8 SXM
GPUs: NVLink inside a node, one NIC per GPU between nodes (`Topology`), compute per op kind
(`ComputeRates`). They take the schedule's world size, so one program is priced for 8, 64 or
512 GPUs (`CostModel.at_world` prices a program compiled for fewer ranks at more). Their peak
rates and bandwidths are the vendors' published figures; their matmul and fused-attention
efficiencies are what `tools/check_published.py` fits on two named rows of MosaicML's published
table per GPU type (MPT-1B on 8 GPUs at sequence 2048 and 16384; docs/simulator.md), rounded;
H200 takes H100's (no published rows). The attention efficiency is per FLOP of torch's SDPA
formula, which counts the whole score matrix: a causal kernel does half that work.
"""

from __future__ import annotations

from fxzero.cost.model import ComputeRates, CostModel, Link, Topology, gbps

__all__ = ["PRESETS", "preset"]


PRESETS: dict[str, CostModel] = {
    # 8 x H100 SXM on NVLink 4 (about 450 GB/s bus bandwidth per GPU for NCCL collectives),
    # fp32 without tensor cores about 50 TFLOP/s, HBM3 3 TB/s.
    "h100x8-nvlink": CostModel(
        name="h100x8-nvlink", flops_per_s=50e12, mem_bytes_per_s=3e12, op_overhead_s=5e-6,
        links={k: Link(bandwidth=gbps(360), latency=15e-6) for k in ("all_gather", "reduce_scatter", "all_reduce")},
        world_size=8,
        # PCIe 5 host copies (~50 GB/s per GPU); 8 NVMe drives (~25 GB/s read) shared by 8 GPUs.
        io={"cpu_read": Link(bandwidth=gbps(50)), "cpu_write": Link(bandwidth=gbps(50)),
            "nvme_read": Link(bandwidth=gbps(3.1), latency=1e-4), "nvme_write": Link(bandwidth=gbps(2.5), latency=1e-4)},
    ),
    # 64 GPUs (8 nodes of 8) on 400 Gb/s InfiniBand, a NIC per GPU: a ring across nodes leaves
    # each node through its 8 NICs together, min(NVLink, 0.9 x 8 x 50 GB/s) = 360 GB/s per rank
    # (it was priced at one GPU's NIC share, 45 GB/s: issue 26).
    "h100x64-ib400": CostModel(
        name="h100x64-ib400", flops_per_s=50e12, mem_bytes_per_s=3e12, op_overhead_s=5e-6,
        links={k: Link(bandwidth=gbps(360), latency=15e-6) for k in ("all_gather", "reduce_scatter", "all_reduce")},
        world_size=64, topology=Topology(gpus_per_node=8, nic_bytes_per_s=gbps(50)),
        io={"cpu_read": Link(bandwidth=gbps(50)), "cpu_write": Link(bandwidth=gbps(50)),
            "nvme_read": Link(bandwidth=gbps(3.1), latency=1e-4), "nvme_write": Link(bandwidth=gbps(2.5), latency=1e-4)},
    ),
    # This kind of machine: 2 vCPU, gloo over loopback, one thread per rank (shared/ANCHORS.md).
    "cpu-loopback": CostModel(
        name="cpu-loopback", flops_per_s=90e9, mem_bytes_per_s=gbps(5), op_overhead_s=25e-6,
        comm_interference=0.5,
        # The I/O threads beside one compute thread per rank: 0.23-0.54 by the disk probe's
        # measure_interference, two ranks at once, on the AMD EPYC VM (2026-12-03).
        io_interference=0.35,
        links={
            "all_gather": Link(bandwidth=gbps(1.2), latency=1e-4),
            "reduce_scatter": Link(bandwidth=gbps(0.8), latency=1e-4),
            "all_reduce": Link(bandwidth=gbps(1.4) * 2, latency=1e-4),
        },
    ),
}


def _gpu_cluster(name: str, *, peak: dict[str, float], hbm: float, memory_gib: float, nvlink: float, nic: float,
                 matmul_efficiency: float, attention_efficiency: float) -> CostModel:
    """Nodes of 8 GPUs: `nvlink` the bus bandwidth of a ring inside a node (NCCL's busbw for
    all-gather and reduce-scatter; an all-reduce moves twice the bytes), `nic` one GPU's NIC."""
    ring = Link(bandwidth=nvlink, latency=15e-6)
    return CostModel(
        name=name, flops_per_s=matmul_efficiency * peak["bfloat16"], mem_bytes_per_s=hbm, op_overhead_s=3e-6,
        links={"all_gather": ring, "reduce_scatter": ring, "all_reduce": Link(bandwidth=nvlink / 2, latency=15e-6)},
        topology=Topology(gpus_per_node=8, nic_bytes_per_s=nic),
        rates=ComputeRates(peak_flops=peak, matmul_efficiency=matmul_efficiency,
                           attention_efficiency=attention_efficiency),
        device_memory_bytes=int(memory_gib * 2**30),
        # PCIe 4 (A100) / 5 (H100) host copies per GPU; NVMe as h100x8-nvlink's.
        io={"cpu_read": Link(bandwidth=gbps(25 if "a100" in name else 50)),
            "cpu_write": Link(bandwidth=gbps(25 if "a100" in name else 50)),
            "nvme_read": Link(bandwidth=gbps(3.1), latency=1e-4), "nvme_write": Link(bandwidth=gbps(2.5), latency=1e-4)},
    )


# Dense peaks (NVIDIA's A100 and H100 SXM datasheets): tensor cores for bf16 / fp16; float32
# without them (19.5 / 67 TFLOP/s), as torch runs fp32 matmuls unless
# torch.backends.cuda.matmul.allow_tf32 is set (TF32: 156 / 494 TFLOP/s).
_A100 = {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}
_H100 = {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}

PRESETS.update({
    # DGX A100: NVLink 3 (~230 GB/s NCCL bus bandwidth), 8 x 200 Gb/s RoCE per node (MosaicML's
    # "1600 Gbps node-node interconnect"): 25 GB/s per GPU. HBM2 1.56 TB/s (40 GB), HBM2e 2.04 TB/s (80 GB).
    "a100-40gb": _gpu_cluster("a100-40gb", peak=_A100, hbm=gbps(1555), memory_gib=40, nvlink=gbps(230),
                              nic=gbps(25), matmul_efficiency=0.86, attention_efficiency=0.72),
    "a100-80gb": _gpu_cluster("a100-80gb", peak=_A100, hbm=gbps(2039), memory_gib=80, nvlink=gbps(230),
                              nic=gbps(25), matmul_efficiency=0.84, attention_efficiency=0.73),
    # H100 / H200 SXM: NVLink 4 (~360 GB/s ring bus bandwidth), 400 Gb/s InfiniBand per GPU;
    # HBM3 3.35 TB/s (80 GB), HBM3e 4.8 TB/s (141 GB).
    "h100-80gb": _gpu_cluster("h100-80gb", peak=_H100, hbm=gbps(3350), memory_gib=80, nvlink=gbps(360),
                              nic=gbps(50), matmul_efficiency=0.73, attention_efficiency=0.47),
    "h200-141gb": _gpu_cluster("h200-141gb", peak=_H100, hbm=gbps(4800), memory_gib=141, nvlink=gbps(360),
                               nic=gbps(50), matmul_efficiency=0.73, attention_efficiency=0.47),
})


def preset(name: str) -> CostModel:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]

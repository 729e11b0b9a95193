"""Hardware we do not have, as cost models: `PRESETS` by name."""

from __future__ import annotations

from fxzero.cost.model import CostModel, Link, gbps

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
    # 64 GPUs (8 nodes) on 400 Gb/s links: the inter-node ring runs at ~45 GB/s per rank.
    "h100x64-ib400": CostModel(
        name="h100x64-ib400", flops_per_s=50e12, mem_bytes_per_s=3e12, op_overhead_s=5e-6,
        links={k: Link(bandwidth=gbps(45), latency=40e-6) for k in ("all_gather", "reduce_scatter", "all_reduce")},
        world_size=64,
        io={"cpu_read": Link(bandwidth=gbps(50)), "cpu_write": Link(bandwidth=gbps(50)),
            "nvme_read": Link(bandwidth=gbps(3.1), latency=1e-4), "nvme_write": Link(bandwidth=gbps(2.5), latency=1e-4)},
    ),
    # This kind of machine: 2 vCPU, gloo over loopback, one thread per rank (shared/ANCHORS.md).
    "cpu-loopback": CostModel(
        name="cpu-loopback", flops_per_s=90e9, mem_bytes_per_s=gbps(5), op_overhead_s=25e-6,
        comm_interference=0.5,
        links={
            "all_gather": Link(bandwidth=gbps(1.2), latency=1e-4),
            "reduce_scatter": Link(bandwidth=gbps(0.8), latency=1e-4),
            "all_reduce": Link(bandwidth=gbps(1.4) * 2, latency=1e-4),
        },
    ),
}


def preset(name: str) -> CostModel:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]

"""Topology (rings inside a node over NVLink, across nodes over the node's NICs) and compute
rates per op kind (matmul, fused attention, element-wise by bytes, views free), against figures
worked out by hand from the presets' stated rates (issue 26)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxzero import cost
from fxzero.compiler import compile_program
from fxzero.config import Config
from fxzero.config.precision import MixedPrecision
from fxzero.cost import PRESETS, ComputeRates, CostModel, Link, Topology
from fxzero.cost.model import op_kind
from fxzero.ir.instruction import Instruction
from fxzero.zoo import build

REL = 1e-9
MB400 = 400 * 10**6


def test_a_ring_inside_a_node_runs_at_nvlink():
    h100 = PRESETS["h100-80gb"]
    for world in (2, 8):
        assert h100.at_world(world).collective_seconds("all_gather", MB400, 99) == pytest.approx(
            15e-6 + MB400 * (world - 1) / world / 360e9, rel=REL)


def test_a_ring_across_nodes_runs_over_the_node_s_nics():
    # A100 nodes: 8 x 25 GB/s NICs, 0.9 x 8 x 25 = 180 GB/s < NVLink's 230 GB/s; each of the
    # ring's N-1 steps waits one network hop (5 us).
    a100 = PRESETS["a100-40gb"]
    for world in (16, 64, 512):
        wire = MB400 * (world - 1) / world
        assert a100.at_world(world).collective_seconds("all_gather", MB400, 8) == pytest.approx(
            15e-6 + (world - 1) * 5e-6 + wire / 180e9, rel=REL)
        # An all-reduce moves twice the bytes: its link is NVLink's half, scaled the same way.
        assert a100.at_world(world).collective_seconds("all_reduce", MB400, 8) == pytest.approx(
            15e-6 + (world - 1) * 5e-6 + wire / 90e9, rel=REL)
    # H100 nodes: 0.9 x 8 x 50 = 360 GB/s, NVLink's own rate: only latency grows with the ring.
    h100 = PRESETS["h100-80gb"].at_world(64)
    assert h100.collective_seconds("reduce_scatter", MB400, 8) == pytest.approx(
        15e-6 + 63 * 5e-6 + MB400 * 63 / 64 / 360e9, rel=REL)


def test_h100x64_ib400_no_longer_prices_rings_at_one_nic_share():
    # Issue 26: 45 GB/s per rank was ~8x too slow for 8-GPU nodes with a NIC per GPU.
    seconds = PRESETS["h100x64-ib400"].collective_seconds("all_gather", MB400, 8)
    assert seconds == pytest.approx(15e-6 + 63 * 5e-6 + MB400 * 63 / 64 / 360e9, rel=REL)
    assert seconds < MB400 * 63 / 64 / 45e9 / 4


def test_a_model_without_a_topology_prices_every_world_on_its_links():
    flat = CostModel(name="flat", flops_per_s=1e12, mem_bytes_per_s=1e12,
                     links={"all_gather": Link(bandwidth=1e9, latency=1e-3)})
    assert flat.at_world(512).collective_seconds("all_gather", 10**9, 2) == pytest.approx(1e-3 + 511 / 512, rel=REL)


def test_cpu_loopback_keeps_its_figures():
    # This machine's preset is what its measured step is predicted with: pinned as stated.
    m = PRESETS["cpu-loopback"]
    assert (m.flops_per_s, m.mem_bytes_per_s, m.op_overhead_s, m.comm_interference) == (90e9, 5e9, 25e-6, 0.5)
    assert m.topology is None and m.rates is None and m.world_size is None
    assert m.links["all_gather"] == Link(bandwidth=1.2e9, latency=1e-4)


def _ins(name, *, flops=0, nbytes=0, read=0, dtype="bfloat16"):
    return Instruction(name, "compute", "compute", flops=flops, bytes=nbytes, read_bytes=read, dtype=dtype)


def test_compute_is_priced_per_op_kind():
    a100 = PRESETS["a100-80gb"]
    r = a100.rates
    hbm = 2039e9
    mm = _ins("mm_3", flops=2 * 4096 * 2048 * 6144, nbytes=4096 * 6144 * 2, read=(4096 * 2048 + 2048 * 6144) * 2)
    assert op_kind(mm) == "matmul"
    assert a100.compute_seconds(mm) == pytest.approx(
        3e-6 + mm.flops / (r.matmul_efficiency * 312e12) + (mm.bytes + mm.read_bytes) / hbm, rel=REL)
    # Fused attention: its FLOPs at 0.73 of the matmul rate on A100-80GB (0.47 on H100); its dtype
    # is read from none of its outputs, so it computes in the default (bf16).
    attn = _ins("_scaled_dot_product_flash_attention_backward_1", flops=10**12, nbytes=10**8, read=10**8, dtype="")
    assert op_kind(attn) == "attention"
    assert a100.compute_seconds(attn) == pytest.approx(3e-6 + 1e12 / (0.73 * r.matmul_efficiency * 312e12), rel=REL)
    h100 = PRESETS["h100-80gb"]
    assert h100.compute_seconds(attn) == pytest.approx(
        3e-6 + 1e12 / (0.47 * h100.rates.matmul_efficiency * 989e12), rel=REL)
    # Element-wise and reductions: bytes read and written at 0.8 of the memory bandwidth.
    gelu = _ins("gelu_backward_2", nbytes=2 * 10**8, read=4 * 10**8)
    assert op_kind(gelu) == "memory"
    assert a100.compute_seconds(gelu) == pytest.approx(3e-6 + 6e8 / (0.8 * hbm), rel=REL)
    view = _ins("view_12")
    assert op_kind(view) == "view" and a100.compute_seconds(view) == 0.0
    # float32 matmuls run without tensor cores (torch's default: no TF32): 19.5 TFLOP/s.
    mm32 = dataclasses.replace(mm, dtype="float32")
    assert a100.compute_seconds(mm32) == pytest.approx(
        3e-6 + mm.flops / (r.matmul_efficiency * 19.5e12) + (mm.bytes + mm.read_bytes) / hbm, rel=REL)
    # An fp32 attention (the memory-efficient kernel: 4 bytes an element made, dtype unnamed)
    # computes in float32 too.
    attn32 = _ins("_scaled_dot_product_efficient_attention", flops=10**12, nbytes=4 * 10**6, dtype="")
    attn32 = dataclasses.replace(attn32, numel=10**6)
    assert a100.compute_seconds(attn32) == pytest.approx(3e-6 + 1e12 / (0.73 * r.matmul_efficiency * 19.5e12), rel=REL)


def test_a_small_matmul_gets_a_smaller_share_of_the_peak():
    # The same FLOPs as a narrow matmul (a 125M model's width) and a wide one (13B): the narrow
    # one moves more bytes per FLOP and is slower (issue 26: small models were over-predicted).
    h100 = PRESETS["h100-80gb"]
    tokens = 16384

    def mm(k, n):
        return _ins("mm", flops=2 * tokens * k * n, nbytes=tokens * n * 2, read=(tokens * k + k * n) * 2)

    narrow, wide = mm(768, 2304), mm(5120, 15360)
    rate = [x.flops / h100.compute_seconds(x) for x in (narrow, wide)]
    assert rate[0] < 0.85 * rate[1] and rate[1] <= h100.rates.matmul_flops_per_s("bfloat16")


def test_rates_and_topology_refuse_nonsense():
    with pytest.raises(ValueError, match="matmul_efficiency"):
        ComputeRates(peak_flops={"bfloat16": 1e12}, matmul_efficiency=0.0, attention_efficiency=0.5)
    with pytest.raises(ValueError, match="default_dtype"):
        ComputeRates(peak_flops={"float32": 1e12}, matmul_efficiency=0.5, attention_efficiency=0.5)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Topology(gpus_per_node=0, nic_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="world_size"):
        PRESETS["h100-80gb"].at_world(0)


def test_a_cuda_program_is_priced_for_8_64_and_512_gpus():
    # One program compiled on fake tensors for CUDA: its attention instructions are priced at the
    # attention rate, and the same program costs more per step on more GPUs only by its rings.
    model = build("gpt-tiny")
    cfg = Config(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    sched = compile_program(model, model.example_inputs(), cfg, world_size=8, device="cuda").schedule
    h100 = PRESETS["h100-80gb"]
    kinds = {op_kind(i) for p in sched.programs for i in p.instructions if i.kind == "compute"}
    assert {"attention", "matmul", "memory", "view"} <= kinds
    results = [cost.simulate(sched, h100.at_world(w)) for w in (8, 64, 512)]
    assert results[0].compute_seconds == results[1].compute_seconds == results[2].compute_seconds
    assert results[0].comm_seconds < results[1].comm_seconds < results[2].comm_seconds
    attn = [i for p in sched.programs for i in p.instructions if op_kind(i) == "attention"]
    assert attn and all(i.flops > 0 for i in attn)

"""`fxzero plan`: the ranking against full compiles priced on a hand-made cluster, what does not fit
never chosen, the written ds_config.json read back as the printed Config, the depth extrapolation
against a full compile, and the user's mistakes as one line each."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import fxzero
from fxzero import cost
from fxzero.compiler import compile_program
from fxzero.config import Activations, Config
from fxzero.modelspec import build_model
from fxzero.plan import Candidate, NextTokenLoss, Priced, extrapolate, plan, price, python_snippet
from fxzero.plan.extrapolate import repeated_blocks, steady_depth, with_depth
from fxzero.plan.grid import ACTIVATIONS, FXZERO_ONLY, OFFLOADS, RECOMPUTES, STAGES
from tests.cli.conftest import invoke

pytestmark = pytest.mark.timeout(120)

SMALL = "llama-small(n_blocks=4, seq_len=32)"  # 4 blocks of 3.2M parameters: sharded at ZeRO-3
GPUS, GLOBAL = 2, 4  # micro-batches 1 x 2 and 2 x 1

# Collectives and transfers at 2 ms of latency each, compute fast: each collective and transfer
# costs more than the model's compute, so fewer micro-steps (a larger micro-batch) and no offload
# (no transfers) must be faster, whatever the model's FLOPs.
HAND = cost.CostModel(
    name="hand-made", flops_per_s=1e13, mem_bytes_per_s=1e12, op_overhead_s=1e-7,
    links={k: cost.Link(bandwidth=1e10, latency=2e-3) for k in ("all_gather", "reduce_scatter", "all_reduce")},
    io={k: cost.Link(bandwidth=1e10, latency=2e-3) for k in ("cpu_read", "cpu_write")},
    device_memory_bytes=1 << 40,
)


def _model() -> torch.nn.Module:
    return NextTokenLoss(build_model(SMALL))


def _call(micro_batch: int):
    idx = torch.zeros(micro_batch, 32, dtype=torch.long)
    return (idx, idx), {}


def _full_step(model, candidate: Candidate) -> float:
    """The candidate's step from its full-depth program, compiled and simulated here."""
    config = candidate.config(GPUS)
    args, _ = _call(candidate.micro_batch)
    compiled = compile_program(model, args, config, world_size=GPUS, device="cuda")
    sim = cost.simulate(compiled.schedule, HAND)
    step_start = min(e.start for e in sim.events if e.program == "step")
    return candidate.accumulation * step_start + (sim.step_seconds - step_start)


@pytest.fixture(scope="module")
def ranked():
    model = _model()
    return model, plan(model, _call, gpus=GPUS, global_batch=GLOBAL, hardware=HAND, tokens_per_sample=32)


def test_the_ranking_follows_full_compiles_priced_on_a_hand_made_cluster(ranked):
    model, result = ranked
    keys = [(r.candidate.stage, r.candidate.micro_batch) for r in result.rows]
    # Everything fits in 1 TiB: no recompute and no offload at each stage and micro-batch (more of
    # either only adds compute or transfers), the other 7 of each not compiled.
    assert all(r.fits and (r.candidate.recompute, r.candidate.offload) == ("none", "none") for r in result.rows)
    assert sorted(keys) == sorted((s, b) for s in STAGES for b in (1, 2))
    assert any(line.startswith("28 with more recompute or offload") for line in result.not_compiled)
    full = [_full_step(model, r.candidate) for r in result.rows]
    for row, step in zip(result.rows, full):
        assert row.step_seconds == pytest.approx(step, rel=1e-9)
        assert row.tokens_per_s_per_gpu == pytest.approx(GLOBAL // GPUS * 32 / step, rel=1e-9)
    assert full == sorted(full)
    # What the cluster's latencies say: at each stage, one micro-step of 2 before two of 1.
    for stage in STAGES:
        assert keys.index((stage, 2)) < keys.index((stage, 1))


def test_what_does_not_fit_is_marked_and_never_chosen(ranked):
    model, roomy = ranked
    fastest = roomy.best
    tight = dataclasses.replace(HAND, device_memory_bytes=int(fastest.peak_bytes) - 1)
    result = plan(model, _call, gpus=GPUS, global_batch=GLOBAL, hardware=tight, tokens_per_sample=32,
                  micro_batch=fastest.candidate.micro_batch)
    rows = {r.candidate: r for r in result.rows}
    assert not rows[fastest.candidate].fits
    assert result.best is not None and result.best.candidate != fastest.candidate
    assert result.best.peak_bytes <= tight.device_memory_bytes
    fits = [r.fits for r in result.rows]
    assert fits == sorted(fits, reverse=True)  # every fitting row before every other
    fitting = [r for r in result.rows if r.fits]
    full = [_full_step(model, r.candidate) for r in fitting]
    assert [r.step_seconds for r in fitting] == pytest.approx(full, rel=1e-9) and full == sorted(full)
    # With 2 ms a transfer, offloading is slower than recomputing here: the offloaded rows rank last.
    offloaded = [r.candidate.offload == "cpu" for r in fitting]
    assert offloaded == sorted(offloaded)
    # The same stage, micro-batch and offload with recompute were compiled, since "none" did not fit.
    same = [c for c in rows if (c.stage, c.offload) == (fastest.candidate.stage, fastest.candidate.offload)]
    assert {c.recompute for c in same} > {"none"}


def test_keeping_attention_is_chosen_where_it_fits_and_selective_does_not():
    # Priced on an H100 at 8192 tokens a sample (8 heads of 64: each attention's output is 8 MiB a
    # sample in bf16), keeping each block's attention holds more than unit and less than selective,
    # and recomputes less than unit: with the device's memory at exactly its peak, it is the best.
    model = NextTokenLoss(build_model("llama-small(n_blocks=4, seq_len=8192)"))

    def call(micro_batch):
        idx = torch.zeros(micro_batch, 8192, dtype=torch.long)
        return (idx, idx), {}

    hardware = cost.preset("h100-80gb")
    full = {}
    for recompute in RECOMPUTES:
        candidate = Candidate(stage=3, micro_batch=1, accumulation=1, recompute=recompute, offload="none")
        config = candidate.config(GPUS)
        full[recompute] = price(compile_program(model, call(1)[0], config, world_size=GPUS, device="cuda"), config,
                                hardware.at_world(GPUS))
    peaks = [full[r].peak_bytes for r in RECOMPUTES]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert full["unit-attention"].micro_seconds < full["unit"].micro_seconds
    tight = dataclasses.replace(hardware, device_memory_bytes=int(full["unit-attention"].peak_bytes))
    result = plan(model, call, gpus=GPUS, global_batch=GPUS, hardware=tight, tokens_per_sample=8192)
    rows = {r.candidate.recompute: r for r in result.rows if (r.candidate.stage, r.candidate.offload) == (3, "none")}
    assert result.best.candidate == Candidate(stage=3, micro_batch=1, accumulation=1, recompute="unit-attention",
                                              offload="none")
    assert result.best.peak_bytes == full["unit-attention"].peak_bytes  # (extrapolated from 2 and 3 blocks)
    assert not rows["none"].fits and not rows["selective"].fits and "unit" not in rows  # (unit-attention fits)
    assert result.best.candidate.config(GPUS).activations == Activations(recompute="unit", keep_attention=True)


def test_a_model_without_fused_attention_is_not_planned_to_keep_it():
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                      for _ in range(4)))
    result = plan(model, lambda b: ((torch.zeros(b, 256),), {}), gpus=GPUS, global_batch=GPUS,
                  hardware=dataclasses.replace(HAND, device_memory_bytes=1))  # (nothing fits: every one compiled)
    assert result.depth == 4  # (the model itself is the list of blocks: priced from 2 and 3 of them)
    assert {r.candidate.recompute for r in result.rows} == {"none", "selective", "unit"}
    assert any(line.startswith("unit-attention (unit recompute keeping each fused attention's outputs): the model "
                               "computes no fused attention") for line in result.not_compiled)


@pytest.mark.parametrize("recompute, offload", [("unit", "none"), ("selective", "cpu")])  # (none: the ranking test)
def test_two_and_three_blocks_extrapolate_to_a_full_compile(recompute, offload):
    model = _model()
    blocks, depth = repeated_blocks(model)
    assert (blocks, depth) == ("model.blocks", 4)
    candidate = Candidate(stage=3, micro_batch=2, accumulation=1, recompute=recompute, offload=offload)
    config = candidate.config(GPUS)
    hardware = cost.preset("h100-80gb").at_world(GPUS)
    args, _ = _call(2)
    priced = {n: price(compile_program(with_depth(model, blocks, n), args, config, world_size=GPUS, device="cuda"),
                       config, hardware) for n in (2, 3)}
    full = price(compile_program(model, args, config, world_size=GPUS, device="cuda"), config, hardware)
    guess = extrapolate(priced[2], priced[3], depth)
    # Identical blocks: the fourth costs what the third did, to the rounding of the sums.
    assert guess.micro_seconds == pytest.approx(full.micro_seconds, rel=1e-9)
    assert guess.step_seconds == pytest.approx(full.step_seconds, rel=1e-9)
    assert guess.peak_bytes == full.peak_bytes and guess.forward_flops == full.forward_flops


def test_the_base_moves_to_where_the_blocks_are_alike():
    # A model whose first two blocks are unlike the rest (each costs 1 s, then 2 s from the third on).
    def price_at(n: int) -> Priced:
        seconds = sum(1.0 if i < 2 else 2.0 for i in range(n))
        return Priced(seconds, 0.5, 1000.0 * n, 10.0 * n)

    asked = []
    k, priced = steady_depth(lambda n: asked.append(n) or price_at(n), 32)
    assert k == 2 and asked == [2, 3, 4]  # 2 -> 3 and 3 -> 4 both add 2 s: alike from 2 blocks on
    k, priced = steady_depth(price_at, 32, start=1)
    assert k == 2 and sorted(priced) == [1, 2, 3, 4]  # 1 -> 2 adds 1 s, 2 -> 3 adds 2 s: not from 1
    assert extrapolate(priced[k], priced[k + 1], 32, k) == price_at(32)
    assert steady_depth(price_at, 3, start=1)[1].keys() == {1, 2, 3}  # (never past the model's depth)


def test_the_backward_recomputes_each_unit_where_its_backward_runs():
    # Before this, the backward views autograd took of saved tensors (their `detach`) stayed where
    # the forward made them, so every unit was recomputed at the backward's start, in forward
    # order, all alive at once.
    with torch.device("meta"):
        model = NextTokenLoss(build_model("llama-small(n_blocks=3, seq_len=32)"))
    args, _ = _call(2)
    config = Config(activations=Activations(recompute="unit"))
    backward = compile_program(model, args, config, world_size=GPUS).schedule.program("backward")
    first = {}
    for i, ins in enumerate(backward.instructions):
        if ins.kind == "compute" and ins.unit and ins.unit.startswith("model.blocks."):
            first.setdefault(ins.unit, i)
    assert sorted(first, key=first.get) == ["model.blocks.2", "model.blocks.1", "model.blocks.0"]


def test_each_candidate_reads_back_from_its_ds_config():
    for stage in STAGES:
        for recompute in RECOMPUTES:
            for offload in OFFLOADS:
                c = Candidate(stage=stage, micro_batch=2, accumulation=4, recompute=recompute, offload=offload)
                config = c.config(8)
                read = Config.from_deepspeed(json.loads(json.dumps(c.deepspeed(8))))
                if recompute in FXZERO_ONLY:  # (no DeepSpeed key: the nearest, and the Config exact)
                    assert read.activations == Activations(recompute="unit")
                    read = dataclasses.replace(read, activations=ACTIVATIONS[recompute])
                assert read == config
                assert read.train_batch_size == 64 and read.stage == stage
                namespace: dict = {}
                exec(python_snippet(config), namespace)
                assert namespace["config"] == config
                assert python_snippet(read) == python_snippet(config)  # (its DeepSpeed source is not a field to write)


def test_the_written_ds_config_is_the_printed_config(runner, tmp_path):
    out = str(tmp_path / "plan")
    result = invoke(runner, "plan", SMALL, "--gpus", str(GPUS), "--preset", "h100-80gb", "--global-batch",
                    str(GLOBAL), "--micro-batch", "2", "-o", out, "--json")
    printed = json.loads(result.stdout)
    best = printed["best"]
    with open(os.path.join(out, "ds_config.json")) as f:
        ds = json.load(f)
    assert ds == best["ds_config"]
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * GPUS
    namespace: dict = {}
    with open(os.path.join(out, "fxzero_config.py")) as f:
        code = f.read()
    assert code == best["fxzero_config"]
    exec(code, namespace)
    read = Config.from_deepspeed(ds)
    if best["recompute"] in FXZERO_ONLY:
        read = dataclasses.replace(read, activations=ACTIVATIONS[best["recompute"]])
    assert namespace["config"] == read
    assert printed["rows"][0]["fits"] and printed["rows"][0]["stage"] == best["stage"]
    assert best["peak_bytes"] <= printed["device_memory_bytes"]


@pytest.mark.parametrize("args, message", [
    (["--preset", "h100"], "Error: unknown --preset 'h100': a plan needs a GPU preset that states its memory; "
                           "choose one of a100-40gb, a100-80gb, h100-80gb, h200-141gb"),
    (["--preset", "cpu-loopback"], "Error: unknown --preset 'cpu-loopback'"),
    (["--preset", "h100-80gb", "--global-batch", "9"], "Error: --global-batch 9 is not divisible by --gpus 2 (global "
                                                       "batch = micro-batch x accumulation x GPUs): give a multiple "
                                                       "of 2, e.g. --global-batch 8"),
    (["--preset", "h100-80gb", "--global-batch", "8", "--micro-batch", "3"],
     "Error: --global-batch 8 is not divisible by --gpus 2 x --micro-batch 3"),
])
def test_mistakes_are_one_line_naming_the_fix(runner, args, message):
    result = invoke(runner, "plan", SMALL, "--gpus", str(GPUS), *args, ok=False)
    assert result.exit_code == 1
    assert result.output.startswith(message) and result.output.count("\n") == 1, result.output


def test_a_model_without_a_sequence_of_its_own_needs_seq(runner):
    config = json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 128})
    result = invoke(runner, "plan", "transformers:LlamaForCausalLM", "--model-config", config, "--gpus", "2",
                    "--preset", "h100-80gb", ok=False)
    assert result.exit_code == 1
    assert result.output.startswith("Error: --seq is needed: transformers:LlamaForCausalLM has no training sequence "
                                    "of its own") and "e.g. --seq 4096" in result.output
    assert result.output.count("\n") == 1, result.output

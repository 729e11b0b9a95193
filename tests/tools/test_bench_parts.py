"""The benchmark's parts on their own: run spec, system table, traffic counter, summary."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks
from tools.bench import report, systems
from tools.bench.commcount import CommCounter, install
from tools.bench.spec import RunSpec


def test_run_spec_round_trips_through_json():
    spec = RunSpec(model="tiny", batch=3, warmup=0, steps=2, betas=(0.8, 0.9))
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="steps"):
        RunSpec(model="tiny", batch=1, steps=0)


def test_unknown_config_knob_makes_a_system_unavailable(monkeypatch):
    monkeypatch.setitem(
        systems.SYSTEMS, "fxzero-bogus", systems.System("fxzero_engine", {"config": {"no_such_knob": 1}})
    )
    reason = systems.unavailable("fxzero-bogus", RunSpec(model="tiny", batch=1))
    assert reason is not None and "no_such_knob" in reason
    assert systems.unavailable("fxzero-stage3", RunSpec(model="tiny", batch=1)) is None


def _count_collectives(rank: int, world: int) -> dict:
    counter = CommCounter()
    install(counter)
    dist.all_reduce(torch.ones(5))  # not counted: the counter is off
    counter.enabled = True
    out = torch.empty(4 * world)
    dist.all_gather_into_tensor(out, torch.ones(4))
    dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * world))
    dist.all_reduce(torch.ones(7))
    dist.barrier()
    counter.enabled = False
    return counter.report(steps=1)


def test_counter_counts_full_buffers_once():
    world = 2
    for rep in run_ranks(_count_collectives, world):
        kinds = rep["by_kind"]
        assert kinds["all_gather"] == {"calls": 1, "elements": 4 * world, "bytes": 16 * world}
        assert kinds["reduce_scatter"] == {"calls": 1, "elements": 3 * world, "bytes": 12 * world}
        assert kinds["all_reduce"] == {"calls": 1, "elements": 7, "bytes": 28}
        assert kinds["barrier"]["calls"] == 1
        assert rep["elements"] == 4 * world + 3 * world + 7
        assert rep["volume_elements"] == 4 * world + 3 * world + 2 * 7


def _system(median: float, rss: float, elements: float, volume: float) -> dict:
    return {
        "median_step_s": median, "peak_rss_mb": rss, "comm_elements_per_step": elements,
        "comm_volume_elements_per_step": volume, "loss_max_abs_dev_vs_ddp": 0.0,
        "loss_max_rel_dev_vs_ddp": 0.0,
    }


def test_summary_ratios():
    phi = 100
    line = report.summary_line(
        {
            "ddp": {"median_step_s": 1.0, "peak_rss_mb": 900.0, "comm_elements_per_step": phi},
            "fsdp2": _system(2.0, 1000.0, 300, 300),
            "ds-zero3": _system(4.0, 1200.0, 300, 300),
            "fxzero-stage3": _system(1.0, 1100.0, 302, 402),
        },
        phi, "tiny", {"ds-zero3-offload-nvme": "no libaio"},
    )
    fx = line["fxzero"]["fxzero-stage3"]
    assert fx["step_vs_fsdp2"] == pytest.approx(0.5)
    assert fx["step_vs_ds_zero3"] == pytest.approx(0.25)
    assert fx["peak_rss_vs_fsdp2"] == pytest.approx(1.1)
    assert fx["comm_vs_3phi"] == pytest.approx(302 / 300)
    assert fx["met"] == {"step_vs_fsdp2": True, "step_vs_ds_zero3": True, "peak_rss_vs_fsdp2": False, "comm_vs_3phi": True}
    assert line["unavailable"] == {"ds-zero3-offload-nvme": "no libaio"}
    assert line["losses_agree"] is True


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(system: str, round_: int, steps: list[float], rss: list[float], losses: list[float], **extra) -> dict:
    line = {
        "event": "run", "system": system, "round": round_, "ok": True, "wall_s": 1.0,
        "median_step_s": sorted(steps)[len(steps) // 2], "step_times_s": steps, "warmup_step_s": [9.0],
        "losses": losses, "final_loss": losses[-1], "peak_rss_mb_per_rank": rss,
        "rss_after_setup_mb_per_rank": [r / 2 for r in rss], "setup_s": 0.5, "background_cores": 0.1,
        "comm": {"by_kind": {"all_reduce": {"calls": 1, "elements": 1000, "bytes": 4000}}, "elements": 1000,
                 "bytes": 4000, "volume_elements": 2000},
        "comm_counted_by": "wrapped collectives", "loopback_bytes_per_step": None,
    }
    line.update(extra)
    return line


def test_summarize_pools_the_kept_runs_of_every_round(tmp_path):
    """`bench.py --summarize` of hand-written run lines: the medians pool every kept timed step
    of every round (not the rounds' medians), a discarded or failed run counts for nothing, and
    the ratios are those of these medians; all worked out here."""
    phi = 1000
    engine = {"engine_comm_per_step": {"all_gather": {"calls": 2, "elements": 2400, "bytes": 9600},
                                       "reduce_scatter": {"calls": 1, "elements": 1200, "bytes": 4800}},
              "engine_comm_elements_per_step": 3600, "engine_comm_bytes_per_step": 14400,
              "engine_comm_counted_by": "engine.comm_report()"}
    lines = [
        {"event": "config", "spec": {"model": "tiny"}, "num_params": phi},
        {"event": "unavailable", "system": "ds-zero3", "reason": "not here"},
        _run("ddp", 1, [0.30, 0.10], [100, 110], [2.0, 1.5]),
        _run("fsdp2", 1, [1.0, 3.0], [200, 150], [2.0, 1.5000001]),
        _run("fxzero-stage3", 1, [0.5, 0.9], [300, 100], [2.0, 1.6], **engine),
        _run("ddp", 2, [0.20, 0.40], [120, 90], [2.0, 1.5]),
        _run("fsdp2", 2, [100.0, 100.0], [9999, 9999], [2.0, 1.5], discarded="background load 2 cores",
             background_cores=2.0),
        _run("fsdp2", 2, [2.0, 5.0], [180, 210], [2.0, 1.5]),
        _run("fxzero-stage3", 2, [0.7, 0.6], [100, 250], [2.0, 1.6], background_cores=2.5, **engine),
        {"event": "run", "system": "fxzero-stage3", "round": 3, "ok": False, "wall_s": 1.0, "error": "boom"},
    ]
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "a progress line, not JSON\n")
    proc = subprocess.run([sys.executable, "tools/bench.py", "--summarize", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    systems = {line["system"]: line for line in out if line["event"] == "system"}
    summary = out[-1]
    assert [line["event"] for line in out] == ["system"] * 3 + ["summary"]

    # pooled medians: ddp (0.2 + 0.3) / 2; fsdp2 of 1, 2, 3, 5 (the discarded 100s left out);
    # fxzero of 0.5, 0.6, 0.7, 0.9 (the median of its rounds' medians would be 0.675)
    want = {"ddp": 0.25, "fsdp2": 2.5, "fxzero-stage3": 0.65}
    for name, median in want.items():
        assert systems[name]["median_step_s"] == pytest.approx(median, rel=1e-12), name
        assert summary["median_step_s"][name] == pytest.approx(median, rel=1e-12), name
    assert (systems["fxzero-stage3"]["rounds_ok"], systems["fxzero-stage3"]["rounds_failed"]) == (2, 1)
    # peak RSS per rank is the most over rounds; the system's, the most over ranks
    assert systems["fsdp2"]["peak_rss_mb_per_rank"] == [200, 210] and systems["fsdp2"]["peak_rss_mb"] == 210
    assert systems["fxzero-stage3"]["peak_rss_mb_per_rank"] == [300, 250]
    fx = summary["fxzero"]["fxzero-stage3"]
    assert fx["step_vs_fsdp2"] == pytest.approx(0.65 / 2.5, rel=1e-12)
    assert fx["step_vs_ds_zero3"] is None and summary["unavailable"] == {"ds-zero3": "not here"}
    assert fx["peak_rss_vs_fsdp2"] == pytest.approx(300 / 210, rel=1e-12)
    assert fx["comm_vs_3phi"] == pytest.approx(3600 / (3 * phi), rel=1e-12)  # the engine's own count
    assert fx["met"] == {"step_vs_fsdp2": True, "step_vs_ds_zero3": None, "peak_rss_vs_fsdp2": False,
                         "comm_vs_3phi": False}
    # quiet rounds only (background <= 0.3 cores): fxzero's first round, both of fsdp2's kept ones
    assert fx["step_vs_fsdp2_quiet"] == pytest.approx(0.7 / 2.5, rel=1e-12)
    # losses against DDP's, step by step, from each system's first kept round
    assert summary["loss_max_abs_dev_vs_ddp"] == pytest.approx({"fsdp2": 1e-7, "fxzero-stage3": 0.1}, rel=1e-6)
    assert summary["loss_max_rel_dev_vs_ddp"]["fxzero-stage3"] == pytest.approx(0.1 / 1.5, rel=1e-6)
    assert summary["losses_agree"] is False and summary["failed"] == []


# --- bf16 variants -------------------------------------------------------------------------


def test_bf16_systems_are_in_the_table_and_a_group():
    assert systems.expand(["bf16"]) == list(systems.BF16_SYSTEMS) == [
        "ddp-bf16", "fsdp2-bf16", "ds-zero3-bf16", "floor-bf16", "fxzero-stage3-bf16",
    ]
    assert systems.expand(["ddp", "bf16", "ddp-bf16"]) == ["ddp", *systems.BF16_SYSTEMS]  # each once
    assert systems.expand(["default"]) == list(systems.DEFAULT_SYSTEMS)
    for name in systems.BF16_SYSTEMS:
        assert systems.SYSTEMS[name].precision == "bf16", name
    assert systems.SYSTEMS["floor-bf16"].trains_alike is False and systems.SYSTEMS["floor"].trains_alike is False
    assert systems.SYSTEMS["ddp"].precision == "fp32" and systems.SYSTEMS["ddp"].trains_alike
    assert systems.SYSTEMS["ddp-bf16"].options == {"autocast": "bf16"}
    assert systems.SYSTEMS["fsdp2-bf16"].options == {"mixed_precision": "bf16"}
    assert systems.SYSTEMS["ds-zero3-bf16"].options == {"offload": None, "bf16": True}
    assert systems.SYSTEMS["fxzero-stage3-bf16"].options["config"] == {"mixed_precision": "bf16"}


def test_make_config_maps_mixed_precision_names():
    import fxzero
    from tools.bench.fxzero_engine import MIXED_PRECISION, make_config

    spec = RunSpec(model="tiny", batch=1)
    config = make_config(spec, {"mixed_precision": "bf16"})
    assert config.mixed_precision == fxzero.MixedPrecision(param_dtype=torch.bfloat16)
    assert config.mixed_precision.param_dtype is torch.bfloat16
    assert config.mixed_precision.reduce_dtype is torch.float32  # MixedPrecision's default
    assert config.stage == 3 and config.seed == spec.seed
    assert make_config(spec, {}).mixed_precision is None  # fp32 systems: Config's default
    assert make_config(spec, {"mixed_precision": None}).mixed_precision is None
    assert set(MIXED_PRECISION) == {"bf16"}
    for bad in ("bfloat16", "fp8", torch.bfloat16):
        with pytest.raises(ValueError, match="mixed_precision"):
            make_config(spec, {"mixed_precision": bad})
    # the same as the system table sees it, before any rank starts
    assert systems.unavailable("fxzero-stage3-bf16", spec) is None


def test_unknown_mixed_precision_name_makes_a_system_unavailable(monkeypatch):
    monkeypatch.setitem(
        systems.SYSTEMS, "fxzero-fp8",
        systems.System("fxzero_engine", {"config": {"mixed_precision": "fp8"}}, precision="bf16"),
    )
    reason = systems.unavailable("fxzero-fp8", RunSpec(model="tiny", batch=1))
    assert reason is not None and "fp8" in reason and "bf16" in reason


def test_runner_dtype_options():
    from tools.bench.common import dtype_option, lm_loss
    from tools.bench.deepspeed_zero3 import ds_config

    assert dtype_option("ddp", "autocast", "bf16") is torch.bfloat16
    assert dtype_option("ddp", "autocast", None) is None
    with pytest.raises(ValueError, match="autocast"):
        dtype_option("ddp", "autocast", "fp16")
    spec = RunSpec(model="tiny", batch=1)
    assert ds_config(spec, None, 100, None, bf16=True)["bf16"] == {"enabled": True}
    assert ds_config(spec, None, 100, None)["bf16"] == {"enabled": False}
    assert ds_config(spec, None, 100, None, bf16=True)["optimizer"]["params"]["torch_adam"] is True
    # the loss is fp32 whatever the logits' dtype, and for fp32 logits the same as before
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    y = torch.randint(11, (2, 3), generator=torch.Generator().manual_seed(1))
    low = lm_loss(logits.bfloat16(), y)
    assert low.dtype is torch.float32
    assert torch.equal(low, torch.nn.functional.cross_entropy(logits.bfloat16().float().flatten(0, 1), y.flatten()))
    assert torch.equal(lm_loss(logits, y), torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_summary_ratios_bf16():
    """fxzero-stage3-bf16 against the bf16 systems (never the fp32 ones), and the fp32 fxzero
    system against the fp32 ones as before, in one summary."""
    phi = 100
    bf16 = dict(precision="bf16")
    line = report.summary_line(
        {
            "ddp": {"median_step_s": 1.0, "peak_rss_mb": 900.0, "comm_elements_per_step": phi},
            "fsdp2": _system(2.0, 1000.0, 300, 300),
            "ds-zero3": _system(4.0, 1200.0, 300, 300),
            "fxzero-stage3": _system(1.0, 900.0, 300, 300),
            "ddp-bf16": {"median_step_s": 0.7, "peak_rss_mb": 950.0, "comm_elements_per_step": phi, **bf16},
            "fsdp2-bf16": {**_system(1.0, 800.0, 300, 300), **bf16},
            "ds-zero3-bf16": {**_system(1.2, 1000.0, 300, 300), **bf16},
            "floor-bf16": {**_system(0.5, 700.0, 0, 0), **bf16},
            "fxzero-stage3-bf16": {**_system(0.6, 840.0, 302, 302), **bf16},
        },
        phi, "small", {},
    )
    fx = line["fxzero"]["fxzero-stage3-bf16"]
    assert fx["precision"] == "bf16"
    assert fx["step_vs_fsdp2_bf16"] == pytest.approx(0.6)
    assert fx["step_vs_ds_zero3_bf16"] == pytest.approx(0.5)
    assert fx["step_vs_floor_bf16"] == pytest.approx(1.2)
    assert fx["peak_rss_vs_fsdp2_bf16"] == pytest.approx(1.05)
    assert fx["comm_vs_3phi"] == pytest.approx(302 / 300)
    assert not {"step_vs_fsdp2", "step_vs_ds_zero3", "peak_rss_vs_fsdp2"} & set(fx)  # no bf16 / fp32 ratio
    assert fx["met"] == {"step_vs_fsdp2_bf16": True, "step_vs_ds_zero3_bf16": True, "step_vs_floor_bf16": False,
                         "peak_rss_vs_fsdp2_bf16": False, "comm_vs_3phi": True}
    fp32 = line["fxzero"]["fxzero-stage3"]
    assert fp32["step_vs_fsdp2"] == pytest.approx(0.5) and fp32["step_vs_ds_zero3"] == pytest.approx(0.25)
    assert "precision" not in fp32 and not any(key.endswith("_bf16") for key in fp32)
    assert line["targets"]["step_vs_fsdp2_bf16"].startswith("<= 0.8")
    assert line["targets"]["step_vs_ds_zero3_bf16"].startswith("<= 0.75")
    assert line["targets"]["step_vs_floor_bf16"].startswith("<= 1.1")
    assert line["targets"]["peak_rss_vs_fsdp2_bf16"].startswith("<= 1.0")
    # the bars, never lowered
    assert {k: report.TARGETS[k] for k in fx["met"] if k != "comm_vs_3phi"} == {
        "step_vs_fsdp2_bf16": 0.8, "step_vs_ds_zero3_bf16": 0.75, "step_vs_floor_bf16": 1.1,
        "peak_rss_vs_fsdp2_bf16": 1.0,
    }

    # each ratio's reference missing: None, and not met either way
    alone = report.summary_line({"fxzero-stage3-bf16": {**_system(0.6, 840.0, 300, 300), **bf16}}, phi, "small", {})
    fx = alone["fxzero"]["fxzero-stage3-bf16"]
    assert fx["step_vs_fsdp2_bf16"] is fx["step_vs_floor_bf16"] is fx["peak_rss_vs_fsdp2_bf16"] is None
    assert fx["met"]["step_vs_floor_bf16"] is None


def test_summarize_compares_bf16_losses_with_ddp_bf16(tmp_path):
    """`bench.py --summarize` of hand-written run lines of fp32 and bf16 systems: fp32 losses
    against DDP's at 1e-5, bf16 ones against ddp-bf16's at 2e-2 (never against fp32 DDP), the
    floor's first step only (its ranks part after the first update); and the bf16 ratios."""
    phi = 1000
    engine = {"engine_comm_per_step": {"all_gather": {"calls": 2, "elements": 2000, "bytes": 4000},
                                       "reduce_scatter": {"calls": 1, "elements": 1000, "bytes": 4000}},
              "engine_comm_elements_per_step": 3000, "engine_comm_bytes_per_step": 8000,
              "engine_comm_counted_by": "engine.comm_report()"}
    rss = [400.0, 410.0]
    lines = [
        {"event": "config", "spec": {"model": "small"}, "num_params": phi},
        _run("ddp", 1, [1.0, 1.2], rss, [2.0, 1.5]),
        _run("fxzero-stage3", 1, [0.9, 1.0], rss, [2.0, 1.5000001], **engine),
        # bf16 losses: 1% off fp32 DDP (far beyond 1e-5), within 2e-2 of ddp-bf16
        _run("ddp-bf16", 1, [0.7, 0.8], [500.0, 500.0], [2.02, 1.515]),
        _run("fsdp2-bf16", 1, [1.0, 1.0], [420.0, 400.0], [2.02, 1.53]),
        _run("ds-zero3-bf16", 1, [1.5, 1.3], [600.0, 600.0], [2.03, 1.52]),
        _run("floor-bf16", 1, [0.5, 0.5], [380.0, 380.0], [2.02, 1.9]),  # parts after step 1: fine
        _run("fxzero-stage3-bf16", 1, [0.6, 0.6], [400.0, 399.0], [2.02, 1.51], **engine),
    ]
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.run([sys.executable, "tools/bench.py", "--summarize", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    by_system = {line["system"]: line for line in out if line["event"] == "system"}
    assert [line["system"] for line in out[:-1]] == [line["system"] for line in lines[1:]]  # the runs' order
    summary = out[-1]
    assert by_system["fxzero-stage3-bf16"]["precision"] == "bf16" and by_system["ddp"]["precision"] == "fp32"
    assert by_system["fsdp2-bf16"]["loss_reference"] == "ddp-bf16"

    assert set(summary["loss_max_rel_dev_vs_ddp"]) == {"fxzero-stage3"}
    assert set(summary["loss_max_rel_dev_vs_ddp_bf16"]) == {"fsdp2-bf16", "ds-zero3-bf16", "fxzero-stage3-bf16"}
    assert summary["loss_max_rel_dev_vs_ddp_bf16"]["fsdp2-bf16"] == pytest.approx(0.015 / 1.515, rel=1e-9)
    assert summary["loss_max_rel_dev_vs_ddp_bf16"]["ds-zero3-bf16"] == pytest.approx(0.01 / 2.02, rel=1e-9)
    assert summary["loss_max_abs_dev_vs_ddp_bf16"]["fxzero-stage3-bf16"] == pytest.approx(0.005, rel=1e-9)
    assert summary["loss_first_step_rel_dev_vs_ddp_bf16"] == {"floor-bf16": 0.0}
    assert "floor-bf16" not in summary["loss_max_rel_dev_vs_ddp_bf16"]
    assert summary["losses_agree_fp32"] is True and summary["losses_agree_bf16"] is True
    assert summary["losses_agree"] is True
    assert "ddp-bf16" in summary["loss_tolerance_bf16"] and "0.02" in summary["loss_tolerance_bf16"]

    fx = summary["fxzero"]["fxzero-stage3-bf16"]
    assert fx["step_vs_fsdp2_bf16"] == pytest.approx(0.6 / 1.0, rel=1e-12)
    assert fx["step_vs_ds_zero3_bf16"] == pytest.approx(0.6 / 1.4, rel=1e-12)  # median of 1.5, 1.3
    assert fx["step_vs_floor_bf16"] == pytest.approx(0.6 / 0.5, rel=1e-12)
    assert fx["peak_rss_vs_fsdp2_bf16"] == pytest.approx(400 / 420, rel=1e-12)
    assert fx["comm_vs_3phi"] == pytest.approx(1.0)
    assert fx["met"] == {"step_vs_fsdp2_bf16": True, "step_vs_ds_zero3_bf16": True, "step_vs_floor_bf16": False,
                         "peak_rss_vs_fsdp2_bf16": True, "comm_vs_3phi": True}
    assert fx["step_vs_floor_bf16_quiet"] == pytest.approx(0.6 / 0.5, rel=1e-12)
    assert summary["fxzero"]["fxzero-stage3"]["step_vs_fsdp2"] is None  # no fp32 fsdp2 here

    # a bf16 system beyond 2e-2 of ddp-bf16, or a floor whose first step differs: not agreed
    for name, losses in (("fsdp2-bf16", [2.02, 1.56]), ("floor-bf16", [2.1, 1.5])):
        bad = [_run(name, 1, [1.0, 1.0], rss, losses) if line.get("system") == name else line for line in lines]
        path.write_text("".join(json.dumps(line) + "\n" for line in bad))
        proc = subprocess.run([sys.executable, "tools/bench.py", "--summarize", str(path)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout.splitlines()[-1])
        assert (summary["losses_agree_bf16"], summary["losses_agree_fp32"], summary["losses_agree"]) == (False, True, False), name


# --- activations side by side (issue 23) -----------------------------------------------------


def test_run_spec_sequence_length():
    from tools.bench.spec import gpt_shape, zoo_name

    spec = RunSpec(model="tiny", batch=2, seq=24)
    assert RunSpec.from_json(spec.to_json()) == spec
    assert RunSpec(model="tiny", batch=2).seq is None
    with pytest.raises(ValueError, match="seq"):
        RunSpec(model="tiny", batch=1, seq=0)
    assert gpt_shape("tiny", 24).seq_len == 24 and gpt_shape("tiny").seq_len == 16
    # a benchmark-only shape keeps its own overrides
    assert zoo_name("gpt-1b", 64) == ("1b", {"vocab_size": 8192, "n_blocks": 20, "tie_head": False, "seq_len": 64})
    assert zoo_name("gpt-1b") == ("1b", {"vocab_size": 8192, "n_blocks": 20, "tie_head": False})


def test_activation_systems_are_in_the_table_and_a_group():
    group = systems.expand(["activations"])
    assert group == list(systems.ACTIVATION_SYSTEMS) == [
        "ddp", "fsdp2", "fsdp2-ckpt", "ds-zero3", "ds-zero3-ckpt",
        "fxzero-stage3", "fxzero-stage3-unit", "fxzero-stage3-unit-attention", "fxzero-stage3-selective",
    ]
    table = systems.SYSTEMS
    for name in group:
        system = table[name]
        if system.activations == "none":
            assert system.resident is None, name
        else:  # its resident twin is the same runner with the same options, less the checkpointing
            twin = table[system.resident]
            assert twin.runner == system.runner and twin.activations == "none", name
    assert table["fsdp2-ckpt"].options == {"checkpoint": True}
    assert table["ds-zero3-ckpt"].options == {"offload": None, "activation_checkpointing": True}
    assert table["fxzero-stage3-unit"].options["config"] == {"activations": {"recompute": "unit"}}
    assert table["fxzero-stage3-selective"].options["config"] == {"activations": {"recompute": "selective"}}
    assert table["fxzero-stage3-unit-attention"].options["config"] == {
        "activations": {"recompute": "unit", "keep_attention": True}}


def test_make_config_maps_activations(monkeypatch):
    import fxzero
    from tools.bench.fxzero_engine import make_config

    spec = RunSpec(model="tiny", batch=1)
    assert make_config(spec, {"activations": {"recompute": "unit"}}).activations == fxzero.Activations(recompute="unit")
    assert make_config(spec, {}).activations == fxzero.Activations()  # Config's default: resident
    with pytest.raises(ValueError, match="sometimes"):
        make_config(spec, {"activations": {"recompute": "sometimes"}})
    monkeypatch.setitem(
        systems.SYSTEMS, "fxzero-stage3-sometimes",
        systems.System("fxzero_engine", {"config": {"activations": {"recompute": "sometimes"}}}, activations="sometimes"),
    )
    reason = systems.unavailable("fxzero-stage3-sometimes", spec)
    assert reason is not None and "sometimes" in reason
    assert systems.unavailable("fxzero-stage3-unit", spec) is None


def test_checkpoint_blocks_recompute_and_train_alike():
    """A model whose blocks go through torch.utils.checkpoint gives the plain model's loss and
    gradients (same seed, same batch) and runs each block's forward twice per step; through a
    checkpoint function that does nothing, once: the count tells them apart."""
    import functools

    import torch.utils.checkpoint

    from tools.bench.common import build_model, checkpoint_blocks, checkpoint_report, lm_loss, make_batch

    spec = RunSpec(model="tiny", batch=2)
    x, y = make_batch(spec, 96, 16, 0, 0)
    plain = build_model(spec)
    lm_loss(plain(x), y).backward()
    for fn, forwards in ((functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False), 2),
                         (lambda block, h: block(h), 1)):
        model = checkpoint_blocks(build_model(spec), fn)
        loss = lm_loss(model(x), y)
        loss.backward()
        assert loss.item() == lm_loss(plain(x), y).item()
        got = dict(model.named_parameters())
        for name, p in plain.named_parameters():
            wrapped = re.sub(r"^blocks\.(\d+)\.", r"blocks.\1.block.", name)
            assert torch.equal(got[wrapped].grad, p.grad), name
        assert checkpoint_report(model) == {"checkpointed_blocks": 4, "checkpointed_block_forwards": 4 * forwards}
    assert checkpoint_report(plain) == {"checkpointed_blocks": 0, "checkpointed_block_forwards": 0}


def test_ds_config_activation_checkpointing_section():
    from tools.bench.deepspeed_zero3 import ds_config

    spec = RunSpec(model="tiny", batch=1)
    assert "activation_checkpointing" not in ds_config(spec, None, 100, None)
    section = ds_config(spec, None, 100, None, checkpoints=6)["activation_checkpointing"]
    assert section == {  # DeepSpeed's keys (deepspeed/runtime/activation_checkpointing/config.py)
        "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "number_checkpoints": 6, "synchronize_checkpoint_boundary": False, "profile": False,
    }


def _act(median: float, rss: float, activations: str, resident=None, act_bytes=None, losses=None, **extra) -> dict:
    line = {"median_step_s": median, "peak_rss_mb": rss, "activations": activations,
            "losses_per_rank": losses or [[2.0, 1.5], [2.1, 1.6]], "losses": [2.05, 1.55], **extra}
    if resident:
        line["resident"] = resident
    if act_bytes is not None:
        line["activations_peak_bytes"] = act_bytes
    return line


def test_activation_bars():
    """The issue's bars from hand-written system lines: values, verdicts (at the bar: pass),
    n/a where a system is missing, losses bit for bit, the peers' recompute count."""
    from tools.bench.activations import BARS, activation_summary, bar_lines

    lines = {
        "fsdp2": _act(10.0, 2000.0, "none"),
        "fsdp2-ckpt": _act(12.0, 1500.0, "checkpoint", "fsdp2", block_forwards_per_step=2.0,
                           losses=[[2.0, 1.5000001], [2.1, 1.6]]),
        "fxzero-stage3": _act(8.0, 1800.0, "none", act_bytes=1000),
        "fxzero-stage3-unit": _act(10.8, 1500.0, "unit", "fxzero-stage3", act_bytes=140),
        "fxzero-stage3-selective": _act(8.5, 1600.0, "selective", "fxzero-stage3", act_bytes=350),
    }
    part = activation_summary(lines, 1e-5)
    bars = {bar["key"]: bar for bar in part["bars"]}
    assert bars["unit_step_vs_fsdp2_ckpt"]["value"] == pytest.approx(0.9) and bars["unit_step_vs_fsdp2_ckpt"]["result"] == "pass"
    assert bars["unit_peak_rss_vs_fsdp2_ckpt"]["value"] == 1.0 and bars["unit_peak_rss_vs_fsdp2_ckpt"]["result"] == "pass"
    assert bars["unit_step_vs_resident"]["value"] == pytest.approx(1.35) and bars["unit_step_vs_resident"]["result"] == "miss"
    assert bars["selective_step_vs_resident"]["value"] == pytest.approx(8.5 / 8.0)
    assert bars["selective_step_vs_resident"]["result"] == "miss"  # 1.0625 > 1.05
    assert bars["selective_activations_vs_resident"]["value"] == pytest.approx(0.35)
    assert bars["selective_activations_vs_resident"]["result"] == "pass"
    for key in ("unit_step_vs_ds_zero3_ckpt", "unit_peak_rss_vs_ds_zero3_ckpt"):
        assert bars[key]["value"] is None and "ds-zero3-ckpt" in bars[key]["result"] and part["met"][key] is None
    assert part["costs"]["unit_activations_vs_resident"] == pytest.approx(0.14)
    assert part["costs"]["fsdp2_ckpt_step_vs_fsdp2"] == pytest.approx(1.2)
    assert part["losses"]["fxzero_policies_equal_bitwise"] is True
    assert part["losses"]["equal_to_resident"]["fsdp2-ckpt"] is False
    assert part["met"]["peer_losses_within_tolerance"] is True  # 1e-7 off: within 1e-5
    assert part["met"]["peers_recomputed"] is True
    assert bar_lines({"activations": part})[0] == (
        "[pass] fxzero unit step / FSDP2 + torch.utils.checkpoint step: 0.900 (bar <= 0.9)")
    # the bars, never lowered
    assert {key: bound for key, _, _, _, bound, _ in BARS} == {
        "unit_step_vs_fsdp2_ckpt": 0.9, "unit_step_vs_ds_zero3_ckpt": 0.8, "unit_peak_rss_vs_fsdp2_ckpt": 1.0,
        "unit_peak_rss_vs_ds_zero3_ckpt": 1.0, "unit_step_vs_resident": 1.30, "selective_step_vs_resident": 1.05,
        "selective_activations_vs_resident": 0.35,
    }

    # one policy one ulp off the resident run on one rank: not equal; a checkpoint that did nothing
    off = math.nextafter(1.5, 2.0)
    lines["fxzero-stage3-selective"] = _act(8.0, 1600.0, "selective", "fxzero-stage3", act_bytes=350,
                                            losses=[[2.0, off], [2.1, 1.6]])
    lines["fsdp2-ckpt"]["block_forwards_per_step"] = 1.0
    part = activation_summary(lines, 1e-5)
    assert part["met"]["fxzero_losses_equal"] is False and part["met"]["peers_recomputed"] is False
    assert part["losses"]["equal_to_resident"] == {"fsdp2-ckpt": False, "fxzero-stage3-unit": True,
                                                   "fxzero-stage3-selective": False}
    # no system recomputes: no activations part at all
    assert activation_summary({"fsdp2": lines["fsdp2"]}, 1e-5) is None


def test_summarize_adds_the_activation_bars(tmp_path):
    """`bench.py --summarize` of hand-written run lines of the activation systems: the system
    lines take `activations` and `resident` from the table, the summary has the bars, stderr
    prints them."""
    rss = [400.0, 410.0]
    mem = {"memory_report": {"activations_peak": 900}}
    lines = [
        {"event": "config", "spec": {"model": "small"}, "num_params": 1000},
        _run("ddp", 1, [1.0, 1.2], rss, [2.0, 1.5]),
        _run("fsdp2-ckpt", 1, [2.0, 2.0], [500.0, 500.0], [2.0, 1.5], block_forwards_per_step=2.0),
        _run("fxzero-stage3", 1, [1.0, 1.0], rss, [2.0, 1.5], activations_peak_bytes_per_rank=[900, 800], **mem),
        _run("fxzero-stage3-unit", 1, [1.2, 1.2], [300.0, 310.0], [2.0, 1.5],
             activations_peak_bytes_per_rank=[100, 90], **mem),
    ]
    path = tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.run([sys.executable, "tools/bench.py", "--summarize", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    by_system = {line["system"]: line for line in out if line["event"] == "system"}
    assert by_system["fxzero-stage3-unit"]["resident"] == "fxzero-stage3"
    assert by_system["fxzero-stage3-unit"]["activations_peak_bytes"] == 100
    assert by_system["fsdp2-ckpt"]["activations"] == "checkpoint" and by_system["ddp"]["activations"] == "none"
    bars = {bar["key"]: bar for bar in out[-1]["activations"]["bars"]}
    assert bars["unit_step_vs_fsdp2_ckpt"]["value"] == pytest.approx(0.6)
    assert bars["unit_step_vs_resident"]["value"] == pytest.approx(1.2)
    assert "[pass] fxzero unit step / FSDP2 + torch.utils.checkpoint step: 0.600 (bar <= 0.9)" in proc.stderr
    assert "[pass] fxzero unit peak RSS / FSDP2 + torch.utils.checkpoint peak RSS: 0.620 (bar <= 1)" in proc.stderr

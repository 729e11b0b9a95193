"""The benchmark's parts on their own: run spec, system table, traffic counter, summary."""

from __future__ import annotations

import json
import os
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

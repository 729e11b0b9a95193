"""One quick invocation of tools/bench.py (tiny model, one timed step, one round) and its lines.

Checks the plumbing, never a wall time: every line is JSON, every system asked for is either
run or reported unavailable with a reason, the lines carry their keys, the counted traffic adds
up where it is exact (DDP all-reduces every gradient once) and all systems train alike.
DeepSpeed runs when this interpreter has it (.venv-bench); otherwise its line must say why not.

The activation side by side rides in the same invocation (issue 23): fxzero's recompute
policies and FSDP2's / DeepSpeed's checkpointing, at a sequence length (--seq) other than the
tiny model's own; their lines carry the figures the bars need, fxzero's policies' losses equal
the resident run's bit for bit, and each bar is printed with its verdict.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import fxzero.config.activations
from fxzero.zoo import gpt
from tools.bench.activations import BARS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
SYSTEMS = ["ddp", "fsdp2", "fxzero-stage3", "ds-zero3",
           "fsdp2-ckpt", "ds-zero3-ckpt", "fxzero-stage3-unit", "fxzero-stage3-selective"]
if HAVE_DEEPSPEED:
    SYSTEMS.append("ds-zero3-offload-cpu")
HAVE_SELECTIVE = "selective" in fxzero.config.activations.RECOMPUTE
SEQ = 24  # the tiny model's own is 16

RUN_KEYS = {
    "system", "round", "ok", "median_step_s", "step_times_s", "losses", "final_loss",
    "peak_rss_mb_per_rank", "comm", "comm_counted_by", "loopback_bytes_per_step",
}
SYSTEM_KEYS = {
    "system", "median_step_s", "step_times_s", "peak_rss_mb_per_rank", "peak_rss_mb",
    "comm_elements_per_step", "comm_bytes_per_step", "comm_counted_by", "final_loss",
}


@pytest.fixture(scope="module")
def proc() -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", "--quick", "--timeout", "300", "--seq", str(SEQ),
         "--systems", ",".join(SYSTEMS)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"bench.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"bench.py printed nothing; stderr:\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def output(proc) -> str:
    return proc.stdout


@pytest.fixture(scope="module")
def lines(output) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


def by_event(lines: list[dict], event: str) -> list[dict]:
    return [line for line in lines if line["event"] == event]


def test_config_first_summary_last(lines):
    assert lines[0]["event"] == "config"
    assert lines[-1]["event"] == "summary"
    assert lines[0]["spec"]["model"] == "tiny"
    assert lines[0]["systems"] == SYSTEMS


def test_seq_sets_the_models_sequence_length(lines):
    """--seq builds the model at that length (its position table has SEQ rows): the parameter
    count is the zoo model's at SEQ, counted here, not the tiny model's own."""
    def count(**overrides) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in gpt("tiny", **overrides).parameters())
    assert lines[0]["spec"]["seq"] == SEQ
    assert lines[0]["num_params"] == count(seq_len=SEQ) != count()


def test_every_system_is_run_or_unavailable(lines):
    ran = {line["system"] for line in by_event(lines, "system")}
    missing = {line["system"]: line["reason"] for line in by_event(lines, "unavailable")}
    assert ran | set(missing) == set(SYSTEMS)
    assert not ran & set(missing)
    assert all(reason for reason in missing.values())
    assert {"ddp", "fsdp2", "fxzero-stage3", "fsdp2-ckpt", "fxzero-stage3-unit"} <= ran
    if HAVE_SELECTIVE:
        assert "fxzero-stage3-selective" in ran
    else:  # Activations' own message, naming the mode
        assert "selective" in missing["fxzero-stage3-selective"]


def test_run_and_system_lines_have_their_keys(lines):
    for run in by_event(lines, "run"):
        assert run["ok"], run.get("error")
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert len(run["peak_rss_mb_per_rank"]) == 2
        assert all(mb > 0 for mb in run["peak_rss_mb_per_rank"])
        assert len(run["losses"]) == 2 and len(run["step_times_s"]) == 1
    for line in by_event(lines, "system"):
        assert SYSTEM_KEYS <= set(line), SYSTEM_KEYS - set(line)


def test_ddp_traffic_is_one_all_reduce_of_every_gradient(lines):
    phi = lines[0]["num_params"]
    ddp = next(line for line in by_event(lines, "system") if line["system"] == "ddp")
    assert set(ddp["comm_by_kind"]) == {"all_reduce"}
    assert ddp["comm_elements_per_step"] == phi
    assert ddp["comm_volume_elements_per_step"] == 2 * phi  # the ZeRO paper's 2 Phi


def test_sharded_systems_gather_and_reduce(lines):
    for line in by_event(lines, "system"):
        if line["system"] in ("fsdp2", "fxzero-stage3"):
            assert "all_gather" in line["comm_by_kind"]
            assert line["comm_elements_per_step"] > 0
    fx = next(line for line in by_event(lines, "system") if line["system"] == "fxzero-stage3")
    assert "engine.comm_report" in fx["comm_counted_by"]


def test_losses_agree_with_ddp(lines):
    summary = lines[-1]
    assert summary["losses_agree"] is True, summary["loss_max_rel_dev_vs_ddp"]
    # and they do, step by step, in the run lines themselves
    runs = {line["system"]: line for line in by_event(lines, "run") if line["ok"] and "discarded" not in line}
    for name, run in runs.items():
        assert len(run["losses"]) == len(runs["ddp"]["losses"]) == 2
        for got, want in zip(run["losses"], runs["ddp"]["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (name, got, want)
    assert set(summary["loss_max_abs_dev_vs_ddp"]) == {
        line["system"] for line in by_event(lines, "system") if line["system"] != "ddp"
    }


def test_summary_reports_ratios_for_fxzero(lines):
    targets = lines[-1]["fxzero"]["fxzero-stage3"]
    for key in ("step_vs_fsdp2", "peak_rss_vs_fsdp2", "comm_vs_3phi", "comm_volume_vs_3phi"):
        assert isinstance(targets[key], float), key
    assert set(targets["met"]) >= {"step_vs_fsdp2", "peak_rss_vs_fsdp2", "comm_vs_3phi"}


@pytest.mark.skipif(HAVE_DEEPSPEED, reason="deepspeed is installed: it runs instead")
def test_missing_deepspeed_is_reported(lines):
    reasons = {line["system"]: line["reason"] for line in by_event(lines, "unavailable")}
    assert "deepspeed is not installed" in reasons["ds-zero3"]
    assert "bench-env.sh" in reasons["ds-zero3"]


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed (scripts/bench-env.sh)")
def test_deepspeed_runs(lines):
    runs = {line["system"]: line for line in by_event(lines, "run")}
    for name in ("ds-zero3", "ds-zero3-offload-cpu"):
        assert runs[name]["ok"], runs[name].get("error")
        assert runs[name]["deepspeed"]
    assert runs["ds-zero3-offload-cpu"]["optimizer"] == "DeepSpeedCPUAdam"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def test_summary_figures_follow_from_the_run_lines(output, lines, tmp_path):
    """The system and summary lines' figures, worked out here from the raw run lines (every kept
    timed step of every round pooled; a step takes its slowest rank's time, as the run line has
    it), in the output and again from `bench.py --summarize` of it."""
    phi = lines[0]["num_params"]
    runs: dict[str, list[dict]] = {}
    for run in by_event(lines, "run"):
        if run["ok"] and "discarded" not in run:
            runs.setdefault(run["system"], []).append(run)
    median = {name: _median([t for r in rs for t in r["step_times_s"]]) for name, rs in runs.items()}
    peak_rss = {name: max(mb for r in rs for mb in r["peak_rss_mb_per_rank"]) for name, rs in runs.items()}
    fx = runs["fxzero-stage3"][0]
    fx_elements = sum(kind["elements"] for kind in fx["engine_comm_per_step"].values())
    ddp_losses = runs["ddp"][0]["losses"]
    loss_dev = {name: max(abs(a - b) for a, b in zip(rs[0]["losses"], ddp_losses)) for name, rs in runs.items()
                if name != "ddp"}

    path = tmp_path / "out.jsonl"
    path.write_text(output)
    proc = subprocess.run([sys.executable, "tools/bench.py", "--summarize", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    again = [json.loads(line) for line in proc.stdout.splitlines()]
    for got in (lines, again):
        systems = {line["system"]: line for line in by_event(got, "system")}
        summary = got[-1]
        assert summary["event"] == "summary" and set(systems) == set(runs)
        for name in runs:
            assert systems[name]["median_step_s"] == pytest.approx(median[name], rel=1e-12), name
            assert systems[name]["peak_rss_mb"] == pytest.approx(peak_rss[name], rel=1e-12), name
            assert summary["median_step_s"][name] == pytest.approx(median[name], rel=1e-12), name
        targets = summary["fxzero"]["fxzero-stage3"]
        assert targets["step_vs_fsdp2"] == pytest.approx(median["fxzero-stage3"] / median["fsdp2"], rel=1e-12)
        assert targets["peak_rss_vs_fsdp2"] == pytest.approx(peak_rss["fxzero-stage3"] / peak_rss["fsdp2"], rel=1e-12)
        assert targets["comm_vs_3phi"] == pytest.approx(fx_elements / (3 * phi), rel=1e-12)
        assert targets["met"]["step_vs_fsdp2"] == (targets["step_vs_fsdp2"] <= 0.9)
        assert summary["loss_max_abs_dev_vs_ddp"] == pytest.approx(loss_dev, rel=1e-12, abs=0)


# --- activations side by side (issue 23) -----------------------------------------------------


def _systems(lines: list[dict]) -> dict[str, dict]:
    return {line["system"]: line for line in by_event(lines, "system")}


def test_activation_lines_carry_their_figures(lines):
    systems = _systems(lines)
    for name, mode in (("fxzero-stage3", "none"), ("fxzero-stage3-unit", "unit"), ("fxzero-stage3-selective", "selective")):
        if name not in systems:
            continue
        line = systems[name]
        assert line["activations"] == mode and line["activations_policy"]["recompute"] == mode
        assert line.get("resident") == (None if mode == "none" else "fxzero-stage3")
        per_rank = line["activations_peak_bytes_per_rank"]
        assert len(per_rank) == 2 and all(isinstance(b, int) and b > 0 for b in per_rank)
        assert line["activations_peak_bytes"] == max(per_rank)
        assert per_rank[0] == line["memory_report"]["activations_peak"]  # rank 0's report, as the engine gave it
    # recompute keeps less than the resident run on every rank
    for unit, resident in zip(systems["fxzero-stage3-unit"]["activations_peak_bytes_per_rank"],
                              systems["fxzero-stage3"]["activations_peak_bytes_per_rank"]):
        assert unit < resident
    # the peers' checkpointing took effect: each block ran forward and recompute, every step
    for name in ("fsdp2-ckpt", "ds-zero3-ckpt"):
        if name in systems:
            assert systems[name]["activations"] == "checkpoint"
            assert systems[name]["block_forwards_per_step"] == 2.0, name
    assert "block_forwards_per_step" not in systems["fsdp2"]  # not wrapped
    if "ds-zero3-ckpt" in systems:
        section = systems["ds-zero3-ckpt"]["activation_checkpointing"]
        assert section["partition_activations"] is False and section["number_checkpoints"] == 4


def test_fxzero_policies_losses_are_equal_bit_for_bit(lines):
    runs = {line["system"]: line for line in by_event(lines, "run") if line["ok"] and "discarded" not in line}
    resident = runs["fxzero-stage3"]["losses_per_rank"]
    assert len(resident) == 2 and all(len(rank) == 2 for rank in resident)
    policies = [n for n in ("fxzero-stage3-unit", "fxzero-stage3-selective") if n in runs]
    for name in policies:
        assert runs[name]["losses_per_rank"] == resident, name  # exact, per rank and step
    part = lines[-1]["activations"]
    assert part["losses"]["fxzero_policies_equal_bitwise"] is True
    assert set(part["losses"]["equal_to_resident"]) >= set(policies) | {"fsdp2-ckpt"}
    assert part["met"]["fxzero_losses_equal"] is True
    assert part["met"]["peer_losses_within_tolerance"] is True
    assert part["met"]["peers_recomputed"] is True


def test_activation_bars_follow_from_the_system_lines(proc, lines):
    """Each bar's value is the ratio of the two system lines' figures, worked out here; its
    verdict is the value against the issue's bar; a bar whose system did not run is n/a; and
    every bar is printed on stderr with its verdict."""
    systems = _systems(lines)
    part = lines[-1]["activations"]
    bars = {bar["key"]: bar for bar in part["bars"]}
    for key, name, ref, figure, bound, what in BARS:
        bar = bars[key]
        assert bar["bar"] == f"<= {bound:g}"
        if name in systems and ref in systems:
            want = systems[name][figure] / systems[ref][figure]
            assert bar["value"] == pytest.approx(want, rel=1e-12) and part["ratios"][key] == bar["value"]
            assert bar["result"] == ("pass" if want <= bound else "miss")
            assert part["met"][key] is (want <= bound)
        else:
            assert bar["value"] is None and bar["result"].startswith("n/a") and part["met"][key] is None
        assert f"[{bar['result']}] {what}: " in proc.stderr
    # a recomputing fxzero system is not held to the resident peers' bars
    fx_unit = lines[-1]["fxzero"]["fxzero-stage3-unit"]
    assert "step_vs_fsdp2" not in fx_unit and "comm_vs_3phi" in fx_unit
    assert "step_vs_fsdp2" in lines[-1]["fxzero"]["fxzero-stage3"]

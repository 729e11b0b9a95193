"""tools/infinity.py end to end on a tiny model: the events, the figures and the targets it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("fused", [False, True], ids=["step", "step-in-backward"])
def test_infinity_reports_every_step_and_the_targets(tmp_path, fused):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "infinity.py"), "--nvme-path", str(tmp_path),
           "--model", "gpt-small", "--steps", "3", "--seq", "32", "--dd-bytes", str(16 << 20), "--threads", "1"]
    if fused:
        cmd.append("--step-in-backward")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds == ["disk", "init", "step", "step", "step", "summary"], proc.stderr
    disk, init, steps, summary = events[0], events[1], events[2:5], events[5]
    assert disk["read_GBps"] > 0 and disk["write_GBps"] > 0
    assert init["io"]["nvme"]["write"]["bytes"] >= 4 * init["num_params"]  # materialized into the tier
    for s in steps:
        assert s["optimizer_read_bytes"] > 0 and s["optimizer_write_bytes"] > 0
        assert s["memory"]["param_shards"] == 0 and s["memory"]["optimizer_states"] == 0
        assert s["step_in_backward"] is fused
    assert summary["losses"] == [s["loss"] for s in steps]
    # A 27M model does not meet the size targets, and the tool says so with exit code 1.
    targets = summary["targets"]
    assert targets["params_at_least_2e9"] is False and targets["model_states_exceed_ram"] is False
    assert targets["losses_finite_and_decreasing"] is True and targets["peak_rss_under_8GiB"] is True
    assert proc.returncode == 1
    assert os.listdir(tmp_path) == [], "the tool removes its files"

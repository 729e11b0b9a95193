"""tools/gpu_check.py, the one prepared GPU check, runs here as `--dry-run`: the same flow on the
meta device (every program traced for an accelerator, every buffer on it, no host read in a
forward or backward); the sections that need a GPU say they were skipped. Without CUDA and
without --dry-run it refuses, naming both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "gpu_check.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=280, cwd=ROOT)


def test_the_dry_run_trains_every_model_on_the_stand_in_device():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["dry_run"] is True and report["torch"] == torch.__version__
    assert set(report["models"]) == {"zoo-gpt-fp32", "zoo-gpt-bf16", "hf-llama-bf16"}
    for name, model in report["models"].items():
        assert "error" not in model, (name, model.get("traceback"))
        assert model["fxzero_steps"] == 6  # 5 and the one whose syncs are counted
        assert (model["host_syncs"]["forward_backward"], model["host_syncs"]["step"]) == (0, 1)
    for section in (*report["offload"].values(), report["sanitizer"], report["checkpoint"]):
        assert section["skipped"].startswith("dry run")
    activations = report["activations"]
    assert "error" not in activations, activations.get("traceback")
    held = {p: activations[p]["counted"] for p in ("none", "unit", "selective", "cpu", "budget")}
    assert held["unit"] < held["selective"] < held["none"]
    assert held["budget"] <= activations["budget"]["budget"] < held["none"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_without_cuda_the_check_asks_for_a_gpu_or_the_dry_run():
    proc = _run()
    assert proc.returncode == 2
    assert "no CUDA device here: run on a GPU machine, or with --dry-run" in proc.stderr

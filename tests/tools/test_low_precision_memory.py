"""tools/low_precision_memory.py in a world of one: both DeepSpeedExamples configs read, what each
engine holds equal to the estimate, and the bf16_full config at half the baseline's bytes
(2 + 2 + 4 against 2 + 2 + 4 + 8 per parameter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_the_tool_reports_the_bytes_each_config_holds():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "low_precision_memory.py"), "--size", "tiny",
                          "--steps", "1"], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    baseline, full, summary = (json.loads(line) for line in out.splitlines() if line.startswith("{"))
    assert baseline["dtypes"]["masters"] == "float32" and full["dtypes"] == {
        "compute": "bfloat16", "grads": "bfloat16", "masters": "bfloat16", "optimizer_states": "bfloat16"}
    assert full["autocast"] == "bfloat16" and baseline["autocast"] is None
    for row in (baseline, full):
        assert row["model_states"] == row["estimate"]
    assert (baseline["bytes_per_parameter"], full["bytes_per_parameter"]) == (16.0, 8.0)
    assert summary["ratio"] == 0.5

"""tools/recompute_memory.py, resident against Activations(recompute="unit") and "selective"
side by side, runs (tiny sizes): the policies on 2 ranks, equal losses, and recompute keeps
fewer activation bytes, unit fewer than selective. (The figures at sequence 1024 are in the issue's note; tests never assert a time.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_policies_run_side_by_side_with_equal_losses():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "recompute_memory.py"), "--seq", "64",
                           "--batch", "1", "--rounds", "1", "--steps", "1"],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    ranks = [line for line in lines if line["event"] == "rank"]
    assert sorted((r["policy"], r["rank"]) for r in ranks) == [(p, r) for p in ("none", "selective", "unit")
                                                                for r in (0, 1)]
    summary = lines[-1]
    assert summary["event"] == "summary"
    assert summary["unit_losses_equal"] is True and summary["selective_losses_equal"] is True
    assert summary["kept_bytes"]["unit"] < summary["kept_bytes"]["selective"] < summary["kept_bytes"]["none"]
    assert summary["kept_bytes"]["unit_over_resident"] < 1

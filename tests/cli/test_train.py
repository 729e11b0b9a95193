"""`fxzero train`: torchrun underneath, progress per step, artifacts of what ran."""

from __future__ import annotations

import json
import os
import re
import textwrap

from fxzero.artifacts import Artifacts
from tests.cli.conftest import TINY, invoke


def test_train_two_ranks_shows_progress_and_records(tmp_path, runner):
    out = str(tmp_path / "run")
    result = invoke(runner, "train", TINY, "--ranks", "2", "--steps", "3", "--lr", "1e-2", "-o", out)
    text = result.output
    assert "with ZeRO-3 on 2 ranks" in text and "task: predict a fixed permutation" in text
    steps = re.findall(r"^step\s+(\d+)/3\s+loss (\d+\.\d+)\s+[\d.]+ ms\s+mem/rank (\S+ \S+) (\S+ \S+)$", text, re.M)
    assert [s[0] for s in steps] == ["1", "2", "3"], text
    art = Artifacts.read(out)
    assert art.manifest["command"] == "train" and art.schedule.world_size == 2
    run = art.run
    assert [s["step"] for s in run["steps"]] == [1, 2, 3]
    assert all(len(s["ranks"]) == 2 and s["ranks"][0]["model_states"] > 0 for s in run["steps"])
    assert {sp["rank"] for sp in run["spans"]} == {0, 1} and len(run["spans"]) == 2 * 3 * 3
    trace_path = str(tmp_path / "t.json")
    invoke(runner, "schedule", out, "--trace", trace_path)
    names = [e["args"]["name"] for e in json.load(open(trace_path))["traceEvents"] if e["ph"] == "M"]
    assert "rank 1 (recorded by fxzero train)" in names


def test_train_errors_are_one_line(tmp_path, runner):
    result = invoke(runner, "train", "gpt-huge", ok=False)  # fails before any rank starts
    assert result.exit_code == 1 and "does not resolve" in result.output and "Traceback" not in result.output
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        class Broken(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                raise ValueError("this model is broken on purpose")
            def example_inputs(self):
                return (torch.zeros(2, 4),)
    """))
    result = invoke(runner, "train", f"{path}:Broken", "--ranks", "1", "--steps", "1",
                    "-o", str(tmp_path / "out"), ok=False)
    assert result.exit_code == 1, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert error == ["Error: training failed on rank 0: ValueError: this model is broken on purpose"], result.output
    assert not os.path.exists(tmp_path / "out")

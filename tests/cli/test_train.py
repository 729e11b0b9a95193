"""`fxzero train`: torchrun underneath, progress per step, artifacts of what ran."""

from __future__ import annotations

import json
import os
import re
import shutil
import textwrap

import pytest

from fxzero.artifacts import Artifacts
from tests.cli.conftest import TINY, invoke


@pytest.fixture(scope="module")
def trained(tmp_path_factory, runner):
    """`fxzero train` of the tiny GPT on 2 ranks for 3 steps: (output text, artifact directory)."""
    out = str(tmp_path_factory.mktemp("train") / "run")
    result = invoke(runner, "train", TINY, "--ranks", "2", "--steps", "3", "--lr", "1e-2", "-o", out)
    return result.output, out


def test_train_two_ranks_shows_progress_and_records(trained):
    text, out = trained
    assert "with ZeRO-3 on 2 ranks" in text and "task: predict a fixed permutation" in text
    steps = re.findall(r"^step\s+(\d+)/3\s+loss (\d+\.\d+)\s+[\d.]+ ms\s+mem/rank (\S+ \S+) (\S+ \S+)$", text, re.M)
    assert [s[0] for s in steps] == ["1", "2", "3"], text
    art = Artifacts.read(out)
    assert art.manifest["command"] == "train" and art.schedule.world_size == 2
    run = art.run
    assert [s["step"] for s in run["steps"]] == [1, 2, 3]
    assert all(len(s["ranks"]) == 2 and s["ranks"][0]["model_states"] > 0 for s in run["steps"])
    assert {sp["rank"] for sp in run["spans"]} == {0, 1} and len(run["spans"]) == 2 * 3 * 3
    # the graph and pass trace recorded are those of the program that ran
    names = {n["name"] for n in art.graph["nodes"]}
    assert all(i.name in names for p in art.schedule.programs[:2] for i in p.instructions)
    assert art.pass_trace and art.manifest["fingerprint"] == art.schedule.fingerprint


def test_recorded_trace_has_every_rank_and_only_scheduled_instructions(trained, runner, tmp_path):
    _, out = trained
    art = Artifacts.read(out)
    assert [r["rank"] for r in art.timeline["ranks"]] == [0, 1] and art.timeline["step"] == 3
    trace_path = str(tmp_path / "t.json")
    shown = invoke(runner, "schedule", out, "--trace", trace_path).output
    assert "trace (--trace): the timeline recorded on 2 ranks (step 3)" in shown
    assert re.search(r"^  rank 1 +\S+ \S+ \(forward .*, backward .*, step .*\); waiting for collectives", shown, re.M)
    trace = json.load(open(trace_path))
    assert trace["otherData"]["timeline"] == "recorded"
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {r: f"rank {r} (recorded by fxzero train, step 3)" for r in (0, 1)}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    s = art.schedule
    ran = [(p.name, i) for p in s.programs for i in range(len(p.instructions))]  # forward, backward, step
    for rank in (0, 1):
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] != "program"]
        for e in slices:
            ins = s.program(e["args"]["program"]).instructions[e["args"]["index"]]
            assert (ins.name, ins.kind) == (e["name"], e["cat"])
            on = tracks[(rank, e["tid"])]
            assert on.startswith("comm") if ins.kind in ("all_gather", "reduce_scatter") else on == "compute"
        assert sorted((e["args"]["program"], e["args"]["index"]) for e in slices) == sorted(ran)
        programs = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "program"]
        assert programs == ["forward", "backward", "step"]
        # a collective is drawn until its wait returned
        end = {(e["args"]["program"], e["name"]): e["ts"] + e["dur"] for e in slices}
        for p in s.programs[:2]:
            for i in p.instructions:
                if i.kind == "wait":
                    assert end[(p.name, i.reads[0])] >= end[(p.name, i.name)] - 1e-3


def test_recorded_timeline_naming_an_unscheduled_instruction_is_an_error(trained, runner, tmp_path):
    _, out = trained
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    timeline = json.loads((broken / "timeline.json").read_text())
    timeline["ranks"][1]["instructions"][0][1] = 10_000
    (broken / "timeline.json").write_text(json.dumps(timeline))
    result = invoke(runner, "schedule", str(broken), "--trace", str(tmp_path / "t.json"), ok=False)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "rank 1 ran forward #10000, which the schedule does not have" in result.output


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

"""`fxzero train`: torchrun underneath, progress per step, artifacts of what ran."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import textwrap

import pytest
import torch.distributed as dist

from fxzero.artifacts import Artifacts
from tests.cli.conftest import TINY, invoke


@pytest.fixture(scope="module")
def trained(tmp_path_factory, runner):
    """`fxzero train` of the tiny GPT on 2 ranks for 3 steps: (output text, artifact directory)."""
    out = str(tmp_path_factory.mktemp("train") / "run")
    result = invoke(runner, "train", TINY, "--ranks", "2", "--steps", "3", "--lr", "1e-2",
                    "--collective-timeout", "120", "-o", out)
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
    assert run["collective_timeout_s"] == 120  # --collective-timeout reached the workers


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


def test_train_reads_the_config_file_and_lr_overrides_it(tmp_path, runner):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "betas": [0.8, 0.9]}},
                                  "zero_optimization": {"stage": 2}}))
    out = str(tmp_path / "run")
    text = invoke(runner, "train", TINY, "--ranks", "1", "--steps", "1", "--config", str(config), "--lr", "2e-2",
                  "-o", out).output
    assert "with ZeRO-2 on 1 ranks" in text, text
    art = Artifacts.read(out)
    assert art.schedule.stage == 2 and art.manifest["config"]["stage"] == 2
    assert art.manifest["config"]["optimizer"]["lr"] == 2e-2  # --lr over the file's 5e-3
    assert art.manifest["config"]["optimizer"]["betas"] == [0.8, 0.9]  # the file's
    assert art.run["collective_timeout_s"] == 300  # the default


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_collective_timeout_must_be_positive(runner, value):
    result = invoke(runner, "train", TINY, "--collective-timeout", value, ok=False)  # before any rank starts
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(errors) == 1 and "--collective-timeout" in errors[0] and "> 0" in errors[0], result.output


class _FakeTorchrun:
    """subprocess.Popen for train_cmd: records the command, replays worker output lines."""

    def __init__(self, lines: list[dict], rc: int):
        self.lines, self.rc, self.commands = lines, rc, []

    def __call__(self, cmd, **kwargs):
        self.commands.append(cmd)
        fake = self

        class Proc:
            stdout = iter(json.dumps(line) + "\n" for line in fake.lines)
            stderr = iter(["Traceback ...\n", "RuntimeError: boom\n"])

            def wait(self):
                return fake.rc

            def terminate(self):
                pass

        return Proc()


def test_collective_timeout_reaches_the_worker_and_the_cause_is_reported(runner, monkeypatch, tmp_path):
    """The option is on the worker's command line; of the ranks' errors the CLI shows the cause:
    a rank's own error before the peer whose collective failed because that rank had gone."""
    from fxzero.cli import train_cmd

    fake = _FakeTorchrun([
        {"event": "error", "rank": 0, "collective": "peer_gone",
         "message": "[rank 0] a collective failed because another rank has gone (see its error): RuntimeError: x"},
        {"event": "error", "rank": 1, "collective": "", "message": "ValueError: rank 1's own mistake"},
    ], rc=1)
    monkeypatch.setattr(train_cmd.subprocess, "Popen", fake)
    result = invoke(runner, "train", TINY, "--collective-timeout", "120", "-o", str(tmp_path / "o"), ok=False)
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if line.startswith("Error:")] == [
        "Error: training failed on rank 1: ValueError: rank 1's own mistake"], result.output
    (cmd,) = fake.commands
    assert cmd[cmd.index("--collective-timeout") + 1] == "120.0"
    assert cmd[cmd.index("-m", cmd.index("--standalone")) + 1] == "fxzero.cli.train_worker"
    # a timeout outranks a peer that has gone; ties go to the lowest rank
    fake.lines = [
        {"event": "error", "rank": 0, "collective": "peer_gone", "message": "gone"},
        {"event": "error", "rank": 2, "collective": "timeout", "message": "[rank 2] timed out"},
        {"event": "error", "rank": 1, "collective": "timeout", "message": "[rank 1] timed out"},
    ]
    result = invoke(runner, "train", TINY, "-o", str(tmp_path / "o"), ok=False)
    assert "Error: training failed on rank 1: [rank 1] timed out" in result.output
    assert fake.commands[-1][fake.commands[-1].index("--collective-timeout") + 1] == "300.0"  # the default


GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 120000ms "
                "for recv operation to complete\nException raised from recv at unbound_buffer.cc:78 (frame #0)")


@pytest.mark.parametrize("argv, seconds", [([], 300), (["--collective-timeout", "120"], 120)])
def test_worker_passes_the_timeout_to_the_process_group_and_reports_a_timeout_on_one_line(
        monkeypatch, capsys, argv, seconds):
    """The worker's main in this process, its process group and its training faked: a collective
    that times out on rank 1 becomes one `error` event naming the rank and the timeout."""
    from fxzero.cli import train_worker

    monkeypatch.setattr(dist.distributed_c10d, "default_pg_timeout", dist.distributed_c10d.default_pg_timeout)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def train(args, rank, world):
        raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(train_worker, "train", train)
    with pytest.raises(SystemExit) as exit_info:
        train_worker.main(["--model", TINY, "--steps", "1", "--out", "unused", *argv])
    assert exit_info.value.code == 1
    timeout = datetime.timedelta(seconds=seconds)
    assert calls == [("gloo", {"timeout": timeout})]
    # groups made later without a timeout (the shared-memory transport's barriers) get it too
    assert dist.distributed_c10d._get_default_timeout(dist.Backend("gloo")) == timeout
    (line,) = capsys.readouterr().out.splitlines()
    event = json.loads(line)
    assert event["event"] == "error" and event["rank"] == 1 and event["collective"] == "timeout"
    assert event["message"] == (
        f"[rank 1] a collective did not complete within --collective-timeout {seconds} s (another rank died or "
        "hangs): RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 120000ms for recv operation to complete")


def test_worker_rejects_a_timeout_that_is_not_positive(capsys):
    from fxzero.cli import train_worker

    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            train_worker._parse(["--model", TINY, "--steps", "1", "--out", "o", "--collective-timeout", bad])
        assert "must be a positive number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize("error, kind", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:51594"), "peer_gone"),
    (RuntimeError("[rank 0] shared-memory all_gather failed: [unbound_buffer.cc:78] Timed out waiting 3000ms"),
     "timeout"),
    (TimeoutError("store wait"), "timeout"),
    (ValueError("a timeout of the model's own"), ""),
    (RuntimeError("shape mismatch"), ""),
])
def test_worker_error_messages(error, kind):
    from fxzero.cli.train_worker import collective_failure, error_message

    assert collective_failure(error) == kind
    message = error_message(error, 3, 60.0)
    assert "\n" not in message
    if kind:
        assert message.startswith("[rank 3] a collective ")
        assert ("within --collective-timeout 60 s" in message) == (kind == "timeout")
    else:
        assert message == f"{type(error).__name__}: {error}"

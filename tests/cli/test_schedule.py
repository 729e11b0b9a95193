"""`fxzero schedule`: the table, the JSON, the Chrome trace and the memory plot."""

from __future__ import annotations

import json
import os
import re

import pytest

from fxzero import cost
from fxzero.artifacts import Artifacts
from tests.cli.conftest import invoke


def test_table_lists_streams_bytes_times_and_a_summary(tiny_dir, runner):
    out = invoke(runner, "schedule", tiny_dir).output
    s = Artifacts.read(tiny_dir).schedule
    for p in s.programs:
        assert f"{p.name} program: {len(p.instructions)} instructions" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("#"))
    assert header.index("compute") < header.index("comm") < header.index("bytes")
    # every collective is a row of its own in the comm column, every wait and free too
    assert len(re.findall(r"all_gather (root|blocks\.\d)", out)) == sum(1 for _, i in s.collectives() if i.kind == "all_gather")
    assert out.count("reduce_scatter blocks.") + out.count("reduce_scatter root") == sum(
        1 for _, i in s.collectives() if i.kind == "reduce_scatter")
    for line in ("step time", "exposed comm", "all_gather ", "reduce_scatter ", "peak gathered", "peak resident"):
        assert re.search(rf"^  {line}", out, re.M), line
    full = invoke(runner, "schedule", tiny_dir, "--full").output
    assert len(full.splitlines()) > sum(len(p.instructions) for p in s.programs)


def test_json_is_exactly_the_recorded_schedule(tiny_dir, runner):
    out = invoke(runner, "schedule", tiny_dir, "--json").stdout
    assert out.rstrip("\n") == open(os.path.join(tiny_dir, "schedule.json")).read()


def test_trace_has_one_slice_per_instruction_in_program_order(tiny_dir, runner, tmp_path):
    path = str(tmp_path / "trace.json")
    invoke(runner, "schedule", tiny_dir, "--trace", path, "--simulate", "h100x8-nvlink")
    trace = json.load(open(path))
    s = Artifacts.read(tiny_dir).schedule
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "program"]
    assert [(e["args"]["program"], e["name"]) for e in slices] == [
        (p.name, i.name) for p in s.programs for i in p.instructions]
    assert {e["cat"] for e in slices} >= {"all_gather", "wait", "free", "reduce_scatter", "compute", "optim_step"}
    comm_tid = next(e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["args"]["name"] == "comm")
    assert all(e["tid"] == comm_tid for e in slices if e["cat"] in ("all_gather", "reduce_scatter"))
    # a wait never ends before its collective (the step's waits for gradients: the backward's)
    ends = {(e["args"]["program"], e["name"]): e["ts"] + e["dur"] for e in slices}
    previous = None
    for p in s.programs:
        for i in p.instructions:
            if i.kind == "wait":
                src = (p.name, i.reads[0]) if (p.name, i.reads[0]) in ends else (previous, i.reads[0])
                assert ends[(p.name, i.name)] >= ends[src] - 1e-6
        previous = p.name
    assert trace["otherData"]["hardware"] == "h100x8-nvlink" and trace["otherData"]["timeline"] == "simulated"
    assert any(e["ph"] == "C" for e in trace["traceEvents"])
    # the times are those of h100x8-nvlink, replayed here by hand
    want = _replay_by_hand(s)
    assert len(want) == len(slices)
    for e in slices:
        start, end = want[(e["args"]["program"], e["args"]["index"])]
        assert e["ts"] == pytest.approx(start * 1e6, rel=1e-9, abs=1e-6), e
        assert e["dur"] == pytest.approx((end - start) * 1e6, rel=1e-9, abs=1e-6), e


# h100x8-nvlink's figures, as fxzero/cost/presets.py states them
H100 = dict(flops=50e12, mem=3e12, overhead=5e-6, bandwidth=360e9, latency=15e-6, ranks=8)


def _seconds(ins) -> float:
    """What one instruction takes on H100: a collective on an 8-rank ring moves 7/8 of its bytes."""
    h = H100
    if ins.kind in ("all_gather", "reduce_scatter"):
        return h["latency"] + ins.bytes * (h["ranks"] - 1) / h["ranks"] / h["bandwidth"]
    if ins.kind == "compute":
        return h["overhead"] + max(ins.flops / h["flops"], (ins.read_bytes + ins.bytes) / h["mem"])
    if ins.kind == "optim_step":  # AdamW: 7 passes over the shard
        return 10 * h["overhead"] + 7 * ins.bytes / h["mem"]
    assert ins.kind in ("wait", "free"), ins.kind
    return h["overhead"]


def _replay_by_hand(schedule) -> dict[tuple[str, int], tuple[float, float]]:
    """(program, index) -> (start, end): the compute stream runs one instruction after another
    and issues each collective, which starts once the comm stream is free; a wait returns when
    its collective ends (one the backward left in flight, for the step); programs run back to
    back on the compute stream. H100 has no compute-comm interference."""
    out, ended = {}, {}
    compute = comm = 0.0
    for p in schedule.programs:
        comm = max(comm, compute)  # the program starts when the compute stream is done
        for idx, ins in enumerate(p.instructions):
            if ins.kind in ("all_gather", "reduce_scatter"):
                start = max(comm, compute)
                comm = end = start + _seconds(ins)
            else:
                start = max(compute, ended[ins.reads[0]]) if ins.kind == "wait" else compute
                compute = end = start + _seconds(ins)
            ended[ins.name] = end
            out[(p.name, idx)] = (start, end)
    return out


def test_summary_says_the_times_are_simulated_and_what_the_trace_holds(tiny_dir, runner):
    out = invoke(runner, "schedule", tiny_dir, "--simulate", "h100x64-ib400").output
    assert "summary (per rank; times simulated for h100x64-ib400 by fxzero.cost)" in out
    assert re.search(r"^  hardware +64 x H100 .*over 64 ranks$", out, re.M), out
    assert "trace (--trace): the timeline simulated for h100x64-ib400; `fxzero train` records real ones" in out
    assert "recorded by fxzero train" not in out


def test_plot_is_a_png(tiny_dir, runner, tmp_path):
    path = str(tmp_path / "mem.png")
    result = invoke(runner, "schedule", tiny_dir, "--json", "--plot", path)
    assert json.loads(result.stdout)["fingerprint"]  # stdout stays pure JSON
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_schedule_of_a_model_spec_and_unknown_hardware(runner):
    out = invoke(runner, "schedule", "cnn", "--world", "2", "--stage", "1").output
    assert "cnn: ZeRO-1 on 2 ranks" in out
    bad = invoke(runner, "schedule", "cnn", "--simulate", "tpu", ok=False)
    assert bad.exit_code == 2 and all(name in bad.output for name in cost.PRESETS)


def test_memory_record_follows_the_stage(tiny_dir):
    art = Artifacts.read(tiny_dir)
    s = art.schedule
    grads = art.memory["programs"]["backward"]["gradients"]
    shards = sum(u.shard_numel * u.itemsize for u in s.units if u.trainable)
    assert grads[-1] == shards  # every gradient shard is alive when the backward ends
    assert art.memory["programs"]["forward"]["gradients"][-1] == 0
    assert art.memory["model_states"]["grads"] == shards

"""`fxzero compile` and `fxzero graph`: artifacts on disk, --config and --inputs, and real rendering with `dot`."""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest

from fxzero.artifacts import Artifacts
from tests.cli.conftest import TINY, WORLD, invoke, one_line_error


def test_compile_writes_the_artifacts(tiny_dir, runner):
    for name in ("manifest.json", "schedule.json", "pass_trace.json", "graph.json", "graph.txt", "memory.json"):
        assert os.path.getsize(os.path.join(tiny_dir, name)) > 0, name
    art = Artifacts.read(tiny_dir)
    assert art.manifest["model"] == TINY and art.schedule.world_size == WORLD and art.schedule.stage == 3
    assert art.units == ["root", "blocks.0", "blocks.1", "root:tail"]
    passes = [r["name"] for r in art.pass_trace]
    assert passes[0] == "partition" and passes[-2:] == ["split", "step_program"]
    assert all({"changed", "seconds", "nodes_before", "nodes_after", "summary"} <= set(r) for r in art.pass_trace)
    kinds = {n["kind"] for n in art.graph["nodes"]}
    assert {"unit", "all_gather", "wait", "free", "reduce_scatter", "compute"} <= kinds
    # graph.json names exactly the nodes the schedule's instructions are named after.
    names = {n["name"] for n in art.graph["nodes"]}
    assert all(i.name in names for p in art.schedule.programs[:2] for i in p.instructions)


def test_compile_output_shows_the_pass_trace(tmp_path, runner):
    out = str(tmp_path / "cnn")
    result = invoke(runner, "compile", "cnn", "--world", "4", "--stage", "2", "-o", out)
    assert "ZeRO-2 on 4 ranks" in result.output
    for name in ("partition", "insert_reduce_scatter", "split"):
        assert re.search(rf"^\s+{name}\s+(yes|no)\s+\d+ -> \d+", result.output, re.M), result.output
    assert Artifacts.read(out).schedule.stage == 2


def _clusters(svg: str) -> list[str]:
    return re.findall(r'<g id="clust\d+" class="cluster">\s*<title>(.*?)</title>', svg)


def _node_ids(svg: str) -> set[str]:
    return set(re.findall(r'<g id="node\d+" class="node">\s*<title>(.*?)</title>', svg))


def test_graph_svg_has_one_cluster_per_unit_and_program_and_every_ir_node(tiny_dir, runner):
    out = os.path.join(tiny_dir, "full.svg")
    invoke(runner, "graph", tiny_dir, "--no-collapse", "-o", out)
    svg = open(out).read()
    art = Artifacts.read(tiny_dir)
    clusters = _clusters(svg)
    for phase in ("forward", "backward"):
        assert clusters.count(f"cluster_{phase}") == 1
        for unit in art.units:
            assert clusters.count(f"cluster_{phase}_{unit}") == 1, (phase, unit, clusters)
    drawn = _node_ids(svg)
    by_kind: dict[str, set[str]] = {}
    for n in art.graph["nodes"]:
        by_kind.setdefault(n["kind"], set()).add(n["name"])
    for kind in ("all_gather", "wait", "free", "flatten_grads", "reduce_scatter", "compute", "param_view"):
        assert by_kind[kind] <= drawn, kind
    # colour by kind: the all-gather and reduce-scatter fills are there, one per such node
    assert svg.count('fill="#2f6db5"') >= len(by_kind["all_gather"])
    assert svg.count('fill="#f28e2b"') >= len(by_kind["reduce_scatter"])


def test_graph_collapsed_png_and_unit_view(tiny_dir, runner):
    result = invoke(runner, "graph", tiny_dir, "--collapse", "--format", "png")
    path = os.path.join(tiny_dir, "graph-collapsed.png")
    assert path in result.output
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    collapsed = invoke(runner, "graph", tiny_dir, "--collapse", "-o", "-", "--format", "svg").stdout
    assert len(_node_ids(collapsed)) < 80  # ~300 nodes fold into a few boxes per unit
    unit = invoke(runner, "graph", tiny_dir, "--unit", "blocks.1", "-o", "-", "--format", "dot").stdout
    assert '"cluster_forward_blocks.1"' in unit and "cluster_forward_blocks.0" not in unit
    assert "(from blocks.0)" in unit  # the activation it reads, drawn as an outside source


def test_graph_of_a_model_spec_without_a_directory(tmp_path, runner, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(runner, "graph", "cnn", "--world", "2", "--format", "dot")
    assert "wrote cnn-graph.dot" in result.output
    assert open("cnn-graph.dot").read().startswith("digraph fxzero {")


# -- errors: one line, non-zero exit, no traceback ----------------------------------------------




def test_error_model_spec_does_not_resolve(runner):
    one_line_error(invoke(runner, "compile", "gpt-huge", ok=False), "does not resolve", "gpt-tiny")
    one_line_error(invoke(runner, "graph", "nosuchpkg:Model", ok=False), "no module named 'nosuchpkg'")


def test_error_not_an_artifact(tmp_path, runner):
    stray = tmp_path / "notes.txt"
    stray.write_text("hello")
    one_line_error(invoke(runner, "schedule", str(stray), ok=False), "is not an fxzero artifact")
    one_line_error(invoke(runner, "graph", str(tmp_path), ok=False), "no manifest.json", "fxzero compile")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    one_line_error(invoke(runner, "schedule", str(bad), ok=False), "not valid JSON")


def test_error_format_dot_cannot_write(tiny_dir, runner):
    one_line_error(invoke(runner, "graph", tiny_dir, "--format", "docx", "-o", "-", ok=False),
                    "cannot write format 'docx'", "svg")


def test_error_dot_missing(tiny_dir, runner, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `dot` on PATH
    one_line_error(invoke(runner, "graph", tiny_dir, "--format", "svg", "-o", "-", ok=False),
                    "`dot` binary was not found", "apt-get install graphviz")
    # the DOT source needs no binary
    assert invoke(runner, "graph", tiny_dir, "--format", "dot", "-o", "-").stdout.startswith("digraph")


def test_error_unknown_unit_and_refuses_foreign_output_dir(tiny_dir, runner, tmp_path):
    one_line_error(invoke(runner, "graph", tiny_dir, "--unit", "blocks.9", ok=False), "no unit 'blocks.9'", "blocks.1")
    (tmp_path / "keep.txt").write_text("mine")
    one_line_error(invoke(runner, "compile", "cnn", "-o", str(tmp_path), ok=False), "refusing to write")


# -- --config and --inputs ----------------------------------------------------------------------


def _ds_config(tmp_path, **zero) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.8, 0.9]}},
                                "zero_optimization": zero}))
    return str(path)


def _gathered_units(schedule, program: str) -> set[str]:
    return {i.unit for i in schedule.program(program).instructions if i.kind == "all_gather"}


def test_compile_reads_stage_and_persistence_threshold_from_config(tiny_dir, runner, tmp_path):
    # TINY's units: root 3584 parameters, blocks.0 and blocks.1 12608 each, root:tail 64. A
    # threshold of 4000 keeps root and root:tail gathered for the whole step.
    config = _ds_config(tmp_path, stage=3, stage3_param_persistence_threshold=4000)
    out = str(tmp_path / "art")
    result = invoke(runner, "compile", TINY, "--world", str(WORLD), "--config", config, "-o", out)
    assert f"ZeRO-3 on {WORLD} ranks" in result.output
    art = Artifacts.read(out)
    default = Artifacts.read(tiny_dir)
    assert default.schedule.persistent == () and _gathered_units(default.schedule, "forward") == set(default.units)
    assert art.schedule.stage == 3 and sorted(art.schedule.persistent) == ["root", "root:tail"]
    # the persistent units are not gathered per use: only the blocks are, in both programs
    assert _gathered_units(art.schedule, "forward") == {"blocks.0", "blocks.1"}
    assert _gathered_units(art.schedule, "backward") <= {"blocks.0", "blocks.1"}
    recorded = art.manifest["config"]
    assert recorded["persist_threshold"] == 4000 and recorded["stage"] == 3
    assert recorded["optimizer"]["lr"] == 5e-4 and recorded["optimizer"]["betas"] == [0.8, 0.9]


@pytest.mark.parametrize("file_stage, flag, want", [(2, None, 2), (2, "3", 3), (3, "1", 1)])
def test_stage_flag_overrides_the_config_file(runner, tmp_path, file_stage, flag, want):
    # (an explicit threshold of 0: DeepSpeed's default, 1e5 where the key is missing, would keep
    # every unit of this small CNN whole at stage 3 too)
    config = _ds_config(tmp_path, stage=file_stage, stage3_param_persistence_threshold=0)
    out = str(tmp_path / "art")
    args = ["compile", "cnn", "--world", "2", "--config", config, "-o", out] + (["--stage", flag] if flag else [])
    assert f"ZeRO-{want} on 2 ranks" in invoke(runner, *args).output
    art = Artifacts.read(out)
    assert art.schedule.stage == want and art.manifest["config"]["stage"] == want
    # stages 1 and 2 hold every unit whole; stage 3 (threshold 0) none
    assert len(art.schedule.persistent) == (0 if want == 3 else len(art.units))
    assert art.manifest["config"]["optimizer"]["lr"] == 5e-4  # the rest of the file still applies


def test_config_file_errors_are_one_line(runner, tmp_path):
    one_line_error(invoke(runner, "compile", "cnn", "--config", str(tmp_path / "missing.json"), ok=False),
                    "missing.json")
    bad = tmp_path / "onebitlamb.json"
    bad.write_text(json.dumps({"optimizer": {"type": "OneBitLamb"}}))
    one_line_error(invoke(runner, "compile", "cnn", "--config", str(bad), ok=False),
                    "optimizer type 'OneBitLamb' is not supported")


def _forward_output(schedule):
    forward = schedule.program("forward")
    by_name = {i.name: i for i in forward.instructions}
    return by_name[forward.outputs[0]]


def test_inputs_set_the_traced_shapes(tiny_dir, runner, tmp_path):
    out = str(tmp_path / "art")
    invoke(runner, "compile", TINY, "--world", str(WORLD), "--inputs", "int64[3,8]:0..96", "-o", out)
    art = Artifacts.read(out)
    assert art.manifest["inputs"] == [{"dtype": "int64", "shape": [3, 8], "low": 0, "high": 96}]
    inputs = [n for n in art.graph["nodes"] if n["kind"] == "input"]
    assert [(n["shape"], n["dtype"]) for n in inputs] == [([3, 8], "int64")]
    # the model's output, the logits (B, T, vocab 96), as the schedule has it
    logits = _forward_output(art.schedule)
    assert (logits.numel, logits.bytes) == (3 * 8 * 96, 3 * 8 * 96 * 4)
    # the default is gpt-tiny's own example_inputs(), (2, 16)
    default = Artifacts.read(tiny_dir)
    assert default.manifest["inputs"][0]["shape"] == [2, 16]
    assert _forward_output(default.schedule).numel == 2 * 16 * 96


def test_inputs_for_a_model_without_example_inputs(runner, tmp_path):
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent("""
        import torch.nn as nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(6, 4), nn.Linear(4, 2)])
            def forward(self, x):
                return self.layers[1](self.layers[0](x).relu())
    """))
    one_line_error(invoke(runner, "compile", f"{path}:Net", ok=False), "no example_inputs() method")
    out = str(tmp_path / "art")
    invoke(runner, "compile", f"{path}:Net", "--world", "2", "--inputs", "float32[5,6]", "-o", out)
    art = Artifacts.read(out)
    assert art.manifest["inputs"] == [{"dtype": "float32", "shape": [5, 6], "low": None, "high": None}]
    assert _forward_output(art.schedule).numel == 5 * 2

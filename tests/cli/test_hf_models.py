"""Hugging Face models on the command line: `transformers:ClassName` built from --model-config
(a JSON object or a config.json), traced on keyword --inputs or on the defaults, and the one-line
errors for what does not resolve. Tiny configs, meta device, nothing downloaded."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest

from fxzero.artifacts import Artifacts
from fxzero.modelspec import build_model, example_call, parse_call
from tests.cli.conftest import WORLD, invoke, one_line_error

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")

GPT2 = "transformers:GPT2LMHeadModel"
GPT2_CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 64}
GPT2_INPUTS = "input_ids=int64[2,32]:0..256 labels=int64[2,32]:0..256"
GPT2_UNITS = ["root", "transformer.h.0", "transformer.h.1", "root:tail"]

TINY_CONFIGS = {
    "LlamaForCausalLM": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256},
    "BertForMaskedLM": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                        "num_attention_heads": 2, "vocab_size": 256},
    "ResNetForImageClassification": {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
                                     "num_labels": 10},
}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, runner):
    """`fxzero compile` of a 2-layer GPT-2 called by keyword, on 2 ranks; (directory, output)."""
    out = str(tmp_path_factory.mktemp("gpt2") / "art")
    result = invoke(runner, "compile", GPT2, "--model-config", json.dumps(GPT2_CONFIG), "--inputs", GPT2_INPUTS,
                    "--world", str(WORLD), "-o", out)
    return out, result


def test_compile_a_transformers_model_called_by_keyword(gpt2_dir):
    out, result = gpt2_dir
    for name in ("manifest.json", "schedule.json", "pass_trace.json", "graph.json", "graph.txt", "memory.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    assert f"compiled {GPT2} (" in result.stdout and f"ZeRO-3 on {WORLD} ranks" in result.stdout
    # use_cache=false is added (the KV cache would be dropped with a warning), and said
    assert "with use_cache=false too" in result.stderr
    art = Artifacts.read(out)
    assert art.units == GPT2_UNITS
    m = art.manifest
    assert m["model"] == GPT2 and m["params"] == sum(u.numel for u in art.schedule.units)
    assert {k: m["model_config"][k] for k in GPT2_CONFIG} == GPT2_CONFIG
    assert m["inputs"] == [
        {"name": "input_ids", "dtype": "int64", "shape": [2, 32], "low": 0, "high": 256},
        {"name": "labels", "dtype": "int64", "shape": [2, 32], "low": 0, "high": 256},
        {"name": "use_cache", "value": False},
    ]
    inputs = [n for n in art.graph["nodes"] if n["kind"] == "input"]
    assert [(n["shape"], n["dtype"]) for n in inputs] == [([2, 32], "int64")] * 2


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs graphviz's `dot`")
def test_graph_draws_the_compiled_transformers_model(gpt2_dir, runner):
    out, _ = gpt2_dir
    result = invoke(runner, "graph", out, "--collapse")
    path = os.path.join(out, "graph-collapsed.svg")
    assert f"wrote {path}" in result.output
    svg = open(path).read()
    clusters = re.findall(r'<g id="clust\d+" class="cluster">\s*<title>(.*?)</title>', svg)
    for phase in ("forward", "backward"):
        for unit in GPT2_UNITS:
            assert f"cluster_{phase}_{unit}" in clusters, (phase, unit, clusters)
    assert f"{GPT2}: ZeRO&#45;3 on {WORLD} ranks" in svg  # (dot escapes the hyphen)


def test_config_json_folder_and_default_inputs(runner, tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                    **GPT2_CONFIG}))
    out = str(tmp_path / "art")
    result = invoke(runner, "compile", GPT2, "--model-config", str(folder), "--world", str(WORLD), "-o", out)
    # without --inputs: token ids of min(128, n_positions) positions, below vocab_size
    assert f"note: no --inputs; tracing {GPT2} on 'input_ids=int64[2,64]:0..256 use_cache=false'" in result.stderr
    art = Artifacts.read(out)
    assert art.units == GPT2_UNITS
    assert art.manifest["inputs"] == [{"name": "input_ids", "dtype": "int64", "shape": [2, 64], "low": 0, "high": 256},
                                      {"name": "use_cache", "value": False}]


def test_config_json_file_with_literal_overrides_in_estimate(runner, tmp_path):
    path = tmp_path / "my-config.json"
    path.write_text(json.dumps(GPT2_CONFIG))
    est = json.loads(invoke(runner, "estimate", f"{GPT2}(n_layer=1)", "--model-config", str(path),
                            "--world", "2", "--json").stdout)
    assert est["largest_unit"]["name"] == "transformer.h.0"
    one_layer = est["params"]
    two_layers = json.loads(invoke(runner, "estimate", GPT2, "--model-config", str(path), "--world", "2",
                                   "--json").stdout)["params"]
    assert two_layers - one_layer == 12 * 64 * 64 + 13 * 64  # one GPT-2 block of width 64


@pytest.mark.parametrize("name, default, layer", [
    ("LlamaForCausalLM", "input_ids=int64[2,128]:0..256 use_cache=false", "model.layers.1"),
    ("BertForMaskedLM", "input_ids=int64[2,128]:0..256", "bert.encoder.layer.1"),
    ("ResNetForImageClassification", "pixel_values=float32[2,3,224,224]", "resnet.encoder.stages.1"),
])
def test_other_classes_build_on_meta_with_their_default_inputs(runner, name, default, layer):
    config = json.dumps(TINY_CONFIGS[name])
    model = build_model(f"transformers:{name}", model_config=config)
    assert all(p.is_meta for p in model.parameters())
    call = example_call(model)
    assert str(call.spec) == default and call.completed and not call.args
    est = json.loads(invoke(runner, "estimate", f"transformers:{name}", "--model-config", config, "--world", "2",
                            "--json").stdout)
    assert est["accounting"] == "runtime unit layouts" and est["params"] == sum(p.numel() for p in model.parameters())
    # the given keyword spec is kept, with only the constants it does not name added
    given = example_call(model, parse_call([default.split()[0]]))
    assert str(given.spec) == default


# -- errors: one line, exit code 1 --------------------------------------------------------------




def test_error_unknown_class_names_the_nearest(runner):
    one_line_error(invoke(runner, "compile", "transformers:GPT2LMHedModel", ok=False),
                    "no class 'GPT2LMHedModel'", "did you mean GPT2LMHeadModel")
    one_line_error(invoke(runner, "compile", "transformers:GPT2Config", ok=False), "is not a model class")


def test_error_model_config_on_a_model_that_is_not_hf(runner):
    one_line_error(invoke(runner, "compile", "gpt-tiny", "--model-config", '{"n_layer": 2}', ok=False),
                    "--model-config applies to Hugging Face models", "'gpt-tiny'")
    one_line_error(invoke(runner, "estimate", "--params", "7B", "--model-config", "{}", ok=False), "--model-config")


@pytest.mark.parametrize("inputs, message", [
    ("input_ids=int64[2,32]", "needs its value range"),
    ("input_ids=int64(2,32):0..256", "is neither DTYPE[SHAPE] nor a constant"),
    ("input_ids=int64[2,32]:0..256 float32[2,4]", "a positional input after keyword inputs"),
    ("use_cache=maybe", "'maybe' is neither"),
    ("input_ids=", "no value after '='"),
])
def test_error_malformed_keyword_spec(runner, inputs, message):
    result = invoke(runner, "compile", GPT2, "--model-config", json.dumps(GPT2_CONFIG), "--inputs", inputs, ok=False)
    one_line_error(result, "--inputs", message)


def test_error_model_config_that_is_not_a_config(runner, tmp_path):
    one_line_error(invoke(runner, "compile", GPT2, "--model-config", "gpt2", ok=False),
                    "no such file or folder", "nothing is downloaded")
    one_line_error(invoke(runner, "compile", GPT2, "--model-config", '{"n_layer": 2,', ok=False), "not valid JSON")
    one_line_error(invoke(runner, "compile", GPT2, "--model-config", '{"model_type": "llama"}', ok=False),
                    "a 'llama' config", "'gpt2'")
    one_line_error(invoke(runner, "compile", GPT2, "--model-config", '{"n_embd": 63, "n_head": 2}', ok=False),
                    "cannot be built from this config", "divisible")


def test_train_refuses_hf_models_and_keyword_inputs(runner):
    one_line_error(invoke(runner, "train", GPT2, ok=False), "does not train Hugging Face models")
    one_line_error(invoke(runner, "train", "gpt-tiny", "--inputs", "x=int64[2,8]:0..96", ok=False),
                    "positional --inputs only")


def test_a_field_the_config_does_not_have_is_warned(runner):
    with pytest.warns(UserWarning, match=r"GPT2Config has no field n_layers \(did you mean n_layer\?\)"):
        model = build_model(GPT2, model_config=json.dumps({**GPT2_CONFIG, "n_layers": 1}))
    assert model.config.n_layer == 2


def test_error_transformers_not_installed(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as if not installed
    one_line_error(invoke(runner, "compile", GPT2, ok=False), "needs the transformers package", "pip install")

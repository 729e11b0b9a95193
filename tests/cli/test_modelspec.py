"""MODEL and --inputs specs: what resolves, and the one-line errors for what does not."""

from __future__ import annotations

import textwrap

import pytest
import torch

from fxzero.modelspec import SpecError, build_model, example_inputs, parse_call, parse_inputs, parse_model
from fxzero.zoo import GPT, Llama


def test_zoo_name_with_literal_arguments_builds_on_meta():
    model = build_model("gpt-tiny(n_blocks=1, seq_len=8)")
    assert isinstance(model, GPT) and len(model.blocks) == 1 and model.config.seq_len == 8
    assert all(p.is_meta for p in model.parameters())
    (x,) = example_inputs(model)
    assert x.shape == (2, 8) and x.device.type == "cpu"


def test_module_factory_and_file_class(tmp_path):
    assert isinstance(build_model("fxzero.zoo:llama('tiny')"), Llama)
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent("""
        import torch.nn as nn
        class Net(nn.Module):
            def __init__(self, width=4):
                super().__init__()
                self.fc = nn.Linear(width, 2)
            def forward(self, x):
                return self.fc(x)
    """))
    model = build_model(f"{path}:Net(width=6)")
    assert model.fc.in_features == 6
    with pytest.raises(SpecError, match="no example_inputs"):
        example_inputs(model)
    (x,) = example_inputs(model, parse_inputs(["float32[3,6]"]))
    assert x.shape == (3, 6) and x.dtype == torch.float32


@pytest.mark.parametrize("spec, message", [
    ("gpt-huge", "does not resolve"),
    ("nosuchpkg.models:build", "no module named 'nosuchpkg'"),
    ("fxzero.zoo:nothing", "has no attribute 'nothing'"),
    ("missing/file.py:Net", "no such file"),
    ("gpt-tiny(n_blocks=2", "does not resolve"),
    ("gpt-tiny(n_blocks=open('x'))", "must be Python literals"),
    ("gpt-tiny(wings=2)", "unknown GPTConfig field"),
    ("fxzero.zoo:GPT_SIZES", "not a class or factory"),
    ("fxzero.zoo.common:check_positive('a')", "not a torch.nn.Module"),
])
def test_model_specs_that_do_not_resolve(spec, message):
    with pytest.raises(SpecError, match=message) as info:
        build_model(spec)
    assert "\n" not in str(info.value)


def test_inputs_specs():
    a, b = parse_inputs(["int64[2,16]:0..96; float32[2, 3]"])
    assert (a.dtype, a.shape, a.low, a.high) == (torch.int64, (2, 16), 0, 96)
    assert (b.dtype, b.shape, b.low) == (torch.float32, (2, 3), None)
    x = a.make(torch.Generator().manual_seed(0), batch=5)
    assert x.shape == (5, 16) and 0 <= int(x.min()) and int(x.max()) < 96
    assert str(a) == "int64[2,16]:0..96"
    for bad, message in [("int64[2,16]", "needs its value range"), ("float32[2]:0..4", "integer dtypes only"),
                         ("complex7[2]", "unknown dtype"), ("2x16", "expected DTYPE"), ("int64[2]:5..5", "empty")]:
        with pytest.raises(SpecError, match=message):
            parse_inputs([bad])
    assert parse_model("gpt2").target == "gpt2"


def test_keyword_inputs_and_constants():
    call = parse_call(["int64[2,8]:0..96 input_ids = int64[2,16]:0..96;mask=bool[2,16]",
                       "use_cache=false  return_dict=True scale=0.5 n=-3 past=none"])
    assert [str(a) for a in call.args] == ["int64[2,8]:0..96"]
    assert [k for k, _ in call.kwargs] == ["input_ids", "mask", "use_cache", "return_dict", "scale", "n", "past"]
    assert dict(call.kwargs)["use_cache"] is False and dict(call.kwargs)["return_dict"] is True
    assert (dict(call.kwargs)["scale"], dict(call.kwargs)["n"], dict(call.kwargs)["past"]) == (0.5, -3, None)
    assert str(call) == ("int64[2,8]:0..96 input_ids=int64[2,16]:0..96 mask=bool[2,16] use_cache=false "
                         "return_dict=true scale=0.5 n=-3 past=none")
    assert parse_call([str(call)]) == call  # the text form reads back
    args, kwargs = call.make(torch.Generator().manual_seed(0))
    assert args[0].shape == (2, 8) and kwargs["input_ids"].shape == (2, 16) and kwargs["mask"].dtype == torch.bool
    assert call.to_json()[1] == {"name": "input_ids", "dtype": "int64", "shape": [2, 16], "low": 0, "high": 96}
    assert call.to_json()[3] == {"name": "use_cache", "value": False}
    # the positional form is what it was: parse_inputs takes positional inputs only
    assert parse_inputs(["int64[2,16]:0..96"]) == list(parse_call(["int64[2,16]:0..96"]).args)
    for bad, message in [("x=int64[2]:0..5 float32[2]", "positional input after keyword"),
                         ("x=1 x=2", "x is given twice"), ("x=maybe", "neither DTYPE"), ("=int64[2]:0..5", "NAME=VALUE"),
                         ("true", "a constant is passed by name"), ("x=", "no value after"),
                         ("x=int64[2]", "needs its value range")]:
        with pytest.raises(SpecError, match=message) as info:
            parse_call([bad])
        assert "\n" not in str(info.value)
    with pytest.raises(SpecError, match="only positional inputs"):
        parse_inputs(["x=int64[2]:0..5"])

"""Exporting a model: `fxzero export` of a checkpoint and `save_16bit_model` of a live engine give
the consolidated state dict, read back with the safetensors library and Hugging Face.

One 2-rank spawn trains the tiny GPT at stage 3 for two steps, saves a checkpoint and both
16-bit files, and returns the full state dict; the exports are checked here, in the test process.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, load_model

import fxzero
from fxzero import zoo
from fxzero.cli import main
from fxzero.runtime.checkpoint import export_checkpoint, save_16bit_model
from fxzero.runtime.checkpoint.safetensors_stream import SafetensorsWriter
from tests.dist.harness import ADAMW, run_ranks, train
from tests.dist.reference import clone_state_dict, lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(300)

TIED = {"lm_head.weight"}  # gpt-tiny's head is its embedding: exported once, as wte.weight


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return clone_state_dict(zoo.build("gpt-tiny"))


def _train_and_save(rank: int, world_size: int, save_dir: str, out16: str):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None),
                            state_dict=_initial_state())
    train(engine, make_gpt_batches(zoo.GPT_SIZES["tiny"], 2, 8, seed=5), lm_loss, rank, world_size)
    engine.save_checkpoint(save_dir)
    paths = [save_16bit_model(engine, out16, "model.safetensors"), engine.save_16bit_model(out16)]
    return {"paths": paths, "state_dict": {k: v.clone() for k, v in engine.full_state_dict().items()}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    save_dir, out16 = str(root / "ckpt"), str(root / "out16")
    ranks = run_ranks(_train_and_save, 2, save_dir, out16, timeout_s=240)
    return {"save_dir": save_dir, "root": root, "paths": [r["paths"] for r in ranks],
            "state_dict": ranks[0]["state_dict"]}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k!r} differs"


def test_the_export_is_the_full_state_dict_and_loads_into_the_unsharded_model(trained):
    out = str(trained["root"] / "fp32")
    report = export_checkpoint(trained["save_dir"], out)
    path = os.path.join(out, "model.safetensors")
    assert report["files"] == {path: os.path.getsize(path)} and report["tensors"] == len(trained["state_dict"]) - 1
    full = trained["state_dict"]
    _assert_equal(load_file(path), {k: v for k, v in full.items() if k not in TIED}, "fp32 export")
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    model = zoo.build("gpt-tiny").eval()
    load_model(model, path, strict=True)  # the tied head is filled from wte.weight
    reference = zoo.build("gpt-tiny").eval()
    reference.load_state_dict(full, strict=True)
    x, _ = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, 4, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_the_cli_exports_bf16_as_the_masters_cast(trained):
    out = str(trained["root"] / "bf16")
    result = CliRunner().invoke(main, ["export", trained["save_dir"], out, "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    path = os.path.join(out, "model.safetensors")
    assert lines[0].startswith(f"wrote {path} (") and len(lines) == 2, result.output
    summary = json.loads(lines[-1])
    assert summary["dtype"] == "bfloat16" and summary["bytes"] == os.path.getsize(path)
    want = {k: v.to(torch.bfloat16) for k, v in trained["state_dict"].items() if k not in TIED}
    _assert_equal(load_file(path), want, "bf16 export")


def test_save_16bit_model_writes_the_full_state_dict_on_rank_0(trained):
    out16 = str(trained["root"] / "out16")
    st, binary = os.path.join(out16, "model.safetensors"), os.path.join(out16, "pytorch_model.bin")
    assert trained["paths"] == [[st, binary], [None, None]]
    want = {k: v for k, v in trained["state_dict"].items() if k not in TIED}  # an fp32 engine: fp32
    _assert_equal(load_file(st), want, "save_16bit_model .safetensors")
    _assert_equal(torch.load(binary, weights_only=True), want, "save_16bit_model .bin")
    assert not [n for n in os.listdir(out16) if ".tmp-" in n]


def test_a_damaged_checkpoint_fails_the_cli_naming_the_file(trained, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["export", str(tmp_path), str(tmp_path / "out")])
    assert result.exit_code == 1 and "not a checkpoint (no fxzero.json)" in result.output, result.output

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained["save_dir"], ckpt)
    data = ckpt / "global_step2" / "__1_0.distcp"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    result = runner.invoke(main, ["export", str(ckpt), str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert f"{data}: {size // 2} bytes, the manifest says {size}: the file is truncated" in result.output
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_an_hf_gpt2_exports_for_from_pretrained(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    want = clone_state_dict(model)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None), state_dict=model.state_dict())
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    out = str(tmp_path / "hf")
    report = export_checkpoint(str(tmp_path / "ckpt"), out)
    assert sorted(os.path.basename(p) for p in report["files"]) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))  # tied: once

    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    _assert_equal(clone_state_dict(loaded), want, "from_pretrained")
    reference = GPT2LMHeadModel(config).eval()
    reference.load_state_dict(want)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, reference(x, use_cache=False).logits)


def test_save_16bit_model_casts_parameters_and_keeps_buffers_in_mixed_precision(tmp_path):
    """A world of one: bf16 parameters beside BatchNorm's buffers (fp32 statistics, an int64
    count) in their own dtypes; a frozen parameter left out on request."""
    torch.manual_seed(0)
    model = zoo.build("cnn")
    model.features[0].conv.weight.requires_grad_(False)
    state = clone_state_dict(model)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, mixed_precision=fxzero.MixedPrecision()),
                            state_dict=state)
    path = save_16bit_model(engine, str(tmp_path), "model.safetensors")
    params = dict(model.named_parameters())
    want = {k: v.to(torch.bfloat16) if k in params else v for k, v in state.items()}
    _assert_equal(load_file(path), want, "mixed precision save_16bit_model")
    assert {v.dtype for k, v in want.items() if k not in params} == {torch.float32, torch.int64}
    trained_only = save_16bit_model(engine, str(tmp_path), "trained.safetensors", exclude_frozen_parameters=True)
    assert set(load_file(trained_only)) == set(want) - {"features.0.conv.weight"}
    (tmp_path / "a-file").write_text("")
    with pytest.raises(FileExistsError):  # rank 0 cannot write: it still gathers, then raises
        save_16bit_model(engine, str(tmp_path / "a-file"), "model.safetensors")


def test_the_streaming_writer_takes_tensors_in_any_order_and_commits_only_when_complete(tmp_path):
    values = {"empty": torch.zeros(0, 3), "half": torch.randn(3, dtype=torch.bfloat16),
              "count": torch.tensor(7), "mask": torch.tensor([True, False, True]),
              "wide": torch.arange(5, dtype=torch.float64)}
    path = str(tmp_path / "t.safetensors")
    with SafetensorsWriter(path, [(k, v.dtype, v.shape) for k, v in values.items()], {"format": "pt"}) as writer:
        for name in ["mask", "wide", "empty", "count", "half"]:
            writer.write(name, values[name])
    _assert_equal(load_file(path), values, "streamed")
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
        offsets = {k: v["data_offsets"] for k, v in json.loads(f.read(header)).items() if k != "__metadata__"}
    assert (8 + header) % 8 == 0  # the data starts 8-byte aligned, the widest dtypes first:
    assert [offsets[k] for k in ["count", "wide", "empty", "half", "mask"]] == [[0, 8], [8, 48], [48, 48], [48, 54],
                                                                              [54, 57]]

    partial = str(tmp_path / "partial.safetensors")
    with pytest.raises(ValueError, match=r"1 tensors were never written \(\['b'\]\)"):
        with SafetensorsWriter(partial, [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]) as writer:
            writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="'a' was declared torch.float32 \\[2\\], written as torch.float64"):
        with SafetensorsWriter(partial, [("a", torch.float32, (2,))]) as writer:
            writer.write("a", torch.zeros(2, dtype=torch.float64))
    assert os.listdir(tmp_path) == ["t.safetensors"]

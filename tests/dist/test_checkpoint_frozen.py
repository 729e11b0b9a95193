"""A checkpoint without the frozen parameters, as Hugging Face's Trainer saves and resumes a PEFT
model under DeepSpeed, on 2 ranks at ZeRO-3 ([Note: a checkpoint without the frozen parameters]
in `fxzero/runtime/checkpoint/load.py`).

The Trainer saves with `save_checkpoint(dir, exclude_frozen_parameters=True)` when the engine's
signature has the argument, and resumes with `load_checkpoint(dir, load_module_strict=False)` for a
PEFT model. Before, fxzero had no such argument (so every checkpoint held the frozen base) and
refused `load_module_strict=False` (so a PEFT run could not resume at all).

The model mixes the cases: a block whose base weight is frozen beside trainable low-rank
adapters (a unit mixing saved and left-out parameters), a block wholly frozen (a unit with
nothing saved) and a frozen embedding beside a trainable head (the root unit).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.runtime.checkpoint import CheckpointError
from fxzero.runtime.checkpoint.export import export_checkpoint
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.lora_a, self.lora_b = nn.Linear(16, 4, bias=False), nn.Linear(4, 16, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Adapted(), Adapted(), Adapted()])
        self.head = nn.Linear(16, 32)

    def forward(self, ids, y):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _model() -> Model:
    torch.manual_seed(0)
    model = Model()
    for name, p in model.named_parameters():
        p.requires_grad_(not (name.startswith("embed") or ".base." in name or name.startswith("blocks.2.")))
    return model


def _steps(engine, rank: int, first: int, n: int) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + n):
        g = torch.Generator().manual_seed(100 * rank + step)
        ids, y = torch.randint(0, 32, (2, 6), generator=g), torch.randint(0, 32, (2, 6), generator=g)
        loss = engine(ids, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return losses


def _run(rank: int, world_size: int, where: str) -> dict:
    config = fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-2), cost_model=None)
    engine = fxzero.compile(_model(), config)
    _steps(engine, rank, 0, 2)
    engine.save_checkpoint(os.path.join(where, "full"), tag="s2")
    engine.save_checkpoint(os.path.join(where, "lean"), tag="s2", exclude_frozen_parameters=True)
    want = _steps(engine, rank, 2, 2)

    resumed = fxzero.compile(_model(), config)
    try:
        resumed.load_checkpoint(os.path.join(where, "lean"), tag="s2")
        strict_error = None
    except CheckpointError as e:
        strict_error = str(e)
    path, _ = resumed.load_checkpoint(os.path.join(where, "lean"), tag="s2", load_module_strict=False)
    got = _steps(resumed, rank, 2, 2)
    return {"want": torch.stack(want), "got": torch.stack(got), "strict_error": strict_error,
            "state": resumed.full_state_dict(), "reference": engine.full_state_dict()}


def _bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def test_a_checkpoint_without_the_frozen_parameters_resumes_as_the_uninterrupted_run(tmp_path):
    ranks = run_ranks(_run, 2, str(tmp_path), timeout_s=240)
    frozen = sorted(name for name, p in _model().named_parameters() if not p.requires_grad)
    for rank, got in enumerate(ranks):
        assert torch.equal(got["got"], got["want"]), (rank, got["got"], got["want"])
        assert "load_module_strict=False" in got["strict_error"] and "frozen parameters" in got["strict_error"]
        for name, value in got["reference"].items():  # (the frozen ones kept this model's own values)
            assert torch.equal(got["state"][name], value), name
    with open(tmp_path / "lean" / "s2" / "fxzero.json") as f:
        manifest = json.load(f)
    assert manifest["excluded_frozen"] == frozen
    with open(tmp_path / "full" / "s2" / "fxzero.json") as f:
        assert json.load(f)["excluded_frozen"] == []
    metadata = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "lean" / "s2")).read_metadata()
    assert not any(name in key for key in metadata.state_dict_metadata for name in frozen)
    assert _bytes(tmp_path / "lean" / "s2") < _bytes(tmp_path / "full" / "s2")
    with pytest.raises(CheckpointError, match="saved with exclude_frozen_parameters=True"):
        export_checkpoint(str(tmp_path / "lean" / "s2"), str(tmp_path / "out"))

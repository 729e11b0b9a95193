"""Activation checkpointing as DeepSpeed's users ask for it: `deepspeed.checkpointing`
(`fxzero.checkpointing`) and the config's "activation_checkpointing" section. The arithmetic of
recompute regions is tested in tests/compile/test_recompute.py; here, the API: a model calling
`checkpoint` is recomputed under the engine and checkpointed by torch when run eagerly, the
section turns every unit's recompute on with each option it cannot honour named, `configure`
refuses model parallelism, and the module is `deepspeed.checkpointing` under the alias."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero import checkpointing
from fxzero.config.notices import IneffectiveSetting

pytestmark = pytest.mark.timeout(120)


class Checkpointed(nn.Module):
    """Two blocks, the second called through deepspeed.checkpointing.checkpoint, as Megatron does."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2))

    def forward(self, x):
        x = x + self.blocks[0](x)
        if self.checkpointed:
            return x + checkpointing.checkpoint(self.blocks[1], x)
        return x + self.blocks[1](x)


def _train(checkpointed: bool):
    torch.manual_seed(0)
    state = Checkpointed(False).state_dict()
    engine = fxzero.compile(Checkpointed(checkpointed), fxzero.Config(stage=3, cost_model=None), state_dict=state)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    forward = engine._stepping.compiled.programs["forward"].gm.graph
    kept = next(n for n in forward.nodes if n.op == "output").args[0]
    kept_bytes = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in kept
                     if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor))
    return losses, engine.full_state_dict(), kept_bytes


def test_a_models_checkpoint_call_is_recomputed_by_the_engine():
    (want, expected, resident), (got, state, kept) = _train(False), _train(True)
    assert got == want and all(torch.equal(state[k], expected[k]) for k in expected)
    assert kept < resident  # (the checkpointed block's hidden 8 x 64 activations are not kept)


def test_run_eagerly_a_checkpoint_call_is_torchs():
    model = Checkpointed(True)
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    model.checkpointed = False
    model(x).sum().backward()
    torch.testing.assert_close(x.grad, grad, rtol=0, atol=0)


def test_the_config_section_recomputes_every_unit_and_names_what_it_cannot_honour(monkeypatch):
    from fxzero.config import notices

    monkeypatch.setattr(notices, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = fxzero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                                               "activation_checkpointing": {"partition_activations": True,
                                                                            "cpu_checkpointing": True,
                                                                            "contiguous_memory_optimization": False}})
    assert config.activations == fxzero.Activations(recompute="unit", offload=fxzero.Cpu())  # (cpu_checkpointing)
    named = sorted(str(w.message).split("'")[1] for w in caught if issubclass(w.category, IneffectiveSetting))
    assert named == ["activation_checkpointing.contiguous_memory_optimization",
                     "activation_checkpointing.partition_activations"]
    plain = fxzero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                                          "activation_checkpointing": {"cpu_checkpointing": False}})
    assert plain.activations == fxzero.Activations(recompute="unit")
    with pytest.raises(ValueError, match="activation_checkpointing.bogus"):
        fxzero.Config.from_deepspeed({"activation_checkpointing": {"bogus": 1}})
    assert fxzero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1}).activations.recompute == "none"


def test_configure_takes_deepspeeds_arguments_and_refuses_model_parallelism(monkeypatch):
    from fxzero.config import notices

    monkeypatch.setattr(notices, "_WARNED", set())
    monkeypatch.setattr(checkpointing, "_configured", False)
    with pytest.raises(ValueError, match="fxzero has no model parallelism; pass None"):
        checkpointing.configure(object())
    with pytest.warns(IneffectiveSetting, match=r"configure\(checkpoint_in_cpu=...\) has no effect"):
        checkpointing.configure(None, checkpoint_in_cpu=True)
    assert checkpointing.is_configured()


def test_deepspeed_checkpointing_is_fxzeros_under_the_alias():
    code = ("from fxzero.deepspeed_alias import install; install()\n"
            "import deepspeed, deepspeed.checkpointing, fxzero.checkpointing\n"
            "from deepspeed.checkpointing import checkpoint\n"
            "assert deepspeed.checkpointing is fxzero.checkpointing and checkpoint is fxzero.checkpointing.checkpoint\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert proc.stdout.strip() == "ok", proc.stderr

"""The Llama-style decoder: built on meta, materialized by fxzero, same outputs as eager."""

from __future__ import annotations

import torch

import fxzero
from fxzero import zoo


def test_llama_7b_shape_on_meta():
    with torch.device("meta"):
        model = zoo.build("llama-7b")
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616
    assert len(model.blocks) == 32 and model.config.d_model == 4096
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_llama_tiny_matches_eager_in_a_world_of_one():
    torch.manual_seed(0)
    eager = zoo.build("llama-tiny")
    (x,) = eager.example_inputs()
    with torch.device("meta"):
        model = zoo.build("llama-tiny")
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    torch.testing.assert_close(engine(x), eager(x))
    loss = engine(x).logsumexp(-1).mean()
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)

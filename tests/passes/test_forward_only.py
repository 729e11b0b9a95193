"""Programs keyed by how the model is called, in a world of one: forward-only programs under
no_grad, the module modes and autocast state in the cache key, changing shapes, the bound.
(Multi-rank parity of HF models called the HF way is tests/dist/test_hf_models.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero import zoo
from fxzero.artifacts import memory_record
from tests.dist.reference import lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(180)


def _gpt():
    torch.manual_seed(0)
    model = zoo.build("gpt-tiny")
    return model, copy.deepcopy(model)


def test_a_no_grad_forward_runs_a_forward_only_program():
    """Under no_grad: eager's outputs exactly, no reduce-scatter, nothing saved for a backward;
    the forward's memory timeline ends with its outputs alone, where the joint program's holds
    the saved activations too."""
    model, ref = _gpt()
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    x, y = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, 4, seed=1)[0]
    with torch.no_grad():
        out = engine(x)
        assert torch.equal(out, ref(x))
    forward_only = engine.program
    kinds = {ins.kind for name in ("forward", "backward", "step") for ins in forward_only.schedule.program(name).instructions}
    assert "reduce_scatter" not in kinds and "all_gather" in kinds
    assert not [o for o in forward_only.programs["forward"].outputs if o[0] == "saved"]
    assert not forward_only.schedule.program("backward").instructions

    lm_loss(engine(x), y)  # the joint program of the same call
    joint = engine.program
    assert joint is not forward_only
    end = {name: memory_record(p, 3)["programs"]["forward"]["activations"][-1]
           for name, p in (("forward_only", forward_only), ("joint", joint))}
    # (while the last instruction runs: the logits it makes, and its own inputs)
    assert end["forward_only"] <= 3 * out.numel() * out.element_size(), end
    assert end["joint"] > 4 * end["forward_only"], end  # the activations kept for the backward


def test_a_no_grad_forward_between_backward_and_step_changes_nothing():
    """An evaluation between a backward and its step: the step still updates with the training
    program's gradients (a forward-only program never becomes what step() runs)."""
    model, ref = _gpt()
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, optimizer=fxzero.AdamW(lr=1e-2)))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, 4, seed=1)[0]
    engine.backward(lm_loss(engine(x), y))
    with torch.no_grad():
        engine(x[:2])
    engine.step()
    lm_loss(ref(x), y).backward()
    opt.step()
    for k, v in engine.full_state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=0, atol=1e-6, msg=k)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 16)])
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.blocks[1](self.drop(torch.relu(self.blocks[0](x))))


def test_modes_and_autocast_are_part_of_the_program():
    """train, then a submodule in eval, then autocast, then plain again: each as eager computes it
    (dropout draws the same masks from the same seed), each its own program."""
    torch.manual_seed(0)
    model = _Dropout()
    ref = copy.deepcopy(model)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    x = torch.randn(8, 16)

    def both():
        torch.manual_seed(7)
        got = engine(x)
        torch.manual_seed(7)
        return got, ref(x)

    got, want = both()
    assert torch.equal(got, want)
    model.drop.eval()
    ref.drop.eval()
    got, want = both()
    assert torch.equal(got, want)
    model.drop.train()
    ref.drop.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = both()
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    got, want = both()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert len(engine._cache) == 3  # train, submodule eval, autocast (plain again: from the cache)


def test_new_shapes_retrace_once_and_the_bound_evicts():
    """[Note: any size, one program]: the first length is traced at its size; the second, with the
    length symbolic, and that program serves every later length (no third compile). The bound
    on programs still evicts the least recently used."""
    model, _ = _gpt()
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, program_cache_size=2))
    seen = []
    for length in (8, 6, 8, 4, 7):
        x, y = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, 2, seed=length)[0]
        engine.backward(lm_loss(engine(x[:, :length]), y[:, :length]))
        engine.step()
        seen.append(engine.program)
    assert seen[0].shapes.shapes == ((2, 8),) and not seen[0].shapes.dynamic
    assert seen[1].shapes.dynamic and seen[1].shapes.shapes[0][0] == 2 and isinstance(seen[1].shapes.shapes[0][1], str)
    assert all(p is seen[1] for p in seen[1:]) and len(engine._cache) == 2
    with pytest.warns(UserWarning, match=r"3 programs exceed Config.program_cache_size=2: evicted the least recently"):
        with torch.no_grad():  # a forward-only program: a third
            engine(x[:, :5])
    assert len(engine._cache) == 2


def test_keyword_nested_and_constant_arguments():
    """Each structure and constant set is a program; outputs rebuilt as the model returns them."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x, *, extra=None, scale: float = 1.0, double: bool = False):
            h = self.blocks[0](x["a"] + x["b"][0])
            if extra is not None:
                h = h + extra
            h = self.blocks[1](h) * scale
            return {"out": h * 2 if double else h, "aux": (h.sum(), "tag")}

    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    x = {"a": torch.randn(2, 4), "b": [torch.randn(2, 4)]}
    for kwargs in ({}, {"extra": torch.ones(2, 4)}, {"scale": 3.0, "double": True}, {}):
        got, want = engine(x, **kwargs), ref(x, **kwargs)
        assert got.keys() == want.keys() and got["aux"][1] == "tag"
        assert torch.equal(got["out"], want["out"]) and torch.equal(got["aux"][0], want["aux"][0])
    assert len(engine._cache) == 3
    with pytest.raises(TypeError, match=r"input extra is a object"):
        engine(x, extra=object())

"""A forward that changes its module's Python state on every call runs eagerly, on 2 ranks,
against eager PyTorch computed here ([Note: a forward that changes its module's state] in
`fxzero/module_state.py`).

The model is DeepSpeed's own leaf-module test model (`ChooseModuleByCounter` in DeepSpeed's
tests/unit/runtime/zero/test_zero_leaf_module.py, written here its way): it picks
`self.linears[self.counter % 2]` and then counts the call. Traced once and replayed, it trained
one of its two layers, silently; now both train as eager PyTorch trains them, bit for bit. A
forward that sets an attribute on its first call only (a lazily built table) is traced as
before. The trace itself leaves the modules' attributes as it found them.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.module_state import StatefulForward
from fxzero.trace import trace_joint
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS, LR = 4, 0.1


class ChooseModuleByCounter(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)])
        self.counter = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linears[self.counter % len(self.linears)](x))
        self.counter += 1
        return F.cross_entropy(x, y)


class LazyTable(nn.Module):
    """Builds a Python table on its first call and reads it after: the same every call."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.table = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = [1.0, 2.0]
        return F.cross_entropy(self.proj(x) * self.table[1], y)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(2, 8, generator=g), torch.randint(0, 8, (2,), generator=g)) for _ in range(STEPS)]


def _train(rank: int, world_size: int, stage: int, cls_name: str) -> dict:
    torch.manual_seed(0)
    model = globals()[cls_name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.SGD(lr=LR), cost_model=None))
        losses = []
        for x, y in _batches(rank):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
    return {"losses": torch.stack(losses), "state": engine.full_state_dict(), "eager": engine._eager != set(),
            "counter": getattr(model, "counter", None), "warnings": [str(w.message) for w in caught]}


def _eager(cls_name: str, world: int) -> tuple[list[torch.Tensor], dict]:
    """DDP's arithmetic: every rank's copy takes the same branch, gradients averaged, SGD."""
    torch.manual_seed(0)
    model = globals()[cls_name]()
    copies = [copy.deepcopy(model) for _ in range(world)]
    batches = [_batches(r) for r in range(world)]
    losses = [[] for _ in range(world)]
    for step in range(STEPS):
        grads = []
        for r, m in enumerate(copies):
            loss = m(*batches[r][step])
            losses[r].append(loss.detach())
            grads.append(torch.autograd.grad(loss, list(m.parameters()), allow_unused=True))
        with torch.no_grad():
            for i, params in enumerate(zip(*(m.parameters() for m in copies))):
                got = [g[i] for g in grads if g[i] is not None]
                if got:
                    mean = torch.stack(got).sum(0) / world
                    for p in params:
                        p.add_(mean, alpha=-LR)  # (torch.optim.SGD's update)
    return [torch.stack(l) for l in losses], dict(copies[0].state_dict())


@pytest.mark.parametrize("stage", [2, 3])
def test_a_forward_that_counts_its_calls_runs_eagerly_and_trains_both_layers_as_eager(stage):
    ranks = run_ranks(_train, 2, stage, "ChooseModuleByCounter", timeout_s=240)
    want_losses, want_state = _eager("ChooseModuleByCounter", 2)
    for rank, got in enumerate(ranks):
        assert got["eager"] and got["counter"] == STEPS  # (the trace's calls were not counted)
        assert torch.equal(got["losses"], want_losses[rank]), (rank, got["losses"], want_losses[rank])
        for name, value in want_state.items():
            assert torch.equal(got["state"][name], value), name
        assert any("the forward changes counter (1 -> 2) on every call" in w for w in got["warnings"]), got["warnings"]
    initial = ChooseModuleByCounter()
    assert not torch.equal(ranks[0]["state"]["linears.0.weight"], initial.linears[0].weight)  # (both layers trained)


def test_a_forward_that_sets_state_on_its_first_call_only_is_traced():
    ranks = run_ranks(_train, 2, 3, "LazyTable", timeout_s=240)
    want_losses, want_state = _eager("LazyTable", 2)
    for rank, got in enumerate(ranks):
        assert not got["eager"] and not any("changes" in w for w in got["warnings"])
        assert torch.equal(got["losses"], want_losses[rank])
        assert all(torch.equal(got["state"][k], v) for k, v in want_state.items())


def test_the_trace_names_the_change_and_leaves_the_attributes_as_it_found_them():
    model = ChooseModuleByCounter()
    model.counter = 5
    with pytest.raises(StatefulForward, match=r"the forward changes counter \(6 -> 7\) on every call: fxzero traces"):
        trace_joint(model, (torch.randn(2, 8), torch.randint(0, 8, (2,))))
    assert model.counter == 5
    table = LazyTable()
    trace_joint(table, (torch.randn(2, 8), torch.randint(0, 8, (2,))))
    assert table.table == [1.0, 2.0]  # (set once, as an eager first call sets it)


class NanState(nn.Module):
    """Holds NaN in attributes it never changes (a sentinel, a list of them) and one it sets to a
    new NaN object on every call: none of it is a change of state."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.sentinel, self.history = float("nan"), [float("nan"), 1.0]
        self.last = float("nan")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.last = float("nan")
        return F.cross_entropy(self.linear(x), y)


def test_an_attribute_holding_nan_is_not_a_change():
    model = NanState()
    trace_joint(model, (torch.randn(2, 8), torch.randint(0, 8, (2,))))  # (no StatefulForward)
    model.last = 0.0
    model.forward = lambda x, y, m=model: (setattr(m, "last", m.last + 1.0), F.cross_entropy(m.linear(x), y))[1]
    with pytest.raises(StatefulForward, match=r"last \(1.0 -> 2.0\)"):  # (a number that does change still counts)
        trace_joint(model, (torch.randn(2, 8), torch.randint(0, 8, (2,))))

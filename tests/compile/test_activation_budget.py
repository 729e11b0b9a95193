"""`Activations(memory_budget=...)` ([Note: planning activations under a budget] in
`fxzero/passes/activation_budget.py`), one rank (2 ranks: `tests/dist/test_activation_budget.py`).

A Hugging Face GPT-2 with its dropouts, at three budgets between what the resident run holds and
what recomputing every unit holds: the activations a forward leaves for its backward
(`memory_report()["activations"]`, counted by the runtime) stay within each budget, and the
steps equal the resident run's bit for bit with the same collectives. The choice follows the
cost model: with a fast tier the planner offloads and recomputes nothing, with a slow one it
recomputes and offloads nothing. Budgets no plan meets, and settings that cannot work together,
are errors naming the fix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxzero
from fxzero.cost import preset
from fxzero.cost.model import Link, gbps
from tests.compile.test_recompute import CONFIG, _batches, _state

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

PRESET = "h100x8-nvlink"
"""The cost model the plans are priced by (pinned: no path chosen by a measurement)."""


def _nvme(gbytes_per_s: float):
    """The preset with its NVMe at `gbytes_per_s` both ways."""
    base = preset(PRESET)
    return dataclasses.replace(base, io={**base.io, "nvme_read": Link(bandwidth=gbps(gbytes_per_s), latency=1e-4),
                                         "nvme_write": Link(bandwidth=gbps(gbytes_per_s), latency=1e-4)})


def _train(activations: fxzero.Activations, cost_model=PRESET, steps: int = 3):
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    config = fxzero.Config(stage=3, cost_model=cost_model, activations=activations)
    engine = fxzero.compile(model, config, state_dict=_state())
    torch.manual_seed(5)
    losses, held = [], []
    for ids in _batches(steps):
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        held.append(engine.memory_report()["activations"])
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return engine, losses, max(held)


def _trace(engine, name: str) -> dict:
    return next((r.summary for r in engine._stepping.compiled.pass_trace if r.name == name), {})


_RECOMPUTE_S: dict[float, float] = {}
"""Predicted recompute seconds per budget fraction, as the parametrized runs record them."""


@pytest.fixture(scope="module")
def resident():
    return _train(fxzero.Activations())


@pytest.fixture(scope="module")
def least():
    """What the program holds with every unit's interior recomputed (the planner's floor)."""
    return _train(fxzero.Activations(recompute="unit"))[2]


@pytest.mark.parametrize("fraction", [0.75, 0.45, 0.2])
def test_recompute_alone_meets_each_budget_bit_for_bit(resident, least, fraction):
    engine0, want, full = resident
    budget = least + int(fraction * (full - least))
    engine, got, held = _train(fxzero.Activations(memory_budget=budget))
    assert held <= budget, (held, budget)
    assert got == want
    assert engine.comm_report() == engine0.comm_report()
    trace = _trace(engine, "separate_phases")
    assert trace["budget_kept_bytes"] == held and trace["budget_offload_bytes"] == 0
    assert trace["budget_recomputed"] > 0
    _RECOMPUTE_S[fraction] = trace["budget_recompute_s"]
    done = [_RECOMPUTE_S[f] for f in sorted(_RECOMPUTE_S, reverse=True)]
    assert done == sorted(done)  # (a smaller budget recomputes more, among the budgets run so far)


@pytest.mark.parametrize("fraction", [0.2])
def test_recompute_alone_uses_the_budget_to_its_edge(resident, least, fraction, monkeypatch):
    """A coarse grid of prices (LAMBDAS 4) then bisection on the price between the grid's best and
    the grid price below it recompute no more than trying every value's own flip price (LAMBDAS
    past their number, about 20 here; the default grid tries them all): the reference. Bisection
    also finds the prices where a group of values flips together, which no single value names,
    so it may do better than the reference, never worse; here the two agree."""
    from fxzero.passes import activation_budget

    _, want, full = resident
    budget = least + int(fraction * (full - least))
    runs = []
    for lambdas in (4, 10 ** 6):
        monkeypatch.setattr(activation_budget, "LAMBDAS", lambdas)
        engine, got, held = _train(fxzero.Activations(memory_budget=budget), steps=1)
        assert held <= budget and got == want[:1]
        runs.append(_trace(engine, "separate_phases"))
    refined, exhaustive = runs
    assert refined["budget_prices_tried"] < exhaustive["budget_prices_tried"]
    assert refined["budget_recompute_s"] <= exhaustive["budget_recompute_s"] * (1 + 1e-12)
    assert refined["budget_kept_bytes"] == exhaustive["budget_kept_bytes"]


@pytest.mark.parametrize("fast", [True, False])
def test_the_cost_model_chooses_between_offload_and_recompute(resident, least, tmp_path, fast):
    """NVMe at 100 GB/s hides behind compute: offload only. At 0.01 GB/s its transfers would take
    far longer than recomputing: recompute only. Either way within the budget, bit for bit."""
    _, want, full = resident
    budget = least + int(0.45 * (full - least))
    engine, got, held = _train(fxzero.Activations(memory_budget=budget, offload=fxzero.Nvme(path=str(tmp_path)),
                                                  offload_min_bytes=0), cost_model=_nvme(100.0 if fast else 0.01))
    assert held <= budget and got == want
    planned, moved = _trace(engine, "separate_phases"), _trace(engine, "plan_offload")
    if fast:
        assert planned["budget_recomputed"] == 0 and moved["offload_bytes"] > 0
        assert engine.memory_report()["activations_nvme_peak"] == moved["offload_bytes"]
    else:
        assert planned["budget_recomputed"] > 0 and moved["offload_bytes"] == 0


def test_the_planner_does_only_what_budget_choices_allow(resident, least, tmp_path):
    """("offload",): a tier that hides nothing still takes the excess, nothing recomputed;
    ("recompute",) with a tier set: nothing offloaded, the tier's own rule overruled too."""
    _, want, full = resident
    budget = least + int(0.45 * (full - least))
    for choices, speed in ((("offload",), 0.01), (("recompute",), 100.0)):
        engine, got, held = _train(fxzero.Activations(memory_budget=budget, offload=fxzero.Nvme(path=str(tmp_path)),
                                                      offload_min_bytes=0, budget_choices=choices),
                                   cost_model=_nvme(speed))
        assert held <= budget and got == want
        planned, moved = _trace(engine, "separate_phases"), _trace(engine, "plan_offload")
        assert (planned["budget_recomputed"] > 0) == (choices == ("recompute",))
        assert (moved["offload_bytes"] > 0) == (choices == ("offload",))
        assert _trace(engine, "offload_activations")["offloaded"] == moved["offloaded"]


def test_a_budget_no_plan_meets_names_the_least(least):
    with pytest.raises(ValueError, match=r"memory_budget=1000\) cannot be met without a tier: the least this "
                                         r"program can keep for its backward is \d+ bytes per rank.*Nvme"):
        _train(fxzero.Activations(memory_budget=1000), steps=1)


def test_a_budget_not_even_a_tier_meets_names_what_cannot_move(tmp_path):
    """With a tier, what stays is what cannot move: the model's input ids (4 x 32 int64, 1024
    bytes) are kept whatever the plan; the error says so, not to add a tier."""
    with pytest.raises(ValueError, match=r"memory_budget=100\) cannot be met even with the nvme tier: (\d+) bytes per "
                                         r"rank of what this program keeps for its backward cannot move to a tier "
                                         r".*Raise memory_budget: it must be at least \1$") as error:
        _train(fxzero.Activations(memory_budget=100, offload=fxzero.Nvme(path=str(tmp_path)), offload_min_bytes=0),
               steps=1)
    assert int(error.value.args[0].split("tier: ")[1].split()[0]) >= 1024


def test_settings_that_cannot_work_together_are_refused():
    with pytest.raises(ValueError, match="chooses what to recompute itself; recompute='unit' would overrule it"):
        fxzero.Activations(memory_budget=10**6, recompute="unit")
    with pytest.raises(ValueError, match="must be a positive number of bytes, got 0"):
        fxzero.Activations(memory_budget=0)
    with pytest.raises(ValueError, match=r"one or both of \('recompute', 'offload'\); got \('keep',\)"):
        fxzero.Activations(memory_budget=10**6, budget_choices=("keep",))
    with pytest.raises(ValueError, match="no memory_budget is set"):
        fxzero.Activations(budget_choices=("recompute",))
    with pytest.raises(ValueError, match=r"only offload, and no tier is set: add offload=fxzero.Nvme"):
        fxzero.Activations(memory_budget=10**6, budget_choices=("offload",))
    with pytest.raises(ValueError, match="prices recompute and offload with the cost model: set Config.cost_model"):
        _train(fxzero.Activations(memory_budget=10**6), cost_model=None, steps=1)


def test_an_offload_is_priced_by_what_no_compute_hides_and_the_compute_it_slows():
    """`_offload_s`, pinned figures: 1e9 bytes written at 1 GB/s (1 s) under a 3 s forward hide
    entirely; read at 0.5 GB/s (2 s) under a 1.5 s backward, 0.5 s shows; io_interference 0.5
    slows the compute they overlap, 1 s + 1.5 s of it, by 1.25 s."""
    from fxzero.passes.activation_budget import _offload_s

    io = {"nvme_write": Link(bandwidth=1e9), "nvme_read": Link(bandwidth=5e8)}
    pinned = dataclasses.replace(preset("cpu-loopback"), io=io, io_interference=0.0)
    assert _offload_s(pinned, "nvme", 10**9, 3.0, 1.5) == pytest.approx(0.5)
    slowed = dataclasses.replace(pinned, io_interference=0.5)
    assert _offload_s(slowed, "nvme", 10**9, 3.0, 1.5) == pytest.approx(0.5 + 0.5 * (1.0 + 1.5))

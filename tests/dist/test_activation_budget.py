"""`Activations(memory_budget=...)` on 2 ranks at ZeRO-3, fp32: a Hugging Face GPT-2 with its
dropouts, the planner free to keep, recompute and offload to NVMe, at three budgets between
what the resident run holds and what recomputing every unit holds, trains 10 steps bit for bit
as the resident run does, with the same collectives, each forward leaving at most the budget
for its backward ([Note: planning activations under a budget] in
`fxzero/passes/activation_budget.py`)."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch

import fxzero
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

CONFIG = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
STEPS = 10
BUDGETS = ((0.75, 3.0), (0.45, 0.5), (0.2, 1.3))
"""(fraction of the way from what recomputing every unit holds to what the resident run holds,
NVMe GB/s the plan is priced at): a fast tier the planner offloads to, a slow one it recomputes
instead of, one between."""


def _cost_model(nvme_gbytes_per_s: float):
    """The H100 preset with its NVMe at `nvme_gbytes_per_s` both ways."""
    from fxzero.cost import preset
    from fxzero.cost.model import Link, gbps

    base = preset("h100x8-nvlink")
    link = Link(bandwidth=gbps(nvme_gbytes_per_s), latency=1e-4)
    return dataclasses.replace(base, io={**base.io, "nvme_read": link, "nvme_write": link})


def _train(rank: int, activations: fxzero.Activations, nvme_gbytes_per_s: float = 3.0):
    torch.manual_seed(0)
    state = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG)).state_dict()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    config = fxzero.Config(stage=3, cost_model=_cost_model(nvme_gbytes_per_s), activations=activations)
    engine = fxzero.compile(model, config, state_dict=state)
    torch.manual_seed(100 + rank)  # (each rank's dropout masks, alike in every run)
    losses, held = [], 0
    for step in range(STEPS):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        held = max(held, engine.memory_report()["activations"])
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    trace = {r.name: r.summary for r in engine._stepping.compiled.pass_trace}
    return losses, engine.full_state_dict(), engine.comm_report(), held, trace


def _each(rank: int, world_size: int):
    runs = {"none": _train(rank, fxzero.Activations()), "unit": _train(rank, fxzero.Activations(recompute="unit"))}
    full, least = runs["none"][3], runs["unit"][3]
    with tempfile.TemporaryDirectory() as path:
        for fraction, speed in BUDGETS:
            budget = least + int(fraction * (full - least))
            runs[fraction] = (*_train(rank, fxzero.Activations(memory_budget=budget, offload=fxzero.Nvme(path=path),
                                                               offload_min_bytes=0), speed), budget)
    return runs


def test_the_budget_planner_trains_as_the_resident_run_on_two_ranks():
    for rank, runs in enumerate(run_ranks(_each, 2)):
        want, expected, traffic, _, _ = runs["none"]
        kinds = set()
        for fraction, _ in BUDGETS:
            got, state, planned_traffic, held, trace, budget = runs[fraction]
            assert held <= budget, (rank, fraction, held, budget)
            assert got == want, (rank, fraction)
            assert all(torch.equal(state[k], expected[k]) for k in expected), (rank, fraction)
            assert planned_traffic == traffic
            if trace["separate_phases"]["budget_recomputed"]:
                kinds.add("recompute")
            if trace["plan_offload"]["offload_bytes"]:
                kinds.add("offload")
        assert kinds == {"recompute", "offload"}, kinds  # (the budgets exercise both)

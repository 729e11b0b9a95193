"""`Activations(recompute="unit")` (with and without `keep_attention`) and `"selective"` on 2 ranks
at ZeRO-3, fp32: a Hugging Face GPT-2 with its dropouts trains 10 steps bit for bit as the
resident run does on the same ranks, with the same all-gather bytes ([Note: recomputing a unit] in `fxzero/config/activations.py`,
[Note: selective recompute] in `fxzero/passes/recompute_cut.py`)."""

from __future__ import annotations

import pytest
import torch

import fxzero
from fxzero.activation_estimate import policy_activations
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

CONFIG = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
STEPS = 10


def _train(rank: int, recompute: str, stage: int, overrides: dict):
    torch.manual_seed(0)
    state = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG, **overrides)).state_dict()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG, **overrides))
    config = fxzero.Config(stage=stage, cost_model=None, activations=policy_activations(recompute))
    engine = fxzero.compile(model, config, state_dict=state)
    torch.manual_seed(100 + rank)  # (each rank's dropout masks, alike in both runs)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    kept = next(r for r in engine._stepping.compiled.pass_trace if r.name == "separate_phases").summary
    return losses, engine.full_state_dict(), engine.comm_report(), kept.get("attention_kept")


def _each(rank: int, world_size: int, stage: int, policies: tuple[str, ...], overrides: dict = {}):  # noqa: B006
    return {recompute: _train(rank, recompute, stage, overrides) for recompute in ("none",) + policies}


@pytest.mark.parametrize("stage, policies", [(3, ("unit", "selective")), (2, ("unit",))])
def test_recompute_trains_as_the_resident_run_on_two_ranks(stage, policies):
    for rank, runs in enumerate(run_ranks(_each, 2, stage, policies)):
        want, expected, traffic, _ = runs["none"]
        for policy in policies:
            got, state, recomputed_traffic, _ = runs[policy]
            assert got == want, (rank, policy)
            assert all(torch.equal(state[k], expected[k]) for k in expected), (rank, policy)
            assert recomputed_traffic["all_gather"] == traffic["all_gather"]
            assert recomputed_traffic == traffic


def test_keeping_attention_trains_as_the_resident_run_on_two_ranks():
    """`keep_attention=True` on GPT-2 without attention dropout (with it, torch's CPU path is the
    unfused math one: no fused attention to keep), its other dropouts replayed: each block keeps
    its attention, bit for bit the resident run."""
    for rank, runs in enumerate(run_ranks(_each, 2, 3, ("unit-attention",), {"attn_pdrop": 0.0})):
        want, expected, traffic, _ = runs["none"]
        got, state, kept_traffic, kept = runs["unit-attention"]
        assert kept == CONFIG["n_layer"]
        assert got == want, rank
        assert all(torch.equal(state[k], expected[k]) for k in expected), rank
        assert kept_traffic == traffic

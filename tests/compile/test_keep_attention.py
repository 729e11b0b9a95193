"""`Activations(recompute="unit", keep_attention=True)` ([Note: keeping attention] in
`fxzero/config/activations.py`): a unit keeps its fused attention's outputs beside its inputs,
and its backward recomputes its forward but not the attention.

One rank here, the zoo GPT (its attention is `scaled_dot_product_attention`, the CPU flash kernel)
with a dropout added to each block, and Hugging Face GPT-2 (attention dropout inside the fused
kernel) after `gradient_checkpointing_enable()`; 2 ranks in `tests/dist/test_recompute.py`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.activation_estimate import count_saved
from fxzero.config.notices import IneffectiveSetting
from fxzero.ir.rng import STATE_BYTES
from fxzero.ir.sizes import is_fused_attention
from fxzero.zoo import gpt

pytestmark = pytest.mark.timeout(300)

SEQ, BATCH, STEPS = 64, 2, 3


class _DroppedBlock(nn.Module):
    """A zoo block whose output passes a dropout: a random operator in every unit, recomputed."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block, self.drop = block, nn.Dropout(0.1)

    def forward(self, x, *args, **kwargs):
        return self.drop(self.block(x, *args, **kwargs))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = gpt("tiny", d_model=64, n_heads=4, n_blocks=3, seq_len=SEQ)
    model.blocks = nn.ModuleList(_DroppedBlock(b) for b in model.blocks)
    return model


def _train(activations: fxzero.Activations):
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = fxzero.Config(stage=3, cost_model=None, activations=activations, optimizer=fxzero.AdamW(lr=1e-2))
    engine = fxzero.compile(model, config, state_dict=state)
    torch.manual_seed(5)  # (the dropout masks: the same draws in every run)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        loss = F.cross_entropy(engine(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


@pytest.fixture(scope="module")
def runs():
    return {name: _train(acts) for name, acts in (
        ("none", fxzero.Activations()), ("unit", fxzero.Activations(recompute="unit")),
        ("kept", fxzero.Activations(recompute="unit", keep_attention=True)))}


def _program(engine, name: str) -> torch.fx.Graph:
    return engine._stepping.compiled.programs[name].gm.graph


def _attentions(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if is_fused_attention(n) or (n.op == "call_function" and any(
        isinstance(a, torch._ops.OpOverload) and "attention" in str(a) for a in n.args)))


def test_keeping_attention_trains_as_the_resident_run_bit_for_bit(runs):
    (resident, want), (kept, got) = runs["none"], runs["kept"]
    assert got == want
    state, expected = kept.full_state_dict(), resident.full_state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert kept.comm_report() == resident.comm_report()


def test_the_backward_recomputes_no_attention_and_keeps_its_outputs(runs):
    blocks = 3
    assert _attentions(_program(runs["unit"][0], "backward")) == blocks  # (each unit's, recomputed)
    assert _attentions(_program(runs["kept"][0], "backward")) == 0
    assert _attentions(_program(runs["kept"][0], "forward")) == blocks
    unit, kept = (count_saved(runs[k][0]._stepping.compiled, k) for k in ("unit", "kept"))
    # What it keeps beside "unit"'s: each block's attention output (batch, heads, seq, head dim)
    # and its float32 logsumexp (batch, heads, seq), from the shapes.
    per_block = BATCH * SEQ * 64 * 4 + BATCH * 4 * SEQ * 4
    assert kept.by_kind()["attention"] == blocks * per_block
    assert kept.by_kind()["input"] == unit.by_kind()["input"]
    # The dropouts' generator states stay; the attentions' (torch tags attention random, for its
    # dropout) are needed no more: a kept attention is not drawn again.
    state = STATE_BYTES["cpu"]
    assert unit.by_kind()["random"] == 2 * blocks * state
    assert kept.by_kind()["random"] == blocks * state
    assert kept.total == unit.total + blocks * (per_block - state)


def test_the_pass_trace_counts_the_attentions_kept(runs):
    records = {r.name: r for r in runs["kept"][0]._stepping.compiled.pass_trace}
    assert records["separate_phases"].summary["attention_kept"] == 3


def test_keep_attention_on_a_model_without_attention_says_it_changes_nothing():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    config = fxzero.Config(cost_model=None, activations=fxzero.Activations(recompute="unit", keep_attention=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxzero.compile_program(model, (torch.randn(2, 8),), config, world_size=1)
    assert any(issubclass(w.category, IneffectiveSetting) and "keep_attention=True) has no effect" in str(w.message)
               for w in caught)


@pytest.mark.parametrize("kwargs, why", [
    (dict(recompute="selective"), "selective recompute keeps attention's outputs already"),
    (dict(memory_budget=1 << 20), "the memory budget's planner chooses what to keep itself"),
])
def test_keep_attention_where_something_else_chooses_is_refused(kwargs, why):
    with pytest.raises(ValueError, match=rf"keep_attention=True\) applies to recompute='unit'.*{why}"):
        fxzero.Activations(keep_attention=True, **kwargs)
    with pytest.raises(TypeError, match="must be True or False"):
        fxzero.Activations(recompute="unit", keep_attention=1)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_a_model_that_checkpoints_itself_keeps_its_attention_in_its_regions():
    """Hugging Face GPT-2 after gradient_checkpointing_enable(), recompute left at "none": each
    checkpoint region keeps its attention (no attention dropout: with one, torch's CPU path is
    the unfused math one, and there is nothing to keep), bit for bit the plain checkpointed run."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, attn_pdrop=0.0)

    def run(keep: bool):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        model.gradient_checkpointing_enable()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        engine = fxzero.compile(model, fxzero.Config(cost_model=None, activations=fxzero.Activations(
            keep_attention=keep)), state_dict=state)
        torch.manual_seed(5)
        losses = []
        for step in range(2):
            ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
            loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return engine, losses

    (plain, want), (kept, got) = run(False), run(True)
    assert got == want
    expected, state = plain.full_state_dict(), kept.full_state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert _attentions(_program(plain, "backward")) == 2 and _attentions(_program(kept, "backward")) == 0
    records = {r.name: r for r in kept._stepping.compiled.pass_trace}
    assert records["separate_phases"].summary["attention_kept"] == 2

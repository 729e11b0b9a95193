"""Hugging Face models built on the meta device get their own initialization, on 2 ranks.

A GPT-2 (Conv1D layers, a tied head, scaled residual projections) and a Llama (RMSNorms with no
reset_parameters(), rotary buffers) are built under `torch.device("meta")` and compiled with
`Config(seed=S)`: their full_state_dict() and buffers must be exactly what eager construction
gives after `torch.manual_seed(S)`, HF's `post_init()` -> `_init_weights` included. Memory: each
rank holds only its parameter shards, and the replay of the init never held more full tensors at
once than the largest unit.

One spawn for everything (both models on both ranks); the zoo GPT and the toy models are
checked in one process in tests/passes/test_init_replay.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist.harness import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

SEED = 11  # not the default seed 0
MODELS = ("gpt2", "llama")


def _build(name: str) -> torch.nn.Module:
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=256)
    return transformers.LlamaForCausalLM(cfg)


def _on_rank(rank: int, world_size: int) -> dict:
    import fxzero
    import fxzero.api

    out = {}
    for name in MODELS:
        stats: dict = {}
        real = fxzero.api.materialize
        fxzero.api.materialize = functools.partial(real, stats=stats)  # to read the replay's peak
        try:
            with torch.device("meta"):
                model = _build(name)
            engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, seed=SEED))
        finally:
            fxzero.api.materialize = real
        layouts = engine.state.layouts
        out[name] = {
            "state": engine.full_state_dict(),  # a collective
            "buffers": dict(engine.state.buffers),
            "memory": engine.memory_report(),
            "shard_bytes": sum(lay.shard_numel * lay.itemsize for lay in layouts),
            "largest_unit_bytes": max(lay.padded_numel * lay.itemsize for lay in layouts),
            "replay_peak_bytes": stats["peak_bytes"],
            "still_meta": all(p.is_meta for p in model.parameters()),
        }
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_on_rank, 2, timeout_s=240)


@functools.cache
def _eager(name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(SEED)
    model = _build(name)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, {k: b.detach().clone() for k, b in model.named_buffers()}


@pytest.mark.parametrize("name", MODELS)
def test_meta_built_model_holds_its_eager_initialization(runs, name: str) -> None:
    want, want_buffers = _eager(name)
    for rank, per_rank in enumerate(runs):
        got = per_rank[name]
        assert sorted(got["state"]) == sorted(want)
        for key, value in want.items():
            assert torch.equal(got["state"][key], value), (
                f"{name} rank {rank}: {key!r} is not what torch.manual_seed({SEED}) and eager "
                "construction give")
        assert sorted(got["buffers"]) == sorted(want_buffers)
        for key, value in want_buffers.items():
            assert torch.equal(got["buffers"][key], value), f"{name} rank {rank}: buffer {key!r}"
        assert got["still_meta"], "compiling must leave the model on the meta device"


@pytest.mark.parametrize("name", MODELS)
def test_no_rank_holds_more_than_its_shards_plus_one_unit(runs, name: str) -> None:
    for rank, per_rank in enumerate(runs):
        got = per_rank[name]
        assert got["memory"]["param_shards"] == got["shard_bytes"], f"{name} rank {rank}"
        assert 0 < got["replay_peak_bytes"] <= got["largest_unit_bytes"], (
            f"{name} rank {rank}: the init replay held {got['replay_peak_bytes']} bytes of full tensors "
            f"at once, more than the largest unit ({got['largest_unit_bytes']} bytes)")


def test_the_comparison_is_not_vacuous() -> None:
    """HF's _init_weights matters: the layers' own reset_parameters() alone give other values."""
    want, _ = _eager("gpt2")
    assert want["transformer.h.0.attn.c_proj.weight"].std() < 0.02  # GPT-2's scaled residual init
    assert abs(want["transformer.wte.weight"].std().item() - 0.02) < 0.005  # not nn.Embedding's N(0, 1)

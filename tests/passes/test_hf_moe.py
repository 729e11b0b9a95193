"""A Hugging Face mixture of experts (Mixtral) traced by fxzero: its default experts call torch's
grouped matmul, whose tracing rule takes bfloat16 only. In bfloat16 it compiles; in float32 the
error names the two ways out (`fxzero.trace.UntraceableDtype`). Its training against eager, with
the batched experts in float32, is tests/dist/test_hf_models.py's."""

from __future__ import annotations

import logging

import pytest
import torch

import fxzero
from fxzero.compiler import compile_program
from fxzero.trace import UntraceableDtype

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")


def _mixtral(experts: str = "grouped_mm"):
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2, use_cache=False))
    model.set_experts_implementation(experts)
    return model


IDS = torch.zeros(2, 16, dtype=torch.long)


def _grouped_mm_calls(compiled) -> int:
    return sum(1 for n in compiled.joint.graph.nodes if "grouped_mm" in str(n.target))


def test_a_float32_grouped_matmul_is_refused_naming_the_ways_out(caplog):
    with caplog.at_level(logging.ERROR), pytest.raises(UntraceableDtype) as caught:
        compile_program(_mixtral(), (), fxzero.Config(), world_size=2, kwargs={"input_ids": IDS, "labels": IDS})
    # (not after torch's log of the meta kernel's failure, its whole stack, which said less)
    assert not [r for r in caplog.records if "failed while attempting to run meta" in r.getMessage()]
    message = str(caught.value)
    assert message.startswith("the forward calls torch's grouped matmul (torch._grouped_mm, F.grouped_mm) in float32 "
                              "at "), message
    assert "transformers/integrations/moe.py" in caught.value.where
    assert "fxzero.Config(mixed_precision=fxzero.MixedPrecision())" in message
    assert 'model.set_experts_implementation("batched_mm")' in message
    assert str(caught.value.with_rank(1)).startswith("[rank 1] the forward calls torch's grouped matmul")


def test_in_bfloat16_it_compiles_with_the_grouped_matmul_and_batched_in_float32():
    bf16 = compile_program(_mixtral(), (), fxzero.Config(mixed_precision=fxzero.MixedPrecision()), world_size=2,
                           kwargs={"input_ids": IDS, "labels": IDS})
    assert _grouped_mm_calls(bf16) >= 2 * 2  # (each layer's two expert projections, forward and backward)
    batched = compile_program(_mixtral("batched_mm"), (), fxzero.Config(), world_size=2,
                              kwargs={"input_ids": IDS, "labels": IDS})
    assert _grouped_mm_calls(batched) == 0


def test_the_grouped_experts_are_priced_at_their_flops():
    # torch's FLOP registry has no formula for the grouped matmul, so a Mixtral's experts cost the
    # simulator nothing. Counted from the shapes here: each of the 2 x 16 tokens goes to 2 experts,
    # whose projections are 64 -> 2 x 96 and 96 -> 64; the backward does twice the forward's.
    tokens, k, h, i, layers = 2 * 16, 2, 64, 96, 2
    forward = layers * tokens * k * (2 * h * 2 * i + 2 * i * h)
    compiled = compile_program(_mixtral(), (), fxzero.Config(mixed_precision=fxzero.MixedPrecision()), world_size=2,
                               device="cuda", kwargs={"input_ids": IDS, "labels": IDS})
    experts = {p.name: sum(ins.flops for ins in p.instructions if ins.name.startswith("_grouped_mm"))
               for p in compiled.schedule.programs}
    assert experts == {"forward": forward, "backward": 2 * forward, "step": 0}
    assert all(ins.flops > 0 for p in compiled.schedule.programs for ins in p.instructions
               if ins.name.startswith("_grouped_mm"))

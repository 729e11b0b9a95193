"""Hugging Face Llama, Mixtral and Qwen2-MoE (their default grouped experts, which trace in bfloat16
only; Qwen2-MoE's shared expert beside them) with bfloat16 masters on 2 ranks at ZeRO-3, equal bit
for bit to the eager reference written apart from the engine
(`tests/dist/low_precision_reference.py`), resident and with every unit recomputed. The reference
casts the parameters and keeps the buffers' dtype, as fxzero (and FSDP2, and DeepSpeed 0.19's bf16)
does: a Llama's rotary frequencies (`inv_freq`) stay float32 (cast to bfloat16, as
`model.to(torch.bfloat16)` does, they round, and the logits move by about 3e-3)."""

from __future__ import annotations

import pytest
import torch

import fxzero
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.low_precision_reference import eager_bf16_masters
from tests.dist.reference import lm_loss, rank_slice

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

BF16, WORLD, STEPS = torch.bfloat16, 2, 4
MODELS = ("llama", "mixtral", "qwen2_moe")


class _Logits(torch.nn.Module):
    """The model called the HF way, its logits out (the loss is the reference's `lm_loss`)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        t = transformers
        shape = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=128, use_cache=False)
        if name == "llama":
            self.m = t.LlamaForCausalLM(t.LlamaConfig(**shape))
        elif name == "mixtral":
            self.m = t.MixtralForCausalLM(t.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2))
        else:  # (a shared expert beside the routed ones, gated by its own sigmoid)
            self.m = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**shape, num_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=48,
                                                            shared_expert_intermediate_size=96))
        if name != "llama":
            assert self.m.config._experts_implementation == "grouped_mm"  # (the default this test is about)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids).logits


def _initial(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in _Logits(name).state_dict().items()}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(17)
    return [(torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
            for _ in range(STEPS)]


def _train(rank: int, world_size: int) -> dict:
    mp = fxzero.MixedPrecision(param_dtype=BF16, reduce_dtype=None, master_dtype=BF16, optimizer_dtype=torch.float32)
    out = {}
    for name in MODELS:
        for recompute in ("none", "unit"):
            engine = fxzero.compile(_Logits(name), fxzero.Config(
                optimizer=fxzero.AdamW(**ADAMW), cost_model=None, mixed_precision=mp,
                activations=fxzero.Activations(recompute=recompute)), state_dict=_initial(name))
            losses = []
            for x, y in _batches():
                loss = lm_loss(engine(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach().float().reshape(1))
            mean = torch.cat(losses)
            torch.distributed.all_reduce(mean)
            out[name, recompute] = ((mean / world_size).tolist(),
                                    {k: v.clone() for k, v in engine.full_state_dict().items()})
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_train, WORLD, timeout_s=280)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_masters_train_as_the_eager_reference_bit_for_bit(ranks, name):
    want_losses, want, _ = eager_bf16_masters(lambda: _Logits(name), _initial(name), _batches(), WORLD, torch.float32,
                                              threads=1)
    for rank, result in enumerate(ranks):
        for recompute in ("none", "unit"):
            losses, state = result[name, recompute]
            assert losses == want_losses, (name, recompute, rank)
            differ = [k for k in want if not torch.equal(state[k], want[k])]
            assert not differ, (name, recompute, rank, differ)

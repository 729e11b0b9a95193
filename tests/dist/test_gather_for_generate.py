"""`Config.gather_for_generate` (DeepSpeed's hybrid engine, `hybrid_engine.enabled`): at ZeRO-3 the
model's generate gathers the whole model once for the call ([Note: generating from a ZeRO-3 model
gathered once] in fxzero/runtime/user_module.py).

Two engines trained alike on 2 ranks, bf16 at ZeRO-3, one generating with the setting and one
without: the same tokens; one gather for the whole generate against one per layer and token; the
parameters placeholders again after it. And the DeepSpeed section read: enabled at ZeRO-3 sets it,
below ZeRO-3 it is said to have no effect, the inference kernels' tuning keys are said to have none,
tensor-parallel generation and an unknown key are errors."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxzero
from fxzero.config.notices import IneffectiveSetting
from tests.dist.harness import ADAMW, run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)


def _generate(rank: int, gather_for_generate: bool) -> dict:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=2, vocab_size=256, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        use_cache=False))
    engine = fxzero.compile(model, fxzero.Config(
        stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None, gather_for_generate=gather_for_generate,
        mixed_precision=fxzero.MixedPrecision(param_dtype=torch.bfloat16)))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 256, (4, 16), generator=g)[2 * rank : 2 * rank + 2]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    gathers, meta_in_forward = [], []
    gather = engine._user.gather

    def counting(*args, **kwargs):
        gathers.append(1)
        return gather(*args, **kwargs)

    engine._user.gather = counting
    layer = model.transformer.h[2].mlp.c_fc
    hook = layer.register_forward_hook(lambda module, args, out: meta_in_forward.append(module.weight.is_meta))
    prompt = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(2 + rank))
    tokens = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False, pad_token_id=0, synced_gpus=True)
    hook.remove()
    return {"tokens": tokens, "gathers": len(gathers), "forwards": len(meta_in_forward),
            "meta_in_forward": any(meta_in_forward), "placeholders_after": layer.weight.is_meta}


def _job(rank: int, world_size: int) -> list[dict]:
    return [_generate(rank, False), _generate(rank, True)]


def test_generate_gathers_the_zero3_model_once_and_makes_the_same_tokens():
    for per_layer, once in run_ranks(_job, 2, timeout_s=240):
        assert torch.equal(once["tokens"], per_layer["tokens"])
        assert once["forwards"] == per_layer["forwards"] == 5  # (one forward per new token)
        assert once["gathers"] == 1, once
        assert per_layer["gathers"] >= 5 * 3, per_layer  # (every layer at every token)
        assert not once["meta_in_forward"] and not per_layer["meta_in_forward"]
        assert once["placeholders_after"] and per_layer["placeholders_after"]


_HYBRID = {"enabled": True, "max_out_tokens": 96, "inference_tp_size": 1, "release_inference_cache": False,
           "pin_parameters": True, "tp_gather_partition_size": 8}
"""The section DeepSpeed-Chat's --enable_hybrid_engine writes (dschat/utils/ds_utils.py)."""


def _read(stage: int, hybrid: dict) -> tuple[fxzero.Config, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = fxzero.Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": hybrid,
                                               "zero_optimization": {"stage": stage}})
    return config, [str(w.message) for w in caught if issubclass(w.category, IneffectiveSetting)]


def test_the_hybrid_engine_section_reads_as_deepspeed_means_it():
    config, said = _read(3, _HYBRID)
    assert config.gather_for_generate
    assert any("'hybrid_engine.max_out_tokens' has no effect" in m for m in said), said
    assert not any("pin_parameters" in m for m in said)  # (DeepSpeed's default: nothing to say)
    config, said = _read(2, _HYBRID)
    assert not config.gather_for_generate
    assert any("'hybrid_engine.enabled' has no effect in fxzero at ZeRO-2" in m for m in said), said
    config, said = _read(3, {**_HYBRID, "enabled": False, "max_out_tokens": 7})
    assert not config.gather_for_generate and not any("hybrid_engine" in m for m in said)
    with pytest.raises(ValueError, match="inference_tp_size=2 is not supported"):
        _read(3, {**_HYBRID, "inference_tp_size": 2})
    with pytest.raises(ValueError, match="hybrid_engine has no key 'max_out_token'"):
        _read(3, {"enabled": True, "max_out_token": 96})

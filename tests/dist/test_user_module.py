"""The user's own module after training holds the trained weights, never the initial ones
([Note: the user's module] in `fxzero/runtime/user_module.py`).

One 2-rank spawn trains an HF GPT-2 (built eagerly, as a DeepSpeed user builds it) five steps at
each of stages 1, 2 and 3, in fp32 and in bf16, and then reads the model the way users do:
`model.state_dict()`, a submodule's `state_dict()`, `save_pretrained()`, reading a parameter,
calling the model directly. The trained values are computed independently: the engine's fp32
masters (`full_state_dict`) cast to the compute dtype, and `fxzero export` of a checkpoint saved
at the same point.
"""

from __future__ import annotations

import os

import pytest
import torch

import fxzero
from fxzero.runtime.checkpoint import export_checkpoint
from tests.dist.harness import ADAMW, run_ranks

pytestmark = pytest.mark.timeout(420)
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (after the importorskip)

CASES = [(1, None), (2, None), (3, None), (1, torch.bfloat16), (3, torch.bfloat16), (3, "bf16-offloaded")]
"""(stage, compute dtype): "bf16-offloaded" is bf16 with the parameter shards and optimizer states on the cpu tier."""
STEPS = 5


def _gpt2():
    t = transformers
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False))


def _dtype(dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == "bf16-offloaded" else dtype or torch.float32


def _batch(g: torch.Generator, rank: int) -> torch.Tensor:
    ids = torch.randint(0, 256, (4, 16), generator=g)
    return ids[2 * rank : 2 * rank + 2]


def _case(rank: int, stage: int, dtype, root: str) -> dict:
    model = _gpt2()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    offload = fxzero.Offload(params=fxzero.Cpu(), optimizer=fxzero.Cpu()) if dtype == "bf16-offloaded" else fxzero.Offload()
    mp = fxzero.MixedPrecision(param_dtype=_dtype(dtype)) if dtype is not None else None
    engine = fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.AdamW(**ADAMW), cost_model=None,
                                                 mixed_precision=mp, offload=offload))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = _batch(g, rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    out: dict = {"initial": initial}
    out["state_dict"] = model.state_dict()
    out["engine_module_is_model"] = engine.module is model
    out["block"] = model.transformer.h[1].state_dict()  # a submodule's own call
    out["masters"] = engine.full_state_dict()
    out["weight"] = (model.transformer.wte.weight.shape, model.transformer.wte.weight.dtype,
                     model.transformer.wte.weight.is_meta)
    pretrained = os.path.join(root, f"pretrained-{stage}-{dtype}")
    model.save_pretrained(pretrained, is_main_process=rank == 0)
    engine.save_checkpoint(os.path.join(root, f"ckpt-{stage}-{dtype}"))
    ids = _batch(g, rank)
    with torch.no_grad():  # (at ZeRO-3: each unit gathered for its module's call, as DeepSpeed's hooks do)
        out["direct"] = model(input_ids=ids).logits
    out["placeholders_after"] = model.transformer.h[0].mlp.c_fc.weight.is_meta
    # Hugging Face's generate calls the model directly under no_grad (DeepSpeed-Chat's PPO generates
    # so from its actor); at ZeRO-3 every rank steps until all are done (synced_gpus), as under DeepSpeed
    out["generated"] = model.generate(input_ids=ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0,
                                      synced_gpus=stage == 3)
    out["prompt"] = ids[:, :4]
    out["engine"] = engine(input_ids=ids).logits
    if stage == 3:
        logits = model(input_ids=ids).logits  # (with gradients: the units stay whole until the backward)
        out["direct_grad"] = logits.detach()
        out["held_after_call"] = not model.transformer.h[0].mlp.c_fc.weight.is_meta
        engine.backward(logits.float().pow(2).mean())  # (its gradients carried into the shards, the units released)
        with torch.no_grad():
            out["direct_again"] = model(input_ids=ids).logits
        out["placeholders_again"] = model.transformer.h[0].mlp.c_fc.weight.is_meta
    if stage == 3:
        # A state_dict() on one rank while the other runs a forward: both raise, neither hangs.
        try:
            model.state_dict() if rank == 0 else engine(input_ids=ids)
        except RuntimeError as e:
            out["lone_error"] = str(e)
    return out


def _job(rank: int, world_size: int, root: str) -> list[dict]:
    return [_case(rank, stage, dtype, root) for stage, dtype in CASES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("user_module"))
    return root, run_ranks(_job, 2, root, timeout_s=400)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"stage{s}-{d or 'fp32'}" for s, d in CASES])
def test_the_users_model_holds_the_trained_weights(runs, case):
    root, ranks = runs
    stage, dtype = CASES[case]
    compute = _dtype(dtype)
    for rank, result in enumerate(ranks):
        r = result[case]
        want = {k: v.to(compute) for k, v in r["masters"].items()}
        got = r["state_dict"]
        assert list(got) == list(r["initial"]), "the state dict's keys are the model's, in its order"
        for k, v in want.items():
            assert got[k].dtype == compute and torch.equal(got[k], v), f"rank {rank}: {k} is not the trained value"
        trained = [k for k in r["initial"] if not torch.equal(r["initial"][k].to(compute), got[k])]
        assert len(trained) > len(got) // 2, "training changed the weights (the state dict is not the initial one)"
        for k, v in r["block"].items():
            assert torch.equal(v, want[f"transformer.h.1.{k}"]), f"submodule state_dict: {k}"
        assert r["engine_module_is_model"]
        shape, held_dtype, is_meta = r["weight"]
        assert shape == torch.Size([256, 64]) and held_dtype == compute and is_meta == (stage == 3)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"stage{s}-{d or 'fp32'}" for s, d in CASES])
def test_save_pretrained_writes_the_trained_weights_as_fxzero_export_does(runs, case, tmp_path):
    root, ranks = runs
    stage, dtype = CASES[case]
    saved = load_file(os.path.join(root, f"pretrained-{stage}-{dtype}", "model.safetensors"))
    export_checkpoint(os.path.join(root, f"ckpt-{stage}-{dtype}"), str(tmp_path),
                      dtype=_dtype(dtype) if dtype is not None else None)
    exported = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(saved) == set(exported)
    for k in exported:
        assert saved[k].dtype == exported[k].dtype and torch.equal(saved[k], exported[k]), k
    loaded = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(root, f"pretrained-{stage}-{dtype}"))
    masters = ranks[0][case]["masters"]
    assert torch.equal(loaded.transformer.h[0].mlp.c_fc.weight, masters["transformer.h.0.mlp.c_fc.weight"].to(
        _dtype(dtype)))


def test_direct_calls_use_the_trained_weights_at_every_stage(runs):
    """Called directly under no_grad the module computes with the trained weights, as the engine
    does; at ZeRO-3 each unit is gathered for its module's call and is a placeholder again after
    ([Note: calling a ZeRO-3 model directly]); with gradients enabled the units stay whole until
    the backward, which carries their gradients into the shards and releases them."""
    _, ranks = runs
    for case, (stage, dtype) in enumerate(CASES):
        for rank, result in enumerate(ranks):
            r = result[case]
            tol = dict(rtol=0, atol=0) if dtype is None else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(r["direct"].to(torch.float32), r["engine"].to(torch.float32), **tol)
            assert r["placeholders_after"] == (stage == 3)
            if dtype is None:  # (the trained fp32 weights in an eager model generate the same tokens)
                eager = _gpt2()
                eager.load_state_dict(ranks[0][case]["masters"])
                want = eager.generate(input_ids=r["prompt"], max_new_tokens=3, do_sample=False, pad_token_id=0)
                assert torch.equal(r["generated"], want), (stage, rank)
            if stage == 3:
                assert torch.equal(r["direct_grad"], r["direct"]) and r["held_after_call"]
                assert torch.equal(r["direct_again"], r["direct"]) and r["placeholders_again"]


def test_a_state_dict_on_one_rank_alone_is_an_error_on_every_rank(runs):
    _, ranks = runs
    for case, (stage, _) in enumerate(CASES):
        if stage != 3:
            continue
        for rank, result in enumerate(ranks):
            message = result[case]["lone_error"]
            assert message.startswith(f"[rank {rank}]") and "would issue different collectives" in message
            assert "model.state_dict(): all_gather of" in message and "call it on every rank" in message


def _converted_mid_training(rank: int, world_size: int) -> dict:
    import warnings

    import torch.nn as nn

    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        engine = fxzero.compile(net, fxzero.Config(stage=stage, cost_model=None, optimizer=fxzero.SGD(lr=0.1)))
        x = torch.ones(2, 4)
        for _ in range(2):
            engine.backward(engine(x).sum())
            engine.step()
        net.to(torch.float64)  # (the user's module converted in the middle of training)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                engine.backward(engine(x).sum())
                engine.step()
        state, full = net.state_dict(), engine.full_state_dict()
        out[stage] = (all(torch.equal(state[k], full[k]) for k in full),
                      sum("parameters were replaced after compile" in str(w.message) for w in seen))
    return out


def test_a_model_converted_in_the_middle_of_training_holds_the_trained_values_again():
    """Before, at ZeRO-1/2 `model.to(dtype)` after compile left the module with converted copies of
    that moment, and every later state_dict() (save_pretrained's file) was that stale model, 0.4 off
    the trained one in the case here, silently; now the next step points it back at the trained
    values, and says so once."""
    for r in run_ranks(_converted_mid_training, 2, timeout_s=240):
        assert r[1] == (True, 1) and r[2] == (True, 1)
        assert r[3][0]  # (ZeRO-3: placeholders, gathered by state_dict())

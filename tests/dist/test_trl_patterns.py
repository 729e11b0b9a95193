"""What TRL's trainers ask of DeepSpeed at ZeRO-3, written the way TRL writes it, on 2 ranks
against eager PyTorch computed here.

- TRL's fused LM-head loss (`trl/trainer/utils.py`: `maybe_gather_lm_head_ctx` around a custom
  autograd Function that computes its gradient's factors in the forward): the forward reads
  `p.ds_status` and gathers with `GatheredParameters` unless the parameter is AVAILABLE. Traced,
  every parameter is whole where used, so the stand-ins say AVAILABLE ([Note: the DeepSpeed
  attributes of a parameter]); before, reading the attribute failed on the trace's tensors.
- TRL's generation at ZeRO-3 (`unwrap_model_for_generation`): `GatheredParameters(model.parameters())`,
  then `remove_hooks` (each parameter's `ds_active_sub_modules`, `module.ds_external_parameters()`,
  `optimizer.parameter_offload.forward_hooks` / `backward_hooks` removed and emptied), a direct
  call, then `add_hooks` (`param_coordinator`, `_register_deepspeed_module`) ([Note: DeepSpeed's
  parameter_offload] in `fxzero/runtime/parameter_offload.py`).
- In bf16, the gathered block TRL generates in holds the values the model computes with (DeepSpeed's
  parameters are bf16), where it held the fp32 masters: twice the memory of the whole model, and
  other tokens than DeepSpeed's model samples; a block that writes still gets the fp32 masters.
- `hash_module` before `initialize` (TRL's DPO with `precompute_ref_log_probs`): `state_dict()` of
  a model built under `zero.Init` on a rank that does not hold it ([Note: a state_dict() before
  initialize] in `fxzero/zero.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
import fxzero.zero
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

HP = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
STEPS = 3
VOCAB, HIDDEN = 12, 8


class _ChunkedLogProb(torch.autograd.Function):
    """Each token's log-probability of its label, computed in chunks; the factors of its
    gradient are made in the forward (as TRL's `_ChunkedLogProbFunction` does)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out, factors = [], []
        for h, y in zip(hidden.split(4), labels.split(4)):
            logp = torch.log_softmax(h @ weight.t(), dim=-1)
            out.append(logp.gather(-1, y[:, None])[:, 0])
            factors.append(F.one_hot(y, weight.shape[0]).to(h.dtype) - logp.exp())
        ctx.save_for_backward(hidden, weight, torch.cat(factors))
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, factor = ctx.saved_tensors
        scaled = grad[:, None] * factor
        return scaled @ weight, scaled.t() @ hidden, None


def _maybe_gather(zero3: bool, *params: torch.Tensor):
    """TRL's `maybe_gather_lm_head_ctx`, in our words: at ZeRO-3 (transformers'
    `is_deepspeed_zero3_enabled()`), gather what is not AVAILABLE."""
    if not zero3:
        return contextlib.nullcontext()
    to_gather = [p for p in params if p.ds_status != fxzero.zero.ZeroParamStatus.AVAILABLE]
    return fxzero.zero.GatheredParameters(to_gather) if to_gather else contextlib.nullcontext()


class FusedHeadLM(nn.Module):
    def __init__(self, zero3: bool = False) -> None:
        super().__init__()
        self.zero3 = zero3
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def backbone(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.emb(ids)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(ids)[:, :-1].reshape(-1, HIDDEN)
        with _maybe_gather(self.zero3, self.lm_head.weight):
            per_token = _ChunkedLogProb.apply(hidden, self.lm_head.weight, ids[:, 1:].reshape(-1))
        return -per_token.mean()


def _model(zero3: bool = False) -> FusedHeadLM:
    torch.manual_seed(0)
    return FusedHeadLM(zero3)


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randint(0, VOCAB, (2, 5), generator=g) for _ in range(STEPS)]


def _remove_hooks(engine) -> None:
    """TRL's `remove_hooks`, in our words."""
    offload = engine.optimizer.parameter_offload
    for _, p in itertools.chain(offload.module.named_parameters(), offload.module.ds_external_parameters()):
        p.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _add_hooks(engine) -> None:
    """TRL's `add_hooks`, in our words."""
    offload = engine.optimizer.parameter_offload
    if not offload.param_coordinator.is_invalid_trace():
        offload.param_coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = _model(zero3=True)
    probe = torch.tensor([[1, 2, 3]])
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(**HP), cost_model=None,
                                                 persist_threshold=0))
    losses, generated = [], []
    for i, ids in enumerate(_batches(rank)):
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if i == 0:  # TRL's generation between steps: gathered, its hooks removed, then put back
            with fxzero.zero.GatheredParameters(model.parameters()):
                _remove_hooks(engine)
                with torch.no_grad():
                    generated.append(model.backbone(probe).clone())
                _add_hooks(engine)
            with torch.no_grad():  # the hooks are back: a direct call gathers again
                generated.append(model.backbone(probe).clone())
    _remove_hooks(engine)
    with torch.no_grad():
        without_hooks = model.backbone(probe).device.type  # (computed from placeholders: no values)
    _add_hooks(engine)
    out["fused"] = {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()},
                    "generated": generated, "without_hooks": without_hooks,
                    "hooks": len(engine.optimizer.parameter_offload.forward_hooks)}

    # bf16: a reading GatheredParameters gives the values the model computes with, as DeepSpeed's (TRL
    # generates inside one: the direct call's tokens); a modifying one the fp32 masters, written exactly
    model = _model(zero3=True)
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(**HP), cost_model=None,
                                                 persist_threshold=0,
                                                 mixed_precision=fxzero.MixedPrecision(param_dtype=torch.bfloat16)))
    engine.backward(engine(_batches(rank)[0]))
    engine.step()
    with fxzero.zero.GatheredParameters(model.parameters()):
        reading = {"dtype": model.lm_head.weight.dtype, "out": model.backbone(probe).detach().clone()}
    with torch.no_grad():
        called = model.backbone(probe).clone()
    master = engine.full_state_dict()["lm_head.weight"].clone()
    with fxzero.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        writing = model.lm_head.weight.dtype
        if rank == 0:
            with torch.no_grad():
                model.lm_head.weight.add_(0.001)
    out["bf16"] = {"reading": reading, "called": called, "writing": writing,
                   "master": master, "written": engine.full_state_dict()["lm_head.weight"].clone()}

    # state_dict() before initialize, of a model built under zero.Init (TRL's hash_module)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    with fxzero.zero.Init(config_dict_or_path=config):
        built = FusedHeadLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before_gather = {k: (tuple(v.shape), v.device.type) for k, v in built.state_dict().items()}
        with fxzero.zero.GatheredParameters(list(built.parameters()), modifier_rank=0):
            pass  # (from_pretrained's loading makes rank 0 the holder so)
        held = {k: (tuple(v.shape), v.device.type) for k, v in built.state_dict().items()}
        kept = {k: v is built.get_parameter(k) for k, v in built.state_dict(keep_vars=True).items()}
    engine2, *_ = fxzero.initialize(model=built, config=config)
    after = {k: v.clone() for k, v in built.state_dict().items()}
    out["init"] = {"before_gather": before_gather, "held": held, "kept": kept, "after": after,
                   "warnings": [str(w.message) for w in caught if "state_dict()" in str(w.message)]}
    return out


def _reference() -> dict:
    """Eager: each step the mean of the ranks' gradients, torch's AdamW."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses = {0: [], 1: []}
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            model.zero_grad()
            loss = model(_batches(rank)[step])
            loss.backward()
            losses[rank].append(loss.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for n, p in model.named_parameters():
            p.grad = (grads[0][n] + grads[1][n]) / 2
        opt.step()
    return {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, world_size=2)


def test_the_fused_head_loss_gathers_nothing_in_the_trace_and_trains_as_eager(results) -> None:
    ref = _reference()
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["fused"]["losses"], ref["losses"][rank], rtol=1e-6, atol=1e-7)
        for k, v in ref["params"].items():
            torch.testing.assert_close(res["fused"]["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_generation_with_the_hooks_removed_and_put_back_as_trl_does(results) -> None:
    for res in results:
        inside, after = res["fused"]["generated"]
        torch.testing.assert_close(inside, after)  # (fp32: the gathered masters are the values)
        assert res["fused"]["without_hooks"] == "meta"  # without the hooks: placeholders, no values
        assert res["fused"]["hooks"] > 0
    torch.testing.assert_close(results[0]["fused"]["generated"], results[1]["fused"]["generated"])


def test_state_dict_before_initialize_is_empty_where_a_rank_does_not_hold_the_model(results) -> None:
    for rank, res in enumerate(results):
        init = res["init"]
        # before the first gather no rank has values: empty on every rank, as DeepSpeed's, and said nowhere
        assert all(shape == (0,) and device == "cpu" for shape, device in init["before_gather"].values())
        if rank == 0:  # the holder: its values
            assert init["held"]["lm_head.weight"] == ((VOCAB, HIDDEN), "cpu")
            assert not init["warnings"]
        else:
            assert all(shape == (0,) for shape, _ in init["held"].values())
            assert len(init["warnings"]) == 1 and "rank 0 holds it whole" in init["warnings"][0]
        assert all(init["kept"].values())  # keep_vars: the parameters themselves
    for k, v in results[0]["init"]["after"].items():  # after initialize: the model's values on every rank
        assert v.shape == results[0]["init"]["held"][k][0]
        torch.testing.assert_close(results[1]["init"]["after"][k], v, rtol=0, atol=0)


def test_a_reading_gather_gives_the_compute_dtype_and_a_writing_one_the_fp32_masters(results) -> None:
    for res in results:
        bf16 = res["bf16"]
        assert bf16["reading"]["dtype"] == torch.bfloat16 and bf16["writing"] == torch.float32
        torch.testing.assert_close(bf16["reading"]["out"], bf16["called"], rtol=0, atol=0)  # (what generation gets)
        assert bf16["called"].dtype == torch.bfloat16
        # rank 0's write, in fp32, reached every rank's masters exactly
        torch.testing.assert_close(bf16["written"], results[0]["bf16"]["master"] + 0.001, rtol=0, atol=0)

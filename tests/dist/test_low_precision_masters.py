"""bfloat16 masters and optimizer states on 2 ranks (`MixedPrecision(master_dtype=torch.bfloat16)`,
DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states): each rank's losses, masters
and optimizer states equal to the eager references of `low_precision_reference.py` bit for bit at
ZeRO-1, 2 and 3 (bf16 states; fp32 states with an accumulation of two micro-steps), the model
states each rank holds, and a checkpoint saved and resumed. (A world of one:
tests/passes/test_low_precision_masters.py.)
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import fxzero
from fxzero import estimate, zoo
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.low_precision_reference import eager_bf16_masters
from tests.dist.reference import clone_state_dict, lm_loss, make_gpt_batches, rank_slice

pytestmark = pytest.mark.timeout(600)

WORLD = 2
BF16 = torch.bfloat16
RUNS = {"bf16-states": (BF16, 1, 3), "fp32-states-accumulated": (torch.float32, 2, 2)}
"""name -> (optimizer states' dtype, micro-steps per step, optimizer steps)."""


@functools.cache
def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return clone_state_dict(zoo.build("gpt-tiny"))


def _batches(accumulation: int, steps: int):
    return make_gpt_batches(zoo.GPT_SIZES["tiny"], accumulation * steps, 8, seed=17)


def _engine(stage: int, states: torch.dtype, accumulation: int = 1) -> fxzero.Engine:
    mp = fxzero.MixedPrecision(param_dtype=BF16, reduce_dtype=None, master_dtype=BF16, optimizer_dtype=states)
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    return fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.AdamW(**ADAMW), cost_model=None,
                                               mixed_precision=mp, gradient_accumulation_steps=accumulation),
                          state_dict=_initial())


def _train(engine, batches, rank: int) -> list[float]:
    """Each micro-step's loss, averaged over the ranks."""
    losses = []
    for x, y in batches:
        loss = lm_loss(engine(rank_slice(x, rank, WORLD)), rank_slice(y, rank, WORLD))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().reshape(1))
    mean = torch.cat(losses)
    torch.distributed.all_reduce(mean)
    return (mean / WORLD).tolist()


def _states(engine) -> dict[str, dict[str, torch.Tensor]]:
    return {fqn: {k: fxzero.utils.safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
            for fqn, p in engine.module.named_parameters()}


def _run(rank: int, world: int, stage: int, ckpt: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (states, accumulation, steps) in RUNS.items():
        engine = _engine(stage, states, accumulation)
        losses = _train(engine, _batches(accumulation, steps), rank)
        x, y = _batches(1, 1)[0]
        engine.backward(lm_loss(engine(rank_slice(x, rank, WORLD)), rank_slice(y, rank, WORLD)))
        held = engine.memory_report()["model_states"]  # gradients held, optimizer states made
        want = estimate.runtime_model_states(engine.layouts, stage, "mixed", persistent=engine.state.whole,
                                             mixed_precision=engine.config.mixed_precision).total
        engine.zero_grad()
        out[name] = {"losses": losses, "state": engine.full_state_dict(), "module": engine.module.state_dict(),
                     "states": _states(engine), "model_states": held, "estimate": want}
    if stage == 3:  # a checkpoint: saved after two steps, resumed by a new engine, equal to going on
        batches = _batches(1, 4)
        engine = _engine(3, BF16)
        _train(engine, batches[:2], rank)
        engine.save_checkpoint(ckpt, tag="two")
        going_on = _train(engine, batches[2:], rank)
        resumed = _engine(3, BF16)
        resumed.load_checkpoint(ckpt, tag="two")
        out["resume"] = {"going_on": going_on, "resumed": _train(resumed, batches[2:], rank),
                         "equal": all(torch.equal(a, b) for a, b in zip(engine.full_state_dict().values(),
                                                                         resumed.full_state_dict().values()))}
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_on_two_ranks(stage, tmp_path):
    results = run_ranks(_run, WORLD, stage, str(tmp_path))
    for name, (states, accumulation, steps) in RUNS.items():
        losses, want, want_states = eager_bf16_masters(lambda: zoo.build("gpt-tiny"), _initial(),
                                                       _batches(accumulation, steps), WORLD, states, accumulation,
                                                       threads=1)  # (the ranks': tests/dist/harness.py)
        for rank, result in enumerate(results):
            got = result[name]
            assert got["losses"] == losses, (name, rank)
            for what in ("state", "module"):  # the masters, and the user's module
                assert {k: v.dtype for k, v in got[what].items()} == {k: BF16 for k in want}, (name, what)
                assert all(torch.equal(got[what][k], v) for k, v in want.items()), (name, rank, what)
            for fqn, kinds in want_states.items():
                for kind, value in kinds.items():
                    assert got["states"][fqn][kind].dtype == states and torch.equal(got["states"][fqn][kind], value)
            assert got["model_states"] == got["estimate"], (name, rank)
    if stage == 3:
        numel = sum(v.numel() for v in zoo.build("gpt-tiny").parameters())
        bf16_states = results[0]["bf16-states"]["model_states"]
        assert numel * 8 / WORLD <= bf16_states <= numel * 8 / WORLD * 1.01  # 2 + 2 + 4 bytes, sharded (padding)
        for result in results:
            assert result["resume"]["resumed"] == result["resume"]["going_on"] and result["resume"]["equal"]

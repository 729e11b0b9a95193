"""Gradient hooks the user registers on parameters (`p.register_hook(fn)`) run in the engine's
backward, on 2 ranks, as in eager PyTorch ([Note: gradient hooks on parameters] in
`fxzero/trace.py`).

Before, the trace ran the model on stand-ins for the parameters, so hooks registered on the
parameters themselves never ran: an embedding whose hook masks the gradient to train only its new
token rows trained every row, without a word. The reference is eager PyTorch with the same hooks
(torch.optim.AdamW, the global batch in one process).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxzero
from tests.dist.harness import run_ranks
from tests.dist.reference import assert_state_close, eager_data_parallel
from tests.dist.test_module_writes import WORLD, _batch, _net

pytestmark = pytest.mark.timeout(300)

STEPS = 4
NEW_ROWS = 12
"""The hooked embedding trains rows NEW_ROWS.. only (new tokens); the others stay as loaded."""


def _hook_rows(grad: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(grad.shape[0], 1, dtype=grad.dtype, device=grad.device)
    mask[NEW_ROWS:] = 1
    return grad * mask


def _halve_in_place(grad: torch.Tensor) -> None:
    grad.mul_(0.5)  # (returns None: torch takes the gradient changed in place)


def _hooks(model: nn.Module, step: int) -> None:
    """The hooks in place before `step`: the mask from the start; the head's weight halved from
    step 2 (the engine traces again), that hook removed before step 3."""
    if step == 0:
        model.emb.weight.register_hook(_hook_rows)
    if step == 2:
        model._halving = model.head.weight.register_hook(_halve_in_place)
    if step == 3:
        model._halving.remove()


def _eager() -> dict[str, torch.Tensor]:
    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # (masked rows stay put)
    return eager_data_parallel(model, opt, _batch, STEPS, WORLD, _hooks)[1]


CASES = {
    "stage1": dict(stage=1),
    "stage3": dict(stage=3),
    "stage3-recompute-nvme-accumulation": dict(stage=3, activations=fxzero.Activations(recompute="unit"),
                                               offload="nvme", gradient_accumulation_steps=2),
    "stage2-bf16": dict(stage=2, mixed_precision=fxzero.MixedPrecision()),
}


def _run(rank: int, world_size: int, case: str, where: str) -> dict:
    options = dict(CASES[case])
    if options.pop("offload", None):
        options["offload"] = fxzero.Offload(params=fxzero.Nvme(path=where), optimizer=fxzero.Nvme(path=where))
    accumulation = options.get("gradient_accumulation_steps", 1)
    model = _net(0)
    engine = fxzero.compile(model, fxzero.Config(optimizer=fxzero.AdamW(lr=1e-2, weight_decay=0.0), cost_model=None,
                                                 **options))
    for step in range(STEPS):
        _hooks(model, step)
        ids, y = _batch(step, rank)
        for part in range(accumulation):  # (the micro-batch split in halves: the same mean, accumulated)
            rows = slice(part * len(ids) // accumulation, (part + 1) * len(ids) // accumulation)
            engine.backward(engine(ids[rows], y[rows]))
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_hooks_change_the_gradients_as_in_eager_pytorch(case, tmp_path):
    initial, want = _net(0).state_dict(), _eager()
    for rank, got in enumerate(run_ranks(_run, WORLD, case, str(tmp_path), timeout_s=240)):
        rows = got["emb.weight"][:NEW_ROWS]
        assert torch.equal(rows, initial["emb.weight"][:NEW_ROWS]), rank  # (masked: never moved)
        assert not torch.equal(got["emb.weight"][NEW_ROWS:], initial["emb.weight"][NEW_ROWS:])
        if "bf16" not in case:
            assert_state_close(got, want, f"rank {rank}", atol=1e-5)


def _post_accumulate_run(rank: int, world_size: int) -> str:
    model = _net(0)
    model.head.weight.register_post_accumulate_grad_hook(lambda p: None)
    try:
        fxzero.compile(model, fxzero.Config(stage=1, cost_model=None))(*_batch(0, rank))
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_post_accumulate_grad_hook_is_refused_by_name():
    message = run_ranks(_post_accumulate_run, 1, timeout_s=120)[0]
    assert "head.weight" in message and "register_post_accumulate_grad_hook" in message, message

"""The update of one unit's shard: AdamW, Adam and Adagrad with the arithmetic of torch.optim's
single-tensor paths, per parameter group.

Each optimizer policy declares the states it keeps per element ([Note: optimizer states] in
`fxzero/config/policies.py`); `optim_step` takes them as a list in that order, wherever they
live (the device, or buffers fetched from a tier), and runs the policy's arithmetic on them.

A unit's shard may hold parameters of several groups (say, a block's weights with weight decay
and its norms and biases without): `UnitLayout.grouped_shard_ranges` cuts the shard into element ranges that each
belong to one group, and the update reads that group's hyperparameters (AdamW: lr, betas, eps,
weight_decay; Adagrad: lr, lr_decay, eps, weight_decay) from the optimizer's `param_groups` at
every step, so an LR schedule that writes `param_groups[i]["lr"]` drives the sharded step.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch

from fxzero.config import Adagrad, Adam, AdamW, OptimizerPolicy

__all__ = ["optim_step"]


@torch.no_grad()
def optim_step(policy: OptimizerPolicy, param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
               step: int, groups: list[dict], ranges: list[tuple[int, int, int]]) -> None:
    """One update of flat `param` in place, with `policy`'s arithmetic.

    Args:
        states: the policy's states for this shard (`policy.states`, in that order), in place.
        step: this update's count, from 1 (Adam's bias correction, Adagrad's lr decay).
        groups: the optimizer's param_groups (each with the policy's `HYPERPARAMETERS`).
        ranges: (lo, hi, group) element ranges to update; elements outside (parameters that got
            no gradient, padding) are left untouched, as torch.optim skips a parameter whose
            .grad is None.
    """
    assert len(states) == len(policy.states), (type(policy).__name__, len(states))
    update = _arithmetic(policy)
    for lo, hi, g in ranges:
        update(param[lo:hi], grad[lo:hi], [s[lo:hi] for s in states], step, groups[g])


_Arithmetic = Callable[[torch.Tensor, torch.Tensor, list, int, dict], None]
"""(param, grad, states, step, group hyperparameters): one range of a shard, in place."""


def _arithmetic(policy: OptimizerPolicy) -> _Arithmetic:
    if isinstance(policy, AdamW):  # Adam too: L2 weight decay instead of decoupled
        return functools.partial(_adam, decoupled=not isinstance(policy, Adam))
    if isinstance(policy, Adagrad):
        return _adagrad
    raise TypeError(f"no update for optimizer {type(policy).__name__}")


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A reused buffer for the denominator: a fresh one per unit would cost a page fault per
    4 KiB on every step (the allocator unmaps large blocks when they are freed)."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view_as(like)


def _adam(param, grad, states, step: int, hp: dict, decoupled: bool) -> None:
    exp_avg, exp_avg_sq = states
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    if decoupled:
        param.mul_(1 - lr * wd)
    elif wd:
        grad = grad.add(param, alpha=wd)  # torch.optim.Adam: L2 on the gradient
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    # (sqrt(v) / sqrt(bc2)) + eps, the same operations as torch.optim.AdamW, in one buffer.
    denom = torch.sqrt(exp_avg_sq, out=_scratch(exp_avg_sq)).div_(math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _adagrad(param, grad, states, step: int, hp: dict) -> None:
    (state_sum,) = states
    lr, lr_decay, eps, wd = hp["lr"], hp["lr_decay"], hp["eps"], hp["weight_decay"]
    if wd != 0:
        grad = grad.add(param, alpha=wd)  # torch.optim.Adagrad: L2 on the gradient
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum.addcmul_(grad, grad, value=1)
    # sqrt(sum) + eps, the same operations as torch.optim.Adagrad, in one buffer.
    std = torch.sqrt(state_sum, out=_scratch(state_sum)).add_(eps)
    param.addcdiv_(grad, std, value=-clr)

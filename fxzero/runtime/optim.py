"""The update of one unit's shard, per parameter group: AdamW, Adam, Adagrad and Lion written
here, every other optimizer policy by torch's own single-tensor update on the shard's ranges
(`fxzero/runtime/torch_updates.py`, [Note: torch's arithmetic on a shard]).

Each optimizer policy declares the states it keeps per element ([Note: optimizer states] in
`fxzero/config/policies.py`); `optim_step` takes them as a list in that order, wherever they
live (the device, or buffers fetched from a tier), and runs the policy's arithmetic on them.
AdamW, Adam and Adagrad are written here, with torch.optim's single-tensor operations in the same
order (so the same bits), because they are the ones people train large models with: their
temporaries go in one reused buffer rather than a fresh allocation per unit and step. Lion has
no torch implementation to call.

A unit's shard may hold parameters of several groups (say, a block's weights with weight decay
and its norms and biases without): `UnitLayout.grouped_shard_ranges` cuts the shard into element ranges that each
belong to one group, and the update reads that group's hyperparameters (the policy's
`HYPERPARAMETERS`) from the optimizer's `param_groups` at every step, so an LR schedule that
writes `param_groups[i]["lr"]` (or a momentum schedule, `betas`) drives the sharded step.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from fxzero.config import Adagrad, Adam, AdamW, Lion, OptimizerPolicy
from fxzero.runtime.torch_updates import has_torch_update, torch_update

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

    Raises:
        RuntimeError: a param group's options (set by a schedule, say) need a state the policy
            does not keep.
    """
    names = policy.states
    assert len(states) == len(names), (type(policy).__name__, len(states))
    for g in sorted({g for _, _, g in ranges}):
        try:
            policy.check_group(groups[g], f"param group {g}")
        except ValueError as e:
            raise RuntimeError(f"[rank {_rank()}] {e}") from None
    update = _arithmetic(policy)
    for lo, hi, g in ranges:
        update(policy, param[lo:hi], grad[lo:hi], {n: s[lo:hi] for n, s in zip(names, states)}, step, groups[g])


_Arithmetic = Callable[[OptimizerPolicy, torch.Tensor, torch.Tensor, dict, int, dict], None]
"""(policy, param, grad, states by name, step, group hyperparameters): one range of a shard, in place."""


def _arithmetic(policy: OptimizerPolicy) -> _Arithmetic:
    if isinstance(policy, AdamW) and not policy.amsgrad:  # Adam too: L2 weight decay instead of decoupled
        return _adam
    if isinstance(policy, Adagrad):
        return _adagrad
    if isinstance(policy, Lion):
        return _lion
    if has_torch_update(policy):
        return torch_update
    raise TypeError(f"no update for optimizer {type(policy).__name__}")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A reused buffer for the denominator: a fresh one per unit would cost a page fault per
    4 KiB on every step (the allocator unmaps large blocks when they are freed)."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view_as(like)


def _adam(policy, param, grad, states, step: int, hp: dict) -> None:
    exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    if not isinstance(policy, Adam):  # AdamW: decoupled weight decay
        param.mul_(1 - lr * wd)
    elif wd:
        grad = grad.add(param, alpha=wd)  # torch.optim.Adam: L2 on the gradient
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # (Without bias correction, DeepSpeed's FusedAdam(bias_correction=False): both factors are 1.)
    bias_correction1 = 1 - beta1**step if policy.bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if policy.bias_correction else 1.0
    step_size = lr / bias_correction1
    # (sqrt(v) / sqrt(bc2)) + eps, the same operations as torch.optim.AdamW, in one buffer.
    denom = torch.sqrt(exp_avg_sq, out=_scratch(exp_avg_sq)).div_(math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _adagrad(policy, param, grad, states, step: int, hp: dict) -> None:
    state_sum = states["sum"]
    lr, lr_decay, eps, wd = hp["lr"], hp["lr_decay"], hp["eps"], hp["weight_decay"]
    if wd != 0:
        grad = grad.add(param, alpha=wd)  # torch.optim.Adagrad: L2 on the gradient
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum.addcmul_(grad, grad, value=1)
    # sqrt(sum) + eps, the same operations as torch.optim.Adagrad, in one buffer.
    std = torch.sqrt(state_sum, out=_scratch(state_sum)).add_(eps)
    param.addcdiv_(grad, std, value=-clr)


def _lion(policy, param, grad, states, step: int, hp: dict) -> None:
    """Lion's update (`fxzero.Lion`): the sign of the interpolation of momentum and gradient,
    decoupled weight decay, then the momentum's own running average."""
    exp_avg = states["exp_avg"]
    lr, (beta1, beta2), wd = hp["lr"], hp["betas"], hp["weight_decay"]
    direction = torch.mul(exp_avg, beta1, out=_scratch(exp_avg)).add_(grad, alpha=1 - beta1).sign_()
    if wd:
        param.mul_(1 - lr * wd)
    param.add_(direction, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)

"""The update of one unit's shard: AdamW and Adam with the arithmetic of torch.optim's
single-tensor paths, per parameter group.

A unit's shard may hold parameters of several groups (say, a block's weights with weight decay
and its norms and biases without): `group_ranges` cuts the shard into element ranges that each
belong to one group, and the update reads that group's hyperparameters (lr, betas, eps,
weight_decay) from the optimizer's `param_groups` at every step, so an LR schedule that writes
`param_groups[i]["lr"]` drives the sharded step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch

from fxzero.ir.layout import UnitLayout

__all__ = ["AdamWState", "adamw_step", "group_ranges"]


@dataclasses.dataclass
class AdamWState:
    """One unit's optimizer state, for this rank's shard only."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


def group_ranges(layout: UnitLayout, rank: int, group_of: Mapping[str, int],
                 skip: frozenset[str] = frozenset()) -> list[tuple[int, int, int]]:
    """(lo, hi, group) element ranges of rank's shard, relative to it, covered by the unit's
    parameters not in `skip` (padding never), adjacent ranges of one group merged."""
    lo, hi = layout.shard_range(rank)
    out: list[tuple[int, int, int]] = []
    for s in layout.slots:
        if s.fqn in skip:
            continue
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a >= b:
            continue
        g = group_of.get(s.fqn, 0)
        if out and out[-1][1] == a - lo and out[-1][2] == g:
            out[-1] = (out[-1][0], b - lo, g)
        else:
            out.append((a - lo, b - lo, g))
    return out


@torch.no_grad()
def adamw_step(param: torch.Tensor, grad: torch.Tensor, state: AdamWState, groups: list[dict],
               ranges: list[tuple[int, int, int]], *, decoupled: bool = True) -> None:
    """One AdamW (or, `decoupled=False`, Adam with L2 weight decay) update of flat `param` in place.

    Args:
        groups: the optimizer's param_groups (each: lr, betas, eps, weight_decay).
        ranges: (lo, hi, group) element ranges to update; elements outside (parameters that got
            no gradient, padding) are left untouched, as torch.optim skips a parameter whose
            .grad is None.
    """
    state.step += 1
    for lo, hi, g in ranges:
        _update(param[lo:hi], grad[lo:hi], state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi], state.step, groups[g],
                decoupled)


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A reused buffer for the denominator: a fresh one per unit would cost a page fault per
    4 KiB on every step (the allocator unmaps large blocks when they are freed)."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view_as(like)


def _update(param, grad, exp_avg, exp_avg_sq, step: int, hp: dict, decoupled: bool) -> None:
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



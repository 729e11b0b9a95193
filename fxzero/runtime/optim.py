"""AdamW on flat shards, with the arithmetic of `torch.optim.AdamW` (single-tensor path)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from fxzero.config import AdamW

__all__ = ["AdamWState", "adamw_step"]


@dataclasses.dataclass
class AdamWState:
    """One unit's optimizer state, for this rank's shard only."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0

    @classmethod
    def zeros_like(cls, shard: torch.Tensor) -> "AdamWState":
        return cls(torch.zeros_like(shard), torch.zeros_like(shard))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.exp_avg, self.exp_avg_sq))


@torch.no_grad()
def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: AdamWState,
    cfg: AdamW,
    ranges: Optional[list[tuple[int, int]]] = None,
) -> None:
    """One AdamW update of flat `param` in place (decoupled weight decay, bias-corrected moments).

    Args:
        ranges: [lo, hi) element ranges to update; elements outside (parameters that got no
            gradient, padding) are left untouched, as torch.optim skips a parameter whose
            .grad is None. None means the whole shard.
    """
    state.step += 1
    if ranges is None:
        ranges = [(0, param.numel())]
    for lo, hi in ranges:
        _update(param[lo:hi], grad[lo:hi], state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi], state.step, cfg)


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A reused buffer for the denominator: a fresh one per unit would cost a page fault per
    4 KiB on every step (the allocator unmaps large blocks when they are freed)."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view_as(like)


def _update(param, grad, exp_avg, exp_avg_sq, step: int, cfg: AdamW) -> None:
    beta1, beta2 = cfg.betas
    param.mul_(1 - cfg.lr * cfg.weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = cfg.lr / bias_correction1
    # (sqrt(v) / sqrt(bc2)) + eps, the same operations as torch.optim.AdamW, in one buffer.
    denom = torch.sqrt(exp_avg_sq, out=_scratch(exp_avg_sq)).div_(math.sqrt(bias_correction2)).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)

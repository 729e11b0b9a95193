"""Mixed precision: the dtype the model computes and gathers in, the dtype gradients are reduced in,
and, for float16, the loss scaling that keeps small gradients representable.

Like FSDP2's `MixedPrecisionPolicy`: the optimizer always runs on fp32 master shards; only what
moves and what computes is low precision.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["LossScale", "MixedPrecision"]

_LOW = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScale:
    """Dynamic loss scaling for float16, as DeepSpeed does it (its `fp16` section's keys).

    The loss is multiplied by the scale before the backward; gradients are unscaled before the
    update. A step whose gradients are not finite on any rank is skipped on every rank and counts
    as an overflow: the `hysteresis`-th overflow since the scale last grew halves it, and so does
    each one after until it grows again (never below `min_scale`); `window` + 1 good steps in a
    row double it, then every `window` more, as DeepSpeed counts ([Note: DeepSpeed's growth
    count] in `fxzero/runtime/loss_scale.py`). A skipped step does not step the LR schedule.
    """

    initial_scale_power: int = 16
    """The first scale is 2 ** initial_scale_power (DeepSpeed's initial_scale_power)."""
    window: int = 1000
    """Good steps between doublings of the scale (DeepSpeed's loss_scale_window; the first doubling
    after an overflow, or after the start, comes one good step later, as DeepSpeed's)."""
    hysteresis: int = 2
    """Overflows since the scale last grew before it halves (DeepSpeed's hysteresis, not restored
    by good steps: its consecutive_hysteresis false)."""
    min_scale: float = 1.0
    """The scale never goes below this (DeepSpeed's min_loss_scale)."""
    static: Optional[float] = None
    """A fixed scale instead of a dynamic one (DeepSpeed's loss_scale when not 0)."""

    def __post_init__(self) -> None:
        if not 0 <= self.initial_scale_power <= 64:
            raise ValueError(f"LossScale.initial_scale_power must be in [0, 64], got {self.initial_scale_power}")
        if self.window < 1:
            raise ValueError(f"LossScale.window must be >= 1 step, got {self.window}")
        if self.hysteresis < 1:
            raise ValueError(f"LossScale.hysteresis must be >= 1, got {self.hysteresis}")
        if not self.min_scale > 0:
            raise ValueError(f"LossScale.min_scale must be > 0, got {self.min_scale}")
        if self.static is not None and not self.static > 0:
            raise ValueError(f"LossScale.static must be > 0 (or None for a dynamic scale), got {self.static}")

    @property
    def initial(self) -> float:
        return float(self.static) if self.static is not None else float(2 ** self.initial_scale_power)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Compute and gather in `param_dtype`; reduce gradients in `reduce_dtype`; fp32 masters.

    Each unit keeps this rank's fp32 master shard (what AdamW updates, with its fp32 moments) and
    a `param_dtype` copy of its parameters that the all-gather moves (its shard; a unit held
    whole keeps the whole buffer), cast from the master once per step, after the update. The
    graph is traced in `param_dtype` (floating inputs are cast to it), so activations and
    gradients are `param_dtype`; each unit's gradients are flattened into a `reduce_dtype` buffer
    (the cast is that flatten) and reduce-scattered in it.
    """

    param_dtype: torch.dtype = torch.bfloat16
    """torch.bfloat16 or torch.float16."""
    reduce_dtype: Optional[torch.dtype] = torch.float32
    """torch.float32, or None to reduce in param_dtype (half the reduce-scatter bytes)."""
    loss_scale: Optional[LossScale] = None
    """float16 only: None means LossScale() (dynamic, as DeepSpeed's default); bfloat16 needs none."""

    def __post_init__(self) -> None:
        if self.param_dtype not in _LOW:
            raise ValueError(
                f"MixedPrecision.param_dtype must be torch.bfloat16 or torch.float16, got {self.param_dtype}; "
                "for fp32 training leave Config.mixed_precision=None"
            )
        if self.reduce_dtype not in (None, torch.float32, self.param_dtype):
            raise ValueError(
                f"MixedPrecision.reduce_dtype must be torch.float32 or None (param_dtype), got {self.reduce_dtype}"
            )
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScale):
            raise TypeError(f"MixedPrecision.loss_scale must be a fxzero.LossScale, got {type(self.loss_scale).__name__}")
        if self.param_dtype is torch.bfloat16 and self.loss_scale is not None:
            raise ValueError(
                "MixedPrecision(param_dtype=torch.bfloat16) takes no loss_scale: bfloat16 has float32's "
                "range; loss scaling is for torch.float16"
            )
        if self.param_dtype is torch.float16 and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScale())

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in and held in between backward and step."""
        return self.reduce_dtype or self.param_dtype

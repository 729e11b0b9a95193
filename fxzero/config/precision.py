"""Mixed precision: the dtype the model computes and gathers in, the dtype gradients are reduced in,
the dtypes of the masters the optimizer updates and of its states, and, for float16, the loss
scaling that keeps small gradients representable.

Like FSDP2's `MixedPrecisionPolicy`, by default the optimizer runs on fp32 master shards with fp32
states; only what moves and what computes is low precision. `master_dtype` and `optimizer_dtype`
trade that precision for memory, as DeepSpeed's `bf16_master_weights_and_grads` and
`bf16_optimizer_states` do ([Note: low-precision masters]).

[Note: low-precision masters]
With `master_dtype=param_dtype` the masters are the compute copy itself: no second copy exists,
the update writes the bfloat16 (float16) parameters the next forward gathers, and a unit's model
states are 2 bytes of parameter, the gradient (2 bytes with `reduce_dtype=None`) and the states.
(DeepSpeed keeps a separate bf16 master partition beside its bf16 module, with the same values;
one copy is enough.) The update then computes with `optimizer_dtype=param_dtype` in that dtype,
as `torch.optim` steps a bfloat16 parameter (whose states torch creates in the parameter's
dtype); with fp32 states as DeepSpeedCPUAdam with `fp32_optimizer_states` does: parameter and
gradient widened to fp32, the states updated in fp32, the parameter rounded back ([Note: the
update's dtype] in `fxzero/runtime/optim.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["Autocast", "LossScale", "MixedPrecision"]

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
    """Compute and gather in `param_dtype`; reduce gradients in `reduce_dtype`; masters in
    `master_dtype` (fp32 by default) with optimizer states in `optimizer_dtype` (fp32 by default).

    With fp32 masters each unit keeps this rank's fp32 master shard (what AdamW updates, with its
    moments) and a `param_dtype` copy of its parameters that the all-gather moves (its shard; a
    unit held whole keeps the whole buffer), cast from the master once per step, after the
    update. With `master_dtype=param_dtype` there is no copy: the masters are the parameters the
    forward gathers ([Note: low-precision masters]). The graph is traced in `param_dtype`
    (floating inputs are cast to it), so activations and gradients are `param_dtype`; each unit's
    gradients are flattened into a `reduce_dtype` buffer (the cast is that flatten) and
    reduce-scattered in it.
    """

    param_dtype: torch.dtype = torch.bfloat16
    """torch.bfloat16 or torch.float16."""
    reduce_dtype: Optional[torch.dtype] = torch.float32
    """torch.float32, or None to reduce in param_dtype (half the reduce-scatter bytes)."""
    loss_scale: Optional[LossScale] = None
    """float16 only: None means LossScale() (dynamic, as DeepSpeed's default); bfloat16 needs none."""
    master_dtype: torch.dtype = torch.float32
    """The dtype of the masters the optimizer updates: torch.float32, or param_dtype (the masters
    are then the compute copy: 2 bytes per parameter instead of 2 + 4; DeepSpeed's
    `bf16_master_weights_and_grads`, which holds its gradients in bf16 too: `reduce_dtype=None`)."""
    optimizer_dtype: torch.dtype = torch.float32
    """The dtype of the optimizer's per-element states (Adam's exp_avg and exp_avg_sq):
    torch.float32, or param_dtype (DeepSpeed's `bf16_optimizer_states`: 2 bytes per state)."""

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
        for field in ("master_dtype", "optimizer_dtype"):
            got = getattr(self, field)
            if got not in (torch.float32, self.param_dtype):
                raise ValueError(
                    f"MixedPrecision.{field} must be torch.float32 or param_dtype ({self.param_dtype}), got {got}"
                )

    @property
    def low_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the compute copy kept beside the masters: param_dtype with fp32 masters,
        None where the masters are themselves in param_dtype (no copy)."""
        return self.param_dtype if self.master_dtype != self.param_dtype else None

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in and held in between backward and step."""
        return self.reduce_dtype or self.param_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class Autocast:
    """Every call of the engine runs under `torch.autocast(<the engine's device type>, dtype)`, as
    DeepSpeed's `"torch_autocast"` section wraps its engine's forward (replacing an autocast the
    caller entered): the program is traced under it, so autocast's casts (to `dtype` before a
    matmul, to fp32 before the ops autocast keeps in fp32) are nodes of the forward and their
    backwards of the backward, as eager autocast records them.

    The parameters stay in their dtype: the masters' with `Config.mixed_precision=None` (fp32:
    gathered and reduced in fp32, where DeepSpeed moves the parameters and gradients of its
    `lower_precision_safe_modules` in `dtype`), the compute dtype under mixed precision.
    """

    dtype: torch.dtype = torch.bfloat16
    """torch.bfloat16, or torch.float16 with MixedPrecision(param_dtype=torch.float16) (whose loss
    scaling keeps float16 gradients representable)."""

    def __post_init__(self) -> None:
        if self.dtype not in _LOW:
            raise ValueError(f"Autocast.dtype must be torch.bfloat16 or torch.float16, got {self.dtype}")

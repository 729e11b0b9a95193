"""Loss scaling for float16, and the check that a step's gradients are finite on every rank.

[Note: one flag per step]
Every rank must agree whether a step's update happens: a rank that skipped (float16 overflow)
or stopped (a NaN loss) while the others went on would leave them waiting in the next collective.
So each step reduces one flag over the ranks (a 1-element all-reduce, not counted in
comm_report) and every rank acts on the sum:

- bfloat16 and fp32: the flag is whether this rank's loss is finite, known before the backward
  starts; it is reduced right then, ahead of the backward's collectives, so its tiny round trip
  overlaps the backward and the step does not wait for the gradients still in flight. A
  non-finite loss anywhere is an error on every rank, naming the step and the first unit whose
  gradient is not finite on this rank.
- float16: the flag is whether any of this rank's gradient shards holds an inf or a NaN (an
  overflow of the scaled loss), known once they are reduced; the step is skipped on every rank
  alike and the scale backs off (`LossScaler`). A scale stuck at its minimum for `window`
  overflowing steps in a row is an error, not an endless loop of skipped steps.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from fxzero.config.precision import LossScale

__all__ = ["LossScaler", "first_nonfinite"]


class LossScaler:
    """DeepSpeed's dynamic loss scaler (`DynamicLossScaler`, consecutive_hysteresis false), for one run.

    On an overflow the scale halves once `hysteresis` overflows have happened since it last
    grew, or since the start (never below `min_scale`); good steps do not restore the
    hysteresis, a growth does. The scale doubles after `window` + 1 good steps in a row, then
    after every `window` more ([Note: DeepSpeed's growth count]). A static scale never changes.

    [Note: DeepSpeed's growth count]
    DeepSpeed counts `stable = (iteration - last overflow's iteration) - 1`, its first iteration
    0 and "the last overflow" -1 at the start, and doubles on a good step when stable > 0 and
    stable % window == 0. So the first good step after an overflow (or the first step of the
    run) counts 0: with window W the scale doubles in the update of the (W + 1)-th good step in
    a row, and of the (2W + 1)-th, (3W + 1)-th..., not reset by a growth. `_clean`, the good
    steps since the last overflow, is stable + 1. (torch's GradScaler doubles after W; a run
    ported from DeepSpeed sees DeepSpeed's scales, step for step.)
    """

    def __init__(self, policy: LossScale) -> None:
        self.policy = policy
        self.scale = policy.initial
        self._hysteresis = policy.hysteresis
        self._clean = 0  # good steps since the last overflow (or the start); not reset by a growth
        self.stuck = 0
        """Overflowing steps in a row at the minimum scale."""

    def update(self, overflow: bool) -> None:
        p = self.policy
        if p.static is not None:
            return
        if overflow:
            self._clean = 0
            at_min = self.scale <= p.min_scale
            if self._hysteresis <= 1:
                self.scale = max(self.scale / 2, p.min_scale)
            else:
                self._hysteresis -= 1
            self.stuck = self.stuck + 1 if at_min else 0
            return
        self.stuck = 0
        self._clean += 1
        stable = self._clean - 1  # [Note: DeepSpeed's growth count]
        if stable > 0 and stable % p.window == 0:
            self.scale *= 2
            self._hysteresis = p.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint restores (plain numbers, so it loads with weights_only): the scale,
        the overflows left before it halves, the good steps since the last overflow (which time
        its next doubling), the overflows in a row at the minimum scale."""
        return {"scale": self.scale, "hysteresis": self._hysteresis, "clean": self._clean, "stuck": self.stuck}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Continue where `state` left off, under this run's policy (a static scale stays static)."""
        if set(state) != {"scale", "hysteresis", "clean", "stuck"}:
            raise ValueError(f"a loss scaler's state has keys scale, hysteresis, clean and stuck; got {sorted(state)}")
        if self.policy.static is not None:
            return
        self.scale = float(state["scale"])
        self._hysteresis, self._clean, self.stuck = int(state["hysteresis"]), int(state["clean"]), int(state["stuck"])

    @property
    def is_stuck(self) -> bool:
        return self.policy.static is None and self.stuck >= self.policy.window


def first_nonfinite(grads: Iterable[tuple[str, Optional[torch.Tensor]]]) -> Optional[str]:
    """The first unit (in the order given) whose gradient holds an inf or a NaN."""
    for unit, grad in grads:
        if isinstance(grad, torch.Tensor) and grad.numel() and not bool(torch.isfinite(grad).all()):
            return unit
    return None

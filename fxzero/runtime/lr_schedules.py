"""Schedulers that write a schedule (`fxzero.config.schedules`) into a torch optimizer.

`build_scheduler(schedule, optimizer)` returns one per schedule type, with the semantics of
DeepSpeed 0.19.8's class of the same name (`deepspeed/runtime/lr_schedules.py`), so a run
configured from a DeepSpeed config sees DeepSpeed's lr at every step. Each writes
`param_groups[g]["lr"]` of every group (a tensor lr is filled in place), which is all the
engine's `ShardedOptimizer` reads. Like DeepSpeed's, they are plain objects, not
`torch.optim.lr_scheduler.LRScheduler`s, with the calls a training loop or checkpoint makes of
one: `step()`, `get_last_lr()`, `state_dict()`, `load_state_dict()`.

[Note: step counting]
`last_batch_iteration`, i below, counts from -1. Building a scheduler (with last_step=-1)
writes the lr of i = -1; each `step()` adds one to i and writes the lr of the new i. DeepSpeed
steps the scheduler after each optimizer step, so optimizer step n (from 1) runs with the lr of
i = n - 2: WarmupLR's first two steps both run at warmup_min_lr (g(-1) = g(0) = 0), and
WarmupCosineLR's first one at lr 0. Built with another last_step (resuming), a scheduler
leaves the optimizer alone until its first `step()`, as DeepSpeed's do.

In the formulas, W = max(2, warmup_num_steps) (DeepSpeed's floor: log(W) divides), T is
total_num_steps, and the warmup fraction is
    g(i) = 0 for i < 0;  log(i + 1) / log(W) ("log") or i / W ("linear") for i < W;  1 after,
so a log warmup reaches its top at i = W - 1 and a linear one at i = W.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import torch

from fxzero.config.schedules import LRRangeTest, LRSchedule, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["VALID_LR_SCHEDULES", "Scheduler", "build_scheduler"]

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""The config's scheduler types, as DeepSpeed names them (`deepspeed.runtime.lr_schedules`: accelerate
tells a scheduler DeepSpeed built from a client's by its class name in this list)."""


def _warmup_fraction(i: int, warmup_steps: int, warmup_type: str) -> float:
    """g(i) of the module doc, for i < W."""
    if i < 0:
        return 0.0
    if warmup_type == "log":
        return math.log(i + 1) / math.log(warmup_steps)
    return i / warmup_steps


def _write_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):  # a tensor lr (capturable optimizers) stays that tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return lrs


class Scheduler:
    """What the five schedulers share: the step count, writing the lr, and the state to keep.

    A subclass sets what its `lrs_at(i)` reads, then calls `Scheduler.__init__`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_step: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_step  # i of [Note: step counting], whose lr the optimizer holds
        self._last_lr: Optional[list[float]] = None
        if last_step == -1:
            self._last_lr = _write_lrs(optimizer, self.get_lr())

    def lrs_at(self, i: int) -> list[float]:
        """The lr of each param group at step i."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """The lr of each param group at the current step."""
        return self.lrs_at(self.last_batch_iteration)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Move to the next step (or to `last_batch_iteration`) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__} was built to resume at step {self.last_batch_iteration} "
                               "and has written no lr yet: call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        """The step count, all DeepSpeed checkpoints of a scheduler."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved step; the optimizer gets its lr at the next `step()`."""
        self.last_batch_iteration = state["last_batch_iteration"]


class _WarmupLR(Scheduler):
    """lr(i) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * g(i); warmup_max_lr None is each
    group's lr when built."""

    def __init__(self, schedule: WarmupLR | WarmupDecayLR, optimizer: torch.optim.Optimizer, last_step: int):
        self.schedule = schedule
        self.warmup_steps = max(2, schedule.warmup_num_steps)
        self.min_lrs = [schedule.warmup_min_lr] * len(optimizer.param_groups)
        if schedule.warmup_max_lr is None:
            self.max_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        else:
            self.max_lrs = [schedule.warmup_max_lr] * len(optimizer.param_groups)
        super().__init__(optimizer, last_step)

    def _gamma(self, i: int) -> float:
        if i < self.warmup_steps:
            return _warmup_fraction(i, self.warmup_steps, self.schedule.warmup_type)
        return 1.0

    def lrs_at(self, i: int) -> list[float]:
        gamma = self._gamma(i)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class _WarmupDecayLR(_WarmupLR):
    """As WarmupLR during the warmup; after it, the lr falls linearly back to warmup_min_lr (0 by
    default), reached at step T and held:
        lr(i) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * max(0, (T - i) / max(1, T - W))."""

    def _gamma(self, i: int) -> float:
        if i < self.warmup_steps:
            return super()._gamma(i)
        total = self.schedule.total_num_steps
        return max(0.0, (total - i) / max(1, total - self.warmup_steps))


class _WarmupCosineLR(Scheduler):
    """lr_g(i) = lr0_g * r(i), lr0_g being group g's lr when built, with r(-1) = 0 and
        r(i) = warmup_min_ratio + (1 - warmup_min_ratio) * g(i)                for i < W,
        r(i) = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2   after,
    p = min(1, (i - W + 1) / max(1, T - W)): the floor is reached at i = T - 1, one step before
    WarmupDecayLR's. lr0 is not in `state_dict` (as in DeepSpeed): build the scheduler before
    loading an optimizer state whose lrs it wrote."""

    def __init__(self, schedule: WarmupCosineLR, optimizer: torch.optim.Optimizer, last_step: int):
        self.schedule = schedule
        self.warmup_steps = max(2, schedule.warmup_num_steps)
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_step)

    def _ratio(self, i: int) -> float:
        s = self.schedule
        if i < 0:  # DeepSpeed's lr before the first step is 0, whatever warmup_min_ratio is
            return 0.0
        if i < self.warmup_steps:
            return s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * _warmup_fraction(i, self.warmup_steps,
                                                                                      s.warmup_type)
        progress = min(1.0, (i - self.warmup_steps + 1) / max(1, s.total_num_steps - self.warmup_steps))
        return s.cos_min_ratio + (1.0 - s.cos_min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0

    def lrs_at(self, i: int) -> list[float]:
        ratio = self._ratio(i)
        return [lr0 * ratio for lr0 in self.base_lrs]


class _OneCycle(Scheduler):
    """With S1, S2 the halves' step sizes, K the half's stair count and D decay_step_size, the
    cycle's height at step i < S1 + S2 is, for c = (i + 1) mod (S1 + S2),
        h = c / S1 rising (c <= S1),  (S1 + S2 - c) / S2 falling;  floor(K * h) / K if K > 0,
        lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * h,
        momentum = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * h.
    (The mod makes the cycle's last step, i = S1 + S2 - 1, the bottom: with S2 = 0 the top is
    never reached, as in DeepSpeed.) After the cycle, with d = i - (S1 + S2) + 1,
        lr = cycle_min_lr / (1 + decay_lr_rate * d / D),
        momentum = cycle_max_mom * (1 + decay_mom_rate * d / D)     (no decay when D = 0).
    Built, it writes cycle_min_lr and cycle_min_mom. Momentum is written as betas = (momentum,
    0.99) into every group, replacing the second beta too, as DeepSpeed does; an optimizer with
    no "betas" in its defaults keeps its own (DeepSpeed warns and cycles none)."""

    def __init__(self, schedule: OneCycle, optimizer: torch.optim.Optimizer, last_step: int):
        s = self.schedule = schedule
        # An unset second half is shaped as the first, as in DeepSpeed.
        self.first, self.first_stairs = s.cycle_first_step_size, s.cycle_first_stair_count
        self.second = self.first if s.cycle_second_step_size is None else s.cycle_second_step_size
        self.second_stairs = self.first_stairs if s.cycle_second_stair_count is None else s.cycle_second_stair_count
        self.cycle_momentum = s.cycle_momentum and "betas" in optimizer.defaults
        if s.cycle_momentum and not self.cycle_momentum:
            warnings.warn(f"OneCycle.cycle_momentum has no effect: {type(optimizer).__name__} has no \"betas\" "
                          "(DeepSpeed cycles Adam-style betas only); set cycle_momentum=False", stacklevel=3)
        super().__init__(optimizer, last_step)
        if last_step == -1 and self.cycle_momentum:
            self._write_momentum(s.cycle_min_mom)

    def _height(self, i: int) -> float:
        total = self.first + self.second
        c = (i + 1) % total
        if c <= self.first:
            stairs, climbed, size = self.first_stairs, c, self.first
        else:
            stairs, climbed, size = self.second_stairs, total - c, self.second
        if stairs > 0:  # floor the exact integer quotient: c / S1 * K can land just under a stair
            return math.floor(climbed * stairs / size) / stairs
        return climbed / size

    def _decay(self, i: int, rate: float) -> float:
        """1 + rate * d / D of the class doc."""
        if self.schedule.decay_step_size == 0:
            return 1.0
        return 1.0 + rate * (i - (self.first + self.second) + 1) / self.schedule.decay_step_size

    def lrs_at(self, i: int) -> list[float]:
        s = self.schedule
        if i < self.first + self.second:
            lr = s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * self._height(i)
        else:
            lr = s.cycle_min_lr / self._decay(i, s.decay_lr_rate)
        return [lr] * len(self.optimizer.param_groups)

    def momentum_at(self, i: int) -> float:
        """The momentum (first beta) of every group at step i."""
        s = self.schedule
        if i < self.first + self.second:
            return s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * self._height(i)
        return s.cycle_max_mom * self._decay(i, s.decay_mom_rate)

    def _write_momentum(self, momentum: float) -> None:
        for group in self.optimizer.param_groups:
            group["betas"] = (momentum, 0.99)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._write_momentum(self.momentum_at(self.last_batch_iteration))


class _LRRangeTest(Scheduler):
    """lr(i) = lr_range_test_min_lr * (1 + lr_range_test_step_rate * q),
    q = (i + 1) / lr_range_test_step_size, floored with lr_range_test_staircase."""

    def __init__(self, schedule: LRRangeTest, optimizer: torch.optim.Optimizer, last_step: int):
        self.schedule = schedule
        super().__init__(optimizer, last_step)

    def lrs_at(self, i: int) -> list[float]:
        s = self.schedule
        q = (i + 1) / s.lr_range_test_step_size
        if s.lr_range_test_staircase:
            q = math.floor(q)
        return [s.lr_range_test_min_lr * (1.0 + s.lr_range_test_step_rate * q)] * len(self.optimizer.param_groups)


_SCHEDULERS: dict[type, type[Scheduler]] = {
    WarmupLR: _WarmupLR,
    WarmupDecayLR: _WarmupDecayLR,
    WarmupCosineLR: _WarmupCosineLR,
    OneCycle: _OneCycle,
    LRRangeTest: _LRRangeTest,
}


def build_scheduler(schedule: LRSchedule, optimizer: torch.optim.Optimizer, last_step: int = -1) -> Scheduler:
    """The scheduler of `schedule` on `optimizer`; see [Note: step counting] for `last_step`."""
    if type(schedule) not in _SCHEDULERS:
        raise TypeError(f"build_scheduler needs one of fxzero.config.schedules' "
                        f"{', '.join(cls.__name__ for cls in _SCHEDULERS)}, got {type(schedule).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"build_scheduler needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(last_step, bool) or not isinstance(last_step, int) or last_step < -1:
        raise ValueError(f"build_scheduler: last_step must be an int >= -1 (-1: a fresh start), got {last_step!r}")
    return _SCHEDULERS[type(schedule)](schedule, optimizer, last_step)

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

from fxzero.config import schedules as cfg

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "Scheduler", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_scheduler"]

# DeepSpeed's names for the config's keys and schedule types (`deepspeed.runtime.lr_schedules`),
# which scripts import to write a config or build a scheduler
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""The config's scheduler types, as DeepSpeed names them (`deepspeed.runtime.lr_schedules`: accelerate
tells a scheduler DeepSpeed built from a client's by its class name in this list)."""
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps"
WARMUP_TYPE, WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "warmup_type", "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO = "warmup_min_ratio", "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"


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

    def __init__(self, schedule: cfg.WarmupLR | cfg.WarmupDecayLR, optimizer: torch.optim.Optimizer, last_step: int,
                 per_group: Optional[tuple[list[float], Optional[list[float]]]] = None):
        """`per_group`: each group's warmup_min_lr and warmup_max_lr in place of the schedule's (DeepSpeed's
        class takes lists)."""
        self.schedule = schedule
        self.warmup_steps = max(2, schedule.warmup_num_steps)
        mins, maxs = per_group or (None, None)
        self.min_lrs = mins or [schedule.warmup_min_lr] * len(optimizer.param_groups)
        if maxs is not None:
            self.max_lrs = maxs
        elif schedule.warmup_max_lr is None:
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

    def __init__(self, schedule: cfg.WarmupCosineLR, optimizer: torch.optim.Optimizer, last_step: int):
        self.schedule = schedule
        self.warmup_steps = max(2, schedule.warmup_num_steps)
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        # (DeepSpeed's attributes, which scripts read)
        self.total_num_steps, self.warmup_num_steps = schedule.total_num_steps, self.warmup_steps
        self.warmup_min_ratio, self.cos_min_ratio = schedule.warmup_min_ratio, schedule.cos_min_ratio
        self.warmup_type = schedule.warmup_type
        super().__init__(optimizer, last_step)

    def get_lr_ratio(self) -> float:
        """The ratio of each group's lr at the current step (DeepSpeed's)."""
        return self._ratio(self.last_batch_iteration)

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

    def __init__(self, schedule: cfg.OneCycle, optimizer: torch.optim.Optimizer, last_step: int,
                 per_group: Optional[dict[str, list[float]]] = None):
        """`per_group`: each group's cycle_min_lr, cycle_max_lr, cycle_min_mom or cycle_max_mom in place
        of the schedule's one value (DeepSpeed's class takes lists)."""
        s = self.schedule = schedule
        groups = len(optimizer.param_groups)
        self.bounds = {name: (per_group or {}).get(name) or [getattr(s, name)] * groups
                       for name in ("cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom")}
        # An unset second half is shaped as the first, as in DeepSpeed.
        self.first, self.first_stairs = s.cycle_first_step_size, s.cycle_first_stair_count
        self.second = self.first if s.cycle_second_step_size is None else s.cycle_second_step_size
        self.second_stairs = self.first_stairs if s.cycle_second_stair_count is None else s.cycle_second_stair_count
        self.cycle_momentum = s.cycle_momentum and "betas" in optimizer.defaults
        if s.cycle_momentum and not self.cycle_momentum:
            warnings.warn(f"OneCycle.cycle_momentum has no effect: {type(optimizer).__name__} has no \"betas\" "
                          "(DeepSpeed cycles Adam-style betas only); set cycle_momentum=False", stacklevel=3)
        # (DeepSpeed's attributes)
        self.step_ratio = self.first / (self.first + self.second)
        self.min_lrs, self.max_lrs = self.bounds["cycle_min_lr"], self.bounds["cycle_max_lr"]
        super().__init__(optimizer, last_step)
        if last_step == -1 and self.cycle_momentum:
            self._write_momentum(self.bounds["cycle_min_mom"])

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
        lows, highs = self.bounds["cycle_min_lr"], self.bounds["cycle_max_lr"]
        if i < self.first + self.second:
            height = self._height(i)
            return [lo + (hi - lo) * height for lo, hi in zip(lows, highs)]
        decay = self._decay(i, self.schedule.decay_lr_rate)
        return [lo / decay for lo in lows]

    def momentum_at(self, i: int) -> list[float]:
        """The momentum (first beta) of each group at step i."""
        lows, highs = self.bounds["cycle_min_mom"], self.bounds["cycle_max_mom"]
        if i < self.first + self.second:
            height = self._height(i)
            return [hi - (hi - lo) * height for lo, hi in zip(lows, highs)]
        decay = self._decay(i, self.schedule.decay_mom_rate)
        return [hi * decay for hi in highs]

    def get_mom(self) -> Optional[list[tuple[float, float]]]:
        """Each group's betas at the current step (None where momentum does not cycle), as DeepSpeed's."""
        if not self.cycle_momentum:
            return None
        return [(m, 0.99) for m in self.momentum_at(self.last_batch_iteration)]

    def _write_momentum(self, momenta: list[float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, momenta):
            group["betas"] = (momentum, 0.99)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._write_momentum(self.momentum_at(self.last_batch_iteration))


class _LRRangeTest(Scheduler):
    """lr(i) = lr_range_test_min_lr * (1 + lr_range_test_step_rate * q),
    q = (i + 1) / lr_range_test_step_size, floored with lr_range_test_staircase."""

    def __init__(self, schedule: cfg.LRRangeTest, optimizer: torch.optim.Optimizer, last_step: int):
        self.schedule = schedule
        super().__init__(optimizer, last_step)

    def lrs_at(self, i: int) -> list[float]:
        s = self.schedule
        q = (i + 1) / s.lr_range_test_step_size
        if s.lr_range_test_staircase:
            q = math.floor(q)
        return [s.lr_range_test_min_lr * (1.0 + s.lr_range_test_step_rate * q)] * len(self.optimizer.param_groups)


_SCHEDULERS: dict[type, type[Scheduler]] = {
    cfg.WarmupLR: _WarmupLR,
    cfg.WarmupDecayLR: _WarmupDecayLR,
    cfg.WarmupCosineLR: _WarmupCosineLR,
    cfg.OneCycle: _OneCycle,
    cfg.LRRangeTest: _LRRangeTest,
}


def build_scheduler(schedule: cfg.LRSchedule, optimizer: torch.optim.Optimizer, last_step: int = -1) -> Scheduler:
    """The scheduler of `schedule` on `optimizer`; see [Note: step counting] for `last_step`."""
    if type(schedule) not in _SCHEDULERS:
        raise TypeError(f"build_scheduler needs one of fxzero.config.schedules' "
                        f"{', '.join(cls.__name__ for cls in _SCHEDULERS)}, got {type(schedule).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"build_scheduler needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(last_step, bool) or not isinstance(last_step, int) or last_step < -1:
        raise ValueError(f"build_scheduler: last_step must be an int >= -1 (-1: a fresh start), got {last_step!r}")
    return _SCHEDULERS[type(schedule)](schedule, optimizer, last_step)


# -- DeepSpeed's classes, built on an optimizer by a script ------------------------------------------
#
# `from deepspeed.runtime.lr_schedules import WarmupLR; WarmupLR(optimizer, warmup_max_lr=...)`,
# then stepped by hand or passed to initialize(lr_scheduler=...): DeepSpeed's signatures and
# defaults, each the scheduler of the config's schedule of that name.


def _per_group(optimizer: torch.optim.Optimizer, cls: str, name: str, value: Any) -> Optional[list[float]]:
    """A list or tuple of one value per param group (DeepSpeed's classes take them), else None."""
    if not isinstance(value, (list, tuple)):
        return None
    if len(value) != len(optimizer.param_groups):
        raise ValueError(f"{cls}: {name} has {len(value)} values for {len(optimizer.param_groups)} param groups; give "
                         "one per group, or one number for all")
    return [float(v) for v in value]


class WarmupLR(_WarmupLR):
    """DeepSpeed's `WarmupLR(optimizer, ...)` (`warmup_min_lr`, `warmup_max_lr`: a number, or one
    per param group; `warmup_max_lr` None: each group's lr)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        name = type(self).__name__
        mins = _per_group(optimizer, name, "warmup_min_lr", warmup_min_lr)
        maxs = _per_group(optimizer, name, "warmup_max_lr", warmup_max_lr)
        schedule = cfg.WarmupLR(warmup_min_lr=0.0 if mins else warmup_min_lr,
                                warmup_max_lr=None if maxs else warmup_max_lr, warmup_num_steps=warmup_num_steps,
                                warmup_type=warmup_type)
        super().__init__(schedule, optimizer, last_batch_iteration, per_group=(mins, maxs))


class WarmupDecayLR(_WarmupDecayLR):
    """DeepSpeed's `WarmupDecayLR(optimizer, total_num_steps, ...)`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        name = type(self).__name__
        mins = _per_group(optimizer, name, "warmup_min_lr", warmup_min_lr)
        maxs = _per_group(optimizer, name, "warmup_max_lr", warmup_max_lr)
        schedule = cfg.WarmupDecayLR(total_num_steps=total_num_steps, warmup_min_lr=0.0 if mins else warmup_min_lr,
                                     warmup_max_lr=0.001 if maxs else warmup_max_lr,
                                     warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
        super().__init__(schedule, optimizer, last_batch_iteration, per_group=(mins, maxs))


class WarmupCosineLR(_WarmupCosineLR):
    """DeepSpeed's `WarmupCosineLR(optimizer, total_num_steps, ...)`: ratios of each group's lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        super().__init__(cfg.WarmupCosineLR(total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
                                            warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio,
                                            warmup_type=warmup_type), optimizer, last_batch_iteration)


def _one_value(cls: str, name: str, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        raise TypeError(f"{cls}: {name} is a list: fxzero's {cls} takes one value for every param group (DeepSpeed's "
                        "also takes one per group); give one number, or build a scheduler per group's needs with "
                        "torch.optim.lr_scheduler.LambdaLR")
    return value


class OneCycle(_OneCycle):
    """DeepSpeed's `OneCycle(optimizer, cycle_min_lr, cycle_max_lr, ...)` (the lrs and momenta: a
    number, or one per param group)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        given = dict(cycle_min_lr=cycle_min_lr, cycle_max_lr=cycle_max_lr, cycle_min_mom=cycle_min_mom,
                     cycle_max_mom=cycle_max_mom)
        lists = {k: v for k, v in ((k, _per_group(optimizer, "OneCycle", k, v)) for k, v in given.items()) if v}
        rest = dict(decay_lr_rate=decay_lr_rate, cycle_first_step_size=cycle_first_step_size,
                    cycle_second_step_size=cycle_second_step_size, cycle_first_stair_count=cycle_first_stair_count,
                    cycle_second_stair_count=cycle_second_stair_count, decay_step_size=decay_step_size,
                    cycle_momentum=cycle_momentum, decay_mom_rate=decay_mom_rate)
        # (each group's values checked as the schedule checks one; the first group's is the schedule)
        schedules = [cfg.OneCycle(**{k: lists[k][g] if k in lists else v for k, v in given.items()}, **rest)
                     for g in range(len(optimizer.param_groups) if lists else 1)]
        super().__init__(schedules[0], optimizer, last_batch_iteration, per_group=lists)


class LRRangeTest(_LRRangeTest):
    """DeepSpeed's `LRRangeTest(optimizer, ...)`, one `lr_range_test_min_lr` for every group."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        super().__init__(cfg.LRRangeTest(
            lr_range_test_min_lr=_one_value("LRRangeTest", "lr_range_test_min_lr", lr_range_test_min_lr),
            lr_range_test_step_size=lr_range_test_step_size, lr_range_test_step_rate=lr_range_test_step_rate,
            lr_range_test_staircase=lr_range_test_staircase), optimizer, last_batch_iteration)

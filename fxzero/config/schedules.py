"""DeepSpeed's learning-rate schedules as data: one frozen dataclass per "scheduler" type.

Layer 0 of the package: this module imports the standard library only. A schedule says what
the learning rate is at every optimizer step; `fxzero.runtime.lr_schedules.build_scheduler`
turns one into a scheduler that writes it into a torch optimizer's param groups, with the
semantics of DeepSpeed 0.19.8's `deepspeed/runtime/lr_schedules.py` (the formulas are in that
module's docstrings). Field names, defaults and meanings are DeepSpeed's, so a DeepSpeed
config's "scheduler" section reads into one, strictly, with `schedule_from_deepspeed`.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any, Literal, Optional, Union

__all__ = [
    "SCHEDULES",
    "WARMUP_TYPES",
    "LRRangeTest",
    "LRSchedule",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "schedule_from_deepspeed",
]

WARMUP_TYPES = ("log", "linear")
"""How the warmup rises: "log" as log(step + 1) / log(warmup_num_steps), "linear" as
step / warmup_num_steps."""


def _require_int(owner: object, name: str, minimum: int, hint: str = "") -> None:
    value = getattr(owner, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{type(owner).__name__}.{name} must be an int >= {minimum}{hint}, got {value!r}")


def _require_number(owner: object, name: str, low: float = 0.0, high: Optional[float] = None,
                    hint: str = "") -> None:
    value = getattr(owner, name)
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            low <= value and (high is None or value <= high)):
        raise ValueError(f"{type(owner).__name__}.{name} must be a number {bounds}{hint}, got {value!r}")


def _check_warmup(owner: Any) -> None:
    _require_int(owner, "warmup_num_steps", 1)
    if owner.warmup_type not in WARMUP_TYPES:
        raise ValueError(f"{type(owner).__name__}.warmup_type must be \"log\" or \"linear\", got "
                         f"{owner.warmup_type!r}")


def _check_total(owner: Any) -> None:
    _require_int(owner, "total_num_steps", 1, " (the optimizer steps of the whole run)")
    # DeepSpeed warms up over at least 2 steps (see fxzero/runtime/lr_schedules.py).
    if owner.total_num_steps <= max(2, owner.warmup_num_steps):
        warnings.warn(f"{type(owner).__name__}.total_num_steps={owner.total_num_steps} is not more than "
                      f"warmup_num_steps={owner.warmup_num_steps}: the lr drops to its floor right after "
                      "the warmup, with no decay between", stacklevel=4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupLR:
    """Warm up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps` steps, then stay."""

    warmup_min_lr: float = 0.0
    """The lr at the start of the warmup."""
    warmup_max_lr: Optional[float] = None
    """The lr at the end of the warmup and after it; None: each param group's own lr when the
    scheduler is built (DeepSpeed's WarmupLR default; its docs say 0.001, which is
    WarmupDecayLR's)."""
    warmup_num_steps: int = 1000
    """Steps of the warmup (DeepSpeed uses at least 2)."""
    warmup_type: Literal["log", "linear"] = "log"
    """How the warmup rises; see `WARMUP_TYPES`."""

    def __post_init__(self) -> None:
        _require_number(self, "warmup_min_lr")
        if self.warmup_max_lr is not None:
            _require_number(self, "warmup_max_lr", hint=" (or None: the optimizer's lr)")
        _check_warmup(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupDecayLR:
    """`WarmupLR`, then a linear decay from `warmup_max_lr` back to `warmup_min_lr` (0 by default),
    reached at `total_num_steps`."""

    total_num_steps: int
    """Steps of the whole run: the lr is `warmup_min_lr` from this step on."""
    warmup_min_lr: float = 0.0
    """The lr at the start of the warmup."""
    warmup_max_lr: float = 0.001
    """The lr at the end of the warmup, where the decay starts."""
    warmup_num_steps: int = 1000
    """Steps of the warmup (DeepSpeed uses at least 2)."""
    warmup_type: Literal["log", "linear"] = "log"
    """How the warmup rises; see `WARMUP_TYPES`."""

    def __post_init__(self) -> None:
        _require_number(self, "warmup_min_lr")
        _require_number(self, "warmup_max_lr")
        _check_warmup(self)
        _check_total(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupCosineLR:
    """Scale each param group's own lr (the one it has when the scheduler is built): warm the
    ratio up from `warmup_min_ratio` to 1, then decay it along a half cosine to `cos_min_ratio`
    at `total_num_steps`."""

    total_num_steps: int
    """Steps of the whole run: the ratio is `cos_min_ratio` from the step before this one on."""
    warmup_min_ratio: float = 0.0
    """The ratio at the first step of the warmup."""
    warmup_num_steps: int = 1000
    """Steps of the warmup (DeepSpeed uses at least 2)."""
    cos_min_ratio: float = 0.0001
    """The ratio at the end of the cosine decay and after it."""
    warmup_type: Literal["log", "linear"] = "log"
    """How the warmup rises; see `WARMUP_TYPES`."""

    def __post_init__(self) -> None:
        _require_number(self, "warmup_min_ratio", 0.0, 1.0, " (a fraction of the group's lr)")
        _require_number(self, "cos_min_ratio", 0.0, 1.0, " (a fraction of the group's lr)")
        _check_warmup(self)
        _check_total(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneCycle:
    """One cycle of the lr up from `cycle_min_lr` to `cycle_max_lr` and back (momentum the other
    way, max to min and back), then an optional decay below `cycle_min_lr`."""

    cycle_min_lr: float
    """The lr at both ends of the cycle (and when the scheduler is built)."""
    cycle_max_lr: float
    """The lr at the top of the cycle."""
    decay_lr_rate: float = 0.0
    """After the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size); 0: none."""
    cycle_first_step_size: int = 2000
    """Steps of the rising half."""
    cycle_second_step_size: Optional[int] = None
    """Steps of the falling half; None: `cycle_first_step_size`."""
    cycle_first_stair_count: int = 0
    """Stairs the rising half moves in (lr held flat between); 0: every step."""
    cycle_second_stair_count: Optional[int] = None
    """Stairs the falling half moves in; None: `cycle_first_stair_count`."""
    decay_step_size: int = 0
    """Steps per unit of the post-cycle decay (continuous, not stairs); 0: no decay."""
    cycle_momentum: bool = True
    """Cycle the momentum inversely to the lr, written as each group's betas = (momentum, 0.99)
    as DeepSpeed does; an optimizer without "betas" in its defaults (SGD) keeps its own."""
    cycle_min_mom: float = 0.8
    """The momentum at the top of the cycle (and when the scheduler is built)."""
    cycle_max_mom: float = 0.9
    """The momentum at both ends of the cycle."""
    decay_mom_rate: float = 0.0
    """After the cycle, momentum = cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)."""

    def __post_init__(self) -> None:
        for name in ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "decay_mom_rate"):
            _require_number(self, name)
        for name in ("cycle_min_mom", "cycle_max_mom"):
            _require_number(self, name, 0.0, 1.0)
        _require_int(self, "cycle_first_step_size", 1)
        for name in ("cycle_second_step_size", "cycle_second_stair_count"):
            if getattr(self, name) is not None:
                _require_int(self, name, 0, " (or None: as the first half)")
        _require_int(self, "cycle_first_stair_count", 0, " (0: no stairs)")
        _require_int(self, "decay_step_size", 0, " (0: no decay)")
        if not isinstance(self.cycle_momentum, bool):
            raise ValueError(f"OneCycle.cycle_momentum must be true or false, got {self.cycle_momentum!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRRangeTest:
    """Grow the lr from `lr_range_test_min_lr` without bound, to find the largest that trains:
    lr = min_lr * (1 + step_rate * (step + 1) / step_size), the quotient floored with staircase."""

    lr_range_test_min_lr: float = 0.001
    """The lr when the scheduler is built."""
    lr_range_test_step_size: int = 2000
    """Steps per `lr_range_test_step_rate` of growth."""
    lr_range_test_step_rate: float = 1.0
    """Growth of the lr, in units of min_lr, per `lr_range_test_step_size` steps."""
    lr_range_test_staircase: bool = False
    """Grow in stairs of `lr_range_test_step_size` steps instead of at every step."""

    def __post_init__(self) -> None:
        _require_number(self, "lr_range_test_min_lr")
        _require_number(self, "lr_range_test_step_rate")
        _require_int(self, "lr_range_test_step_size", 1)
        if not isinstance(self.lr_range_test_staircase, bool):
            raise ValueError("LRRangeTest.lr_range_test_staircase must be true or false, got "
                             f"{self.lr_range_test_staircase!r}")


LRSchedule = Union[WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest]

SCHEDULES: dict[str, type] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
"""DeepSpeed's "scheduler" "type" -> the schedule it names."""


def _did_you_mean(word: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {near[0]!r}?" if near else f"; valid: {', '.join(choices)}"


def schedule_from_deepspeed(section: dict[str, Any]) -> LRSchedule:
    """A DeepSpeed config's "scheduler" section, {"type": ..., "params": {...}}, as a schedule.

    Read strictly: an unknown type, key or param, a missing required param, or "auto" (which
    DeepSpeed leaves to a trainer to fill in) is a ValueError naming it and the way out.
    """
    if not isinstance(section, dict):
        raise ValueError(f'"scheduler" must be an object {{"type": ..., "params": {{...}}}}, got {section!r}')
    for key in section:
        if key not in ("type", "params"):
            raise ValueError(f'scheduler: unknown key {key!r}{_did_you_mean(key, ["type", "params"])}')
    name = section.get("type")
    if name not in SCHEDULES:
        known = list(SCHEDULES)
        near = difflib.get_close_matches(str(name), known, n=1)
        raise ValueError(
            f"scheduler.type {name!r} is not one of {', '.join(known)}"
            + (f"; did you mean {near[0]!r}?" if near else "")
            + " (a torch.optim.lr_scheduler class, which DeepSpeed also takes by name, is not read from "
            "the config: build it on the engine's optimizer and step it yourself)"
        )
    cls = SCHEDULES[name]
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"scheduler.params must be an object of {name}'s params, got {params!r}")
    fields = [f.name for f in dataclasses.fields(cls)]
    for key, value in params.items():
        if key not in fields:
            raise ValueError(f"scheduler.params: {name} has no param {key!r}{_did_you_mean(key, fields)}")
        if value == "auto":
            raise ValueError(
                f'scheduler.params.{key} is "auto": a trainer (such as Hugging Face\'s) fills that in '
                "before DeepSpeed reads it, and fxzero has no trainer to supply it: give a number"
            )
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.name not in params:
            raise ValueError(f"scheduler.params: {name} needs {f.name!r}; add it to \"params\"")
    return cls(**params)

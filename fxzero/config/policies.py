"""Policies: how parameters form units, the optimizer, prefetch, buckets and link emulation.

Each is a frozen, keyword-only dataclass validated in `__post_init__`; `fxzero.Config` holds one
of each.

[Note: optimizer states]
An optimizer policy (`OptimizerPolicy`: `AdamW`, `Adam`, `Adagrad`) declares the states it keeps
per parameter element, in `STATES`: AdamW's two moments ("exp_avg", "exp_avg_sq"), Adagrad's
running sum of squared gradients ("sum"). Each is one fp32 tensor the size of this rank's shard
per unit, and everything that handles optimizer states follows that declaration and nothing
else: the step program and step_in_backward fetch, update (one `fxzero::optim_step`, whose
`states` argument is the list of them, in declared order) and write back each state; they all
live where `Offload(optimizer=...)` says; the offload store sizes them, the memory report counts
them, `fxzero.estimate` prices them at 4 bytes each per element; and a state never written reads
as the policy's `initial_value` (0 for AdamW's moments, `initial_accumulator_value` for Adagrad).
The arithmetic of each policy is in `fxzero/runtime/optim.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Optional

import torch.nn as nn

__all__ = ["OPTIMIZERS", "Adagrad", "Adam", "AdamW", "Bucket", "LinkEmulation", "OptimizerPolicy", "Prefetch",
           "UnitsPolicy"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitsPolicy:
    """How parameters are grouped into units, the granularity of sharding (like FSDP wrapping).

    By default every item of an `nn.ModuleList` or `nn.Sequential` whose items hold parameters
    is a unit ("blocks"); parameters outside any unit form the root unit. Any of the fields
    below, when set, replaces that default: a module becomes its own unit when it matches.
    Matching is outermost-first: a module inside a unit is part of that unit.
    """

    module_classes: tuple[type[nn.Module], ...] = ()
    """Modules of these classes (isinstance) each form a unit."""

    fqn_prefixes: tuple[str, ...] = ()
    """Modules whose fully qualified name equals one of these each form a unit."""

    predicate: Callable[[str, nn.Module], bool] | None = None
    """`predicate(fqn, module) -> bool`; modules for which it is true each form a unit."""

    def __post_init__(self) -> None:
        for cls in self.module_classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(
                    f"UnitsPolicy.module_classes must hold nn.Module subclasses, got {cls!r}; "
                    "pass the class itself, e.g. module_classes=(MyBlock,)"
                )
        if self.predicate is not None and not callable(self.predicate):
            raise TypeError("UnitsPolicy.predicate must be callable as predicate(fqn, module)")

    @property
    def is_default(self) -> bool:
        return not (self.module_classes or self.fqn_prefixes or self.predicate)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerPolicy:
    """What every optimizer policy declares ([Note: optimizer states] above); `Config.optimizer`
    is one of its subclasses, `OPTIMIZERS`."""

    STATES: ClassVar[tuple[str, ...]] = ()
    """The states kept per parameter element (each one fp32 shard per unit), in the order the
    update takes them."""
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr",)
    """The options every param group carries (its own, or this policy's), read at each update."""

    @property
    def states(self) -> tuple[str, ...]:
        return type(self).STATES

    def initial_value(self, state: str) -> float:
        """What `state` holds before the first update: a state never written reads as this."""
        if state not in self.STATES:
            raise ValueError(f"{type(self).__name__} has no state {state!r}; its states are {list(self.STATES)}")
        return 0.0

    def defaults(self) -> dict[str, Any]:
        """The hyperparameters of a param group that sets none of its own: this policy's."""
        out = {k: getattr(self, k) for k in self.HYPERPARAMETERS}
        return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}  # betas=[..] as torch keeps it

    def _check_nonnegative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 0, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamW(OptimizerPolicy):
    """AdamW with the semantics of `torch.optim.AdamW` (decoupled weight decay)."""

    STATES: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay")

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay, applied as p *= 1 - lr * weight_decay."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{type(self).__name__}.betas must be two values in [0, 1), got {self.betas}")
        self._check_nonnegative("eps", "weight_decay")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam(AdamW):
    """Adam with the semantics of `torch.optim.Adam`: weight decay is L2, added to the gradient
    (DeepSpeed's "Adam" with "adam_w_mode": false); otherwise as `AdamW`."""

    weight_decay: float = 0.0
    """L2 penalty, added to the gradient as grad + weight_decay * param."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(OptimizerPolicy):
    """Adagrad with the semantics of `torch.optim.Adagrad` (its single-tensor path): per step
    `clr = lr / (1 + (step - 1) * lr_decay)`, `sum += grad * grad`,
    `param -= clr * grad / (sqrt(sum) + eps)`, with `grad + weight_decay * param` for grad when
    weight_decay is set. One state per element, so 12 bytes per parameter of model states in
    fp32 where AdamW takes 16 (ZeRO-Infinity's other NVMe-aware optimizer)."""

    STATES: ClassVar[tuple[str, ...]] = ("sum",)
    HYPERPARAMETERS: ClassVar[tuple[str, ...]] = ("lr", "lr_decay", "eps", "weight_decay")

    lr: float = 1e-2
    """Learning rate (before the decay)."""
    lr_decay: float = 0.0
    """The step-th update runs with lr / (1 + (step - 1) * lr_decay)."""
    weight_decay: float = 0.0
    """L2 penalty, added to the gradient as grad + weight_decay * param."""
    initial_accumulator_value: float = 0.0
    """What the sum of squared gradients starts from (every element; torch reads it from the
    optimizer's defaults, never from a param group, and so does fxzero)."""
    eps: float = 1e-10
    """Added to the denominator for numerical stability."""

    def __post_init__(self) -> None:
        self._check_nonnegative("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")

    def initial_value(self, state: str) -> float:
        super().initial_value(state)  # (a state it has)
        return float(self.initial_accumulator_value)


OPTIMIZERS: tuple[type[OptimizerPolicy], ...] = (AdamW, Adam, Adagrad)
"""The optimizer policies fxzero runs (the runtime has the arithmetic of each)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefetch:
    """Start all-gathers early, bounded by bytes of gathered buffers alive at once.

    Like DeepSpeed's stage3_max_live_parameters / stage3_prefetch_bucket_size, but in bytes and
    applied by a pass, so the resulting schedule and its peak are visible before anything runs.
    """

    max_live_bytes: Optional[int] = None
    """Budget for per-unit buffers alive at once: gathered parameters (in flight or in use) and
    flat gradients being reduced. None: the peak the schedule has without prefetch plus the
    largest unit (one unit of lookahead), or 128 MiB if that is more: a small model then keeps
    most or all of its units gathered from the forward into the backward and prefetches
    several ahead (DeepSpeed's defaults, 1e9 live parameters, keep every parameter of such a
    model gathered), while a large one keeps its one-unit lookahead."""

    keep_for_backward: Optional[bool] = None
    """Units the backward needs first stay gathered from the forward into the backward, as far
    as the budget allows, instead of being freed and gathered again (DeepSpeed's
    stage3_max_reuse_distance; FSDP2 does this for its root module). Their backward gathers
    disappear, so a step moves less than 3 x Phi elements. False: every unit is gathered twice.
    None (the default): keep them where that applies, which is at stage 3 with the parameters on
    the device (with offloaded parameters the fetched shards are kept instead, and the backward
    gathers again from them); True where it does not apply warns that it has no effect."""

    def __post_init__(self) -> None:
        if self.max_live_bytes is not None and self.max_live_bytes <= 0:
            raise ValueError(f"Prefetch.max_live_bytes must be positive, got {self.max_live_bytes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bucket:
    """Merge adjacent small units into one flat buffer, so one collective moves them all.

    Worth it where messages are latency-bound: by default a bucket holds up to the link's
    latency-bandwidth product (from the cost model), below which a collective's time is mostly
    latency. Units are merged before anything is materialized; the buckets are the units the
    schedule shows.
    """

    max_bytes: Optional[int] = None
    """Largest bucket; None: the cost model's all-gather latency x bandwidth."""

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"Bucket.max_bytes must be positive, got {self.max_bytes}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkEmulation:
    """Make collectives complete as if the link had this bandwidth and latency.

    Completion is delayed (the waiting rank sleeps), no CPU is burned, so overlap can be
    studied on a box whose loopback is nearly free. Real transfers still happen underneath.
    """

    bandwidth: float
    """Bytes per second each rank moves over the emulated link."""
    latency: float = 0.0
    """Seconds added to every collective."""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"LinkEmulation.bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not self.latency >= 0:
            raise ValueError(f"LinkEmulation.latency must be >= 0 s, got {self.latency}")

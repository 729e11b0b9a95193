"""Policies: how parameters form units, the optimizer, prefetch, buckets and link emulation.

Each is a frozen, keyword-only dataclass validated in `__post_init__`; `fxzero.Config` holds one
of each. The optimizer policies live in `fxzero/config/optimizers.py` and are re-exported here.

[Note: optimizer states]
An optimizer policy (`OptimizerPolicy`: `AdamW`, `Adam`, `Adagrad`, `SGD`, `Lion`, ... every one
of `OPTIMIZERS`) declares the states it keeps per parameter element, in `STATES`: AdamW's two
moments ("exp_avg", "exp_avg_sq"), Adagrad's running sum of squared gradients ("sum"), SGD's
momentum buffer; `policy.states` is the ones an instance keeps (SGD without momentum keeps none).
Each is one fp32 tensor the size of this rank's shard per unit, and everything that handles
optimizer states follows that declaration and nothing else: the step program and
step_in_backward fetch, update (one `fxzero::optim_step`, whose `states` argument is the list of
them, in declared order) and write back each state; they all live where
`Offload(optimizer=...)` says; the offload store sizes them, the memory report counts them,
`fxzero.estimate` prices them at 4 bytes each per element; checkpoints save each by name; and a
state never written reads as the policy's `initial_value` (0 for AdamW's moments,
`initial_accumulator_value` for Adagrad, 1 for NAdam's mu_product). Numbers torch keeps once per
parameter (NAdam's mu_product, ASGD's eta and mu: `SCALAR_STATES`) are states like the others,
the same value in each of a parameter's elements, so the same machinery shards, offloads and
re-slices them. The arithmetic of each policy is in `fxzero/runtime/optim.py` (AdamW, Adam,
Adagrad, Lion, and LAMB, whose per-tensor norms come from one small all-reduce per unit) and
`fxzero/runtime/torch_updates.py` (torch's own single-tensor update, on the shard's ranges, for
the others).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch.nn as nn

from fxzero.config.optimizers import (ASGD, OPTIMIZERS, Adadelta, Adagrad, Adam, Adamax, AdamW, Lamb, Lion, NAdam,
                                      OptimizerPolicy, RAdam, RMSprop, Rprop, SGD)

__all__ = ["ASGD", "OPTIMIZERS", "Adadelta", "Adagrad", "Adam", "Adamax", "AdamW", "Bucket", "DEFAULT_LEAF_CLASSES", "Lamb", "LeafModules",
           "LinkEmulation",
           "Lion", "NAdam", "OptimizerPolicy", "Prefetch", "RAdam", "RMSprop", "Rprop", "SGD", "UnitsPolicy"]


DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed 0.19's default `zero_optimization.leaf_module.classes`, which its `initialize` flags
whether or not a config names the section."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafModules:
    """Modules flagged as leaves when the engine starts, whose parameters are never split across
    units ([Note: leaf modules are never split across units] in `fxzero/leaf_modules.py`):
    DeepSpeed's `zero_optimization.leaf_module` section. `deepspeed.utils.set_z3_leaf_modules`
    flags modules the same way from a script."""

    classes: tuple = DEFAULT_LEAF_CLASSES
    """Module classes, or their names (`__name__`, or fully qualified as `module.QualName`)."""
    names: tuple[str, ...] = ()
    """Module names as `model.named_modules()` gives them."""
    name_suffixes: tuple[str, ...] = ()
    """Ends of module names."""

    def __post_init__(self) -> None:
        for field in ("classes", "names", "name_suffixes"):
            value = getattr(self, field)
            if isinstance(value, (str, type)):
                value = (value,)  # (as DeepSpeed takes one name for a list of one)
            value = tuple(dict.fromkeys(value))
            object.__setattr__(self, field, value)
            allowed = (str, type) if field == "classes" else (str,)
            bad = [v for v in value if not isinstance(v, allowed)]
            if bad:
                raise TypeError(f"LeafModules.{field} takes {'module classes or ' if field == 'classes' else ''}"
                                f"names (strings), got {bad!r}")


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

    def matches(self, fqn: str, module: nn.Module) -> bool:
        """Whether `module` (named `fqn` in the model) is one the fields make a unit (never with the
        default policy, whose units are the items of module lists)."""
        return not self.is_default and (
            isinstance(module, self.module_classes)
            or fqn in self.fqn_prefixes
            or (self.predicate is not None and bool(self.predicate(fqn, module))))


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

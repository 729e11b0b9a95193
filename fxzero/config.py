"""User-facing configuration: frozen, keyword-only dataclasses.

A `Config` says how a model is split into units, which ZeRO stage to run and how the
optimizer behaves. Stages 1, 2 and 3 are not separate code paths: they are different
settings of the same passes (see `fxzero/passes/README.md`):

====== ======================== =========================== =========================
stage  parameters between uses  gradients after backward    optimizer states
====== ======================== =========================== =========================
1      full, persistent         full flat buffer kept;      this rank's shard
                                rank's slice reduced
2      full, persistent         shard only (full freed)     this rank's shard
3      shard; gathered per use  shard only                  this rank's shard
====== ======================== =========================== =========================
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Literal, Optional, Union

import torch.nn as nn

__all__ = ["AdamW", "Bucket", "Config", "Cpu", "Device", "LinkEmulation", "Nvme", "Offload", "Prefetch", "UnitsPolicy"]


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
class AdamW:
    """AdamW with the semantics of `torch.optim.AdamW` (decoupled weight decay)."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay, applied as p *= 1 - lr * weight_decay."""

    def __post_init__(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"AdamW.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamW.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps >= 0.0:
            raise ValueError(f"AdamW.eps must be >= 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"AdamW.weight_decay must be >= 0, got {self.weight_decay}")


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

    keep_for_backward: bool = True
    """Units the backward needs first stay gathered from the forward into the backward, as far
    as the budget allows, instead of being freed and gathered again (DeepSpeed's
    stage3_max_reuse_distance; FSDP2 does this for its root module). Their backward gathers
    disappear, so a step moves less than 3 x Phi elements. False: every unit is gathered twice."""

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


@dataclasses.dataclass(frozen=True)
class Device:
    """Placement: accelerator memory (host memory on a machine without one). The default."""

    tier = "device"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cpu:
    """Placement: host memory, pinned when CUDA is present (like DeepSpeed's device "cpu")."""

    tier = "cpu"
    pin_memory: bool = True
    """Pin the host buffers (only matters with CUDA: pinned copies can be asynchronous)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Nvme:
    """Placement: files under `path` on a fast disk (ZeRO-Infinity; DeepSpeed's device "nvme").

    Each rank writes its own subdirectory `path/fxzero-rank<N>-<pid>`, removed by
    `engine.close()` (or at exit). Reads and writes are asynchronous, on `threads` I/O workers,
    through aligned staging buffers with O_DIRECT where the filesystem allows it.
    """

    tier = "nvme"
    path: str
    """An existing, writable directory (DeepSpeed's nvme_path)."""
    threads: int = 4
    """I/O operations in flight at once (DeepSpeed's buffer_count plays this part)."""
    block_bytes: int = 1 << 20
    """Bytes per read or write call, a multiple of 4096."""
    direct: Union[bool, Literal["auto"]] = "auto"
    """O_DIRECT: "auto" falls back to buffered I/O where the filesystem refuses it."""
    write_behind_bytes: int = 256 << 20
    """Memory for write-behind (fxzero/runtime/write_behind.py): a write that fits is copied
    here and the program goes on without waiting for the disk; a parameter shard stays until it
    is read (the next forward's first reads are the backward's last writes), so that read needs
    no disk. A read served from memory does not look at the file: a file changed underneath is
    caught at its next read from disk. 0 turns it off."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError("Nvme.path must name a directory, e.g. Nvme(path='/local_nvme')")
        object.__setattr__(self, "path", os.fspath(self.path))
        if self.threads < 1:
            raise ValueError(f"Nvme.threads must be >= 1, got {self.threads}")
        if self.block_bytes < 4096 or self.block_bytes % 4096:
            raise ValueError(f"Nvme.block_bytes must be a positive multiple of 4096, got {self.block_bytes}")
        if self.write_behind_bytes < 0:
            raise ValueError(f"Nvme.write_behind_bytes must be >= 0 (0: off), got {self.write_behind_bytes}")


Placement = Union[Device, Cpu, Nvme]

STATE_KINDS = ("param", "grad", "exp_avg", "exp_avg_sq")
"""The per-unit states a placement applies to: parameter shard, gradient shard, AdamW's moments."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offload:
    """Where each kind of model state lives between its uses (ZeRO-Offload / ZeRO-Infinity).

    The offload pass turns this into schedule nodes: each unit's state is fetched from its tier
    ahead of its use (a parameter shard before the unit's all-gather, optimizer states before
    the unit's step) and written back or released after its last use, on the "io" stream.
    Training is fp32, so the parameter shards are the fp32 masters: `params` places both.
    """

    params: Placement = Device()
    """This rank's parameter shards (ZeRO-3 only: at stages 1-2 parameters are held whole)."""
    optimizer: Placement = Device()
    """AdamW's exp_avg and exp_avg_sq for this rank's shard."""
    grads: Optional[Placement] = None
    """Reduced gradient shards between backward and step; None: where the optimizer states are
    (as DeepSpeed keeps gradients with an offloaded optimizer)."""
    lookahead: int = 1
    """Optimizer step: units whose states are fetched ahead of the one being updated."""
    step_in_backward: bool = False
    """Update each sharded unit inside the backward, as soon as its gradient is reduced (its
    parameter shard is still in memory from the backward's gather; a unit the backward does not
    gather, such as an embedding, reads its shard for the update alone), instead of in step():
    the gradient is never written to a tier, the parameter never read a third time, and the
    update overlaps the rest of the backward. Needs params and optimizer offloaded; step() then only
    handles persistent units. Like torch's optimizer-in-backward: no gradient clipping or
    inspection between backward() and step()."""

    def __post_init__(self) -> None:
        for name in ("params", "optimizer", "grads"):
            value = getattr(self, name)
            if value is None and name == "grads":
                continue
            if not isinstance(value, (Device, Cpu, Nvme)):
                raise TypeError(
                    f"Offload.{name} must be fxzero.Device(), fxzero.Cpu() or fxzero.Nvme(path=...), "
                    f"got {value!r}"
                )
        if self.lookahead < 0:
            raise ValueError(f"Offload.lookahead must be >= 0 units, got {self.lookahead}")
        if self.step_in_backward and not (self.offloaded("param") and self.offloaded("exp_avg")):
            raise ValueError(
                "Offload(step_in_backward=True) updates units from the states the backward streams "
                "through memory: offload both params= and optimizer= (to Cpu() or Nvme(...))"
            )

    @property
    def grads_placement(self) -> Placement:
        return self.optimizer if self.grads is None else self.grads

    def placement(self, kind: str) -> Placement:
        """Placement of a state kind: "param", "grad", "exp_avg" or "exp_avg_sq"."""
        if kind == "param":
            return self.params
        if kind == "grad":
            return self.grads_placement
        if kind in ("exp_avg", "exp_avg_sq"):
            return self.optimizer
        raise ValueError(f"unknown state kind {kind!r}")

    def offloaded(self, kind: str) -> bool:
        return not isinstance(self.placement(kind), Device)

    def tiers(self) -> dict[str, str]:
        """State kind -> tier name, for the states placed off the device."""
        return {k: self.placement(k).tier for k in STATE_KINDS if self.offloaded(k)}


def _placement_from_deepspeed(section: dict[str, Any], key: str) -> Placement:
    device = str(section.get("device", "none")).lower()
    if device in ("none", ""):
        return Device()
    if device == "cpu":
        return Cpu(pin_memory=bool(section.get("pin_memory", True)))
    if device == "nvme":
        if not section.get("nvme_path"):
            raise ValueError(f'zero_optimization.{key}: device "nvme" needs "nvme_path" (a directory on the disk)')
        return Nvme(path=section["nvme_path"], threads=int(section.get("buffer_count", 4)))
    raise ValueError(f'zero_optimization.{key}.device must be "none", "cpu" or "nvme", got {device!r}')


TRANSPORTS = ("auto", "shared_memory", "process_group")
"""Values of `Config.transport`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Everything `fxzero.compile` needs besides the model."""

    stage: Literal[1, 2, 3] = 3
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    units: UnitsPolicy = UnitsPolicy()
    """How parameters are grouped into units (the sharding granularity)."""
    optimizer: AdamW = AdamW()
    """The optimizer run on each rank's shard."""
    seed: int = 0
    """Seed for initializing a model built on the meta device from its own `reset_parameters()`."""
    prefetch: Optional[Prefetch] = Prefetch()
    """ZeRO-3: how far ahead all-gathers start; None issues each right before its first use."""
    persist_threshold: int = 0
    """ZeRO-3: units with fewer parameters than this stay gathered for the whole step (like
    stage3_param_persistence_threshold): no per-layer gathers, re-gathered after the step."""
    bucket: Optional[Bucket] = None
    """Merge adjacent small units into buckets (off by default: units are the buckets)."""
    link_emulation: Optional[LinkEmulation] = None
    """Emulate a slower link for every collective (for studying overlap on one box)."""
    transport: str = "auto"
    """How collectives move their data. "auto": through shared memory when every rank runs on
    this host with gloo (CPU buffers; `fxzero/runtime/shm.py`), else the process group;
    "shared_memory": that, or an error before training; "process_group": torch.distributed's
    collectives (gloo over loopback TCP, NCCL) always."""
    offload: Offload = Offload()
    """Where parameter shards, gradients and optimizer states live between uses (cpu, nvme)."""
    keep_host_memory: bool = False
    """On a machine without CUDA, keep freed host memory in the process instead of unmapping it
    (glibc; see fxzero/runtime/host_memory.py): the per-unit buffers then cost no page faults,
    but freed blocks of other sizes are kept too, so resident memory grows (1B offloaded to
    NVMe, 2 ranks: step 45 -> 39.5 s, peak RSS per rank 2.5 -> 8.5 GB). Off by default."""
    cost_model: Any = "measure"
    """What prices the compiler's choices (e.g. reduce-scatter vs all-reduce): "measure"
    calibrates this machine when the engine starts (rank 0's figures, shared by all ranks), a
    preset name from `fxzero.cost.PRESETS`, a `fxzero.cost.CostModel`, or None (native
    collectives, no choices)."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"Config.stage must be 1, 2 or 3, got {self.stage!r}")
        if not isinstance(self.units, UnitsPolicy):
            raise TypeError(f"Config.units must be a fxzero.UnitsPolicy, got {type(self.units).__name__}")
        if not isinstance(self.optimizer, AdamW):
            raise TypeError(f"Config.optimizer must be a fxzero.AdamW, got {type(self.optimizer).__name__}")
        if self.prefetch is not None and not isinstance(self.prefetch, Prefetch):
            raise TypeError(f"Config.prefetch must be a fxzero.Prefetch or None, got {type(self.prefetch).__name__}")
        if not (self.cost_model is None or isinstance(self.cost_model, str) or hasattr(self.cost_model, "links")):
            raise TypeError(
                f"Config.cost_model must be 'measure', a preset name, a fxzero.cost.CostModel or "
                f"None, got {type(self.cost_model).__name__}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"Config.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.offload, Offload):
            raise TypeError(f"Config.offload must be a fxzero.Offload, got {type(self.offload).__name__}")
        if self.offload.offloaded("param") and self.stage != 3:
            raise ValueError(
                f"Config.offload.params={self.offload.params!r} needs stage=3: at stage {self.stage} "
                "every rank holds the whole parameters; offload the optimizer states instead "
                "(Offload(optimizer=...)), or use stage=3"
            )
        if self.persist_threshold < 0:
            raise ValueError(f"Config.persist_threshold must be >= 0 parameters, got {self.persist_threshold}")

    def persistent(self, numel: int) -> bool:
        """Whether a unit of `numel` parameters is held whole for the whole step."""
        return self.stage in (1, 2) or numel < self.persist_threshold

    @classmethod
    def from_deepspeed(cls, ds: Union[dict[str, Any], str, os.PathLike]) -> "Config":
        """Build a Config from a DeepSpeed config dict or JSON file (the keys fxzero understands)."""
        if not isinstance(ds, dict):
            with open(ds) as f:
                ds = json.load(f)
        stage = int(ds.get("zero_optimization", {}).get("stage", 3))
        opt = ds.get("optimizer", {})
        if opt and opt.get("type", "AdamW").lower() not in ("adam", "adamw"):
            raise ValueError(
                f"optimizer type {opt.get('type')!r} is not supported; fxzero runs AdamW "
                "(set \"optimizer\": {\"type\": \"AdamW\", ...})"
            )
        params = opt.get("params", {})
        adamw = AdamW(
            lr=float(params.get("lr", 1e-3)),
            betas=tuple(params.get("betas", (0.9, 0.999))),
            eps=float(params.get("eps", 1e-8)),
            weight_decay=float(params.get("weight_decay", 1e-2)),
        )
        zero = ds.get("zero_optimization", {})
        threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if stage == 3 else 0
        # A reuse distance of 0 releases every parameter after use: gather each unit twice.
        prefetch = Prefetch(keep_for_backward=int(zero.get("stage3_max_reuse_distance", 1)) > 0)
        offload = Offload(
            params=_placement_from_deepspeed(zero.get("offload_param", {}), "offload_param"),
            optimizer=_placement_from_deepspeed(zero.get("offload_optimizer", {}), "offload_optimizer"),
        )
        return cls(stage=stage, optimizer=adamw, persist_threshold=threshold, offload=offload, prefetch=prefetch)

"""Placement of model states: the device, host memory or NVMe (ZeRO-Offload / ZeRO-Infinity)."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional, Union

from fxzero.config.policies import OPTIMIZERS, AdamW, OptimizerPolicy

__all__ = ["OPTIMIZER_STATES", "Cpu", "Device", "Nvme", "Offload", "Placement", "state_kinds"]


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
    """Memory for write-behind (fxzero/runtime/storage/write_behind.py): a write that fits is copied
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

OPTIMIZER_STATES: frozenset[str] = frozenset(state for policy in OPTIMIZERS for state in policy.STATES)
"""Every optimizer state kind some policy declares ("exp_avg", "exp_avg_sq", "sum"): each is
placed where `Offload.optimizer` says."""


def state_kinds(optimizer: OptimizerPolicy) -> tuple[str, ...]:
    """The per-unit states a placement applies to, training with `optimizer`: the parameter
    shard, the gradient shard and each state the optimizer declares ([Note: optimizer states]
    in `policies.py`: AdamW's "exp_avg" and "exp_avg_sq", Adagrad's "sum")."""
    return ("param", "grad", *optimizer.states)


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
    """The optimizer's states for this rank's shard, every one its policy declares (AdamW's
    exp_avg and exp_avg_sq, Adagrad's sum)."""
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
        if self.step_in_backward and not (self.offloaded("param") and self.offloaded("optimizer")):
            raise ValueError(
                "Offload(step_in_backward=True) updates units from the states the backward streams "
                "through memory: offload both params= and optimizer= (to Cpu() or Nvme(...))"
            )

    @property
    def grads_placement(self) -> Placement:
        return self.optimizer if self.grads is None else self.grads

    def placement(self, kind: str) -> Placement:
        """Placement of a state kind: "param", "grad", or one of an optimizer's states
        (`OPTIMIZER_STATES`; "optimizer" stands for any of them); also "low", mixed precision's
        low-precision copy of the parameters, which lives with them."""
        if kind in ("param", "low"):
            return self.params
        if kind == "grad":
            return self.grads_placement
        if kind == "optimizer" or kind in OPTIMIZER_STATES:
            return self.optimizer
        raise ValueError(f"unknown state kind {kind!r}: one of 'param', 'low', 'grad', 'optimizer' or an "
                         f"optimizer's state {sorted(OPTIMIZER_STATES)}")

    def offloaded(self, kind: str) -> bool:
        return not isinstance(self.placement(kind), Device)

    def tiers(self, mixed_precision: bool = False, optimizer: OptimizerPolicy = AdamW()) -> dict[str, str]:
        """State kind -> tier name, for the states placed off the device (`state_kinds(optimizer)`;
        "low" too, with mixed precision and offloaded parameters)."""
        kinds = state_kinds(optimizer) + (("low",) if mixed_precision else ())
        return {k: self.placement(k).tier for k in kinds if self.offloaded(k)}

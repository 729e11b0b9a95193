"""This rank's model states: parameter storage, buffers, gradients and the optimizer's states.

`RankState` is what the engine trains and what a checkpoint would save: per unit, this rank's
parameter shard (or, for a unit held whole, its full flat buffer; or nothing, where the shard
lives on a tier of the offload store), the model's buffers, the gradients the last backward
left (possibly still in flight) and the optimizer's per-element states (those its policy
declares: AdamW's two moments, Adagrad's sum) and step counts. It also answers for
them as the user sees them: the full state dict and the memory report.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

from fxzero.ir.layout import UnitLayout
from fxzero.runtime.comm import Comm, Pending
from fxzero.runtime.storage.offload_store import OffloadStore

__all__ = ["RankState", "install", "state_dict_keys", "storage_bytes"]


def state_dict_keys(model: nn.Module) -> list[str]:
    """The keys `model.state_dict()` has, in its order (parameters, aliases included, and
    persistent buffers), read without calling it, so no state-dict hook runs."""
    return list(model.state_dict(keep_vars=True))  # (keep_vars: the user module's hooks gather nothing)


def install(current: Optional[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """`values` into `current` in place where it fits (views of it stay current), else itself."""
    if current is not None and current.shape == values.shape and current.dtype == values.dtype:
        return current.copy_(values)
    return values


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@dataclasses.dataclass
class RankState:
    layouts: list[UnitLayout]
    whole: frozenset[str]
    """Units held whole (their `params` entry is the full flat buffer): every unit at ZeRO-1/2,
    units under the persistence threshold at ZeRO-3."""
    params: dict[str, torch.Tensor]
    """This rank's parameter storage per unit, but the units in `offloaded_params`."""
    buffers: dict[str, torch.Tensor]
    offloaded_params: frozenset[str] = frozenset()
    """Units whose parameter shards live in `store`."""
    rank_of_shards: int = 0
    """This rank: which slice of each unit's flat buffer `params` holds."""
    store: Optional[OffloadStore] = None
    grads: dict[str, Any] = dataclasses.field(default_factory=dict)
    """unit -> gradient shard, or its reduce-scatter still in flight (a `Pending`), or the
    token of its write to a tier."""
    optimizer_states: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """unit -> state name -> this rank's shard of it, for the units whose optimizer states live
    on the device (created at their first read, `optimizer_state`)."""
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    """The optimizer's step count per unit (wherever its states live)."""
    low: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Mixed precision: per unit, the copy of its parameters in the compute dtype that the forward
    and backward read and gather (this rank's shard, or a unit held whole's full buffer); then
    `params` holds the fp32 master shards, a shard even for a unit held whole. Empty in fp32, and
    where the masters are in the compute dtype ([Note: low-precision masters])."""
    optimizer_dtype: Optional[torch.dtype] = None
    """The dtype of the optimizer's states (`MixedPrecision.optimizer_dtype`); None: the masters'."""
    device: torch.device = torch.device("cpu")
    """The rank's device, whose memory holds what is not on a tier ([Note: buffer kinds] in
    `fxzero/runtime/device.py`)."""

    def compute_params(self, unit: str) -> Optional[torch.Tensor]:
        """What the forward and backward read for `unit` (None: its shard is on a tier)."""
        return self.low.get(unit, self.params.get(unit))

    def master_is_whole(self, unit: str) -> bool:
        return unit in self.whole and not self.low

    def layout(self, unit: str) -> UnitLayout:
        return next(lay for lay in self.layouts if lay.name == unit)

    def state_dtype(self, unit: str) -> torch.dtype:
        """The dtype `unit`'s optimizer states are held in."""
        return self.optimizer_dtype or self.layout(unit).dtype

    def optimizer_state(self, unit: str, state: str, initial: float) -> torch.Tensor:
        """`unit`'s optimizer state `state` ("exp_avg", "sum", ...), where its optimizer states live
        on the device; filled with `initial` (its policy's initial value) at the first read."""
        held = self.optimizer_states.setdefault(unit, {})
        if state not in held:
            layout = self.layout(unit)
            held[state] = torch.full((layout.shard_numel,), initial, dtype=self.state_dtype(unit), device=self.device)
        return held[state]

    def settle_grads(self) -> None:
        """Wait for the gradients the backward left in flight (the step program waits for them
        one by one, before each unit's update; see [Note: gradients carried into the step])."""
        for unit, grad in self.grads.items():
            if isinstance(grad, Pending):
                self.grads[unit] = grad.wait()

    def local_shard(self, unit: str, compute: bool = False) -> torch.Tensor:
        """This rank's shard of `unit`'s flat buffer, wherever it lives: the fp32 master, or with
        `compute` the copy in the compute dtype (the master itself in fp32)."""
        layout = self.layout(unit)
        if compute and unit in self.offloaded_params and self.store.has("low", unit):
            return self.store.get("low", unit)  # (mixed precision: the copy lives on the tier beside the master)
        if compute and unit in self.low:
            low = self.low[unit]
            if unit in self.whole:
                lo, hi = layout.shard_range(self.rank_of_shards)
                return low[lo:hi]
            return low
        if unit in self.offloaded_params:
            return self.store.get("param", unit)
        if self.master_is_whole(unit):
            lo, hi = layout.shard_range(self.rank_of_shards)
            return self.params[unit][lo:hi]
        return self.params[unit]

    def whole_buffer(self, unit: str, compute: bool = False) -> Optional[torch.Tensor]:
        """`unit`'s whole flat buffer where this rank holds it (else None): the fp32 masters, or
        with `compute` the values in the compute dtype."""
        if unit in self.offloaded_params or unit not in self.whole:
            return None
        if compute and unit in self.low:
            return self.low[unit]
        return self.params[unit] if self.master_is_whole(unit) or unit not in self.low else None

    def full_unit(self, unit: str, comm: Comm, compute: bool = False) -> torch.Tensor:
        """`unit`'s whole flat buffer (padding included), a new tensor: the fp32 masters, or with
        `compute` the values in the compute dtype. A collective where the unit is sharded (every
        rank calls it for the same units in the same order); uncounted in comm_report()."""
        layout = self.layout(unit)
        whole = self.whole_buffer(unit, compute)
        if whole is not None:
            return whole.clone()
        shard = self.local_shard(unit, compute)
        flat = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather(flat, shard.contiguous(), count=False).wait()
        return flat

    @torch.no_grad()
    def install_unit(self, unit: str, values: Callable[[int, int], torch.Tensor],
                     low_dtype: Optional[torch.dtype]) -> None:
        """Replace `unit`'s parameter values on this rank with `values(lo, hi)` (elements [lo, hi)
        of its flat buffer, in the master dtype), wherever they live: the master shard (or a unit
        held whole's full buffer), and with mixed precision its copy in `low_dtype` computed from
        it, as the step program computes it. Buffers already held are written in place, so views
        of them (the user's module, [Note: the user's module]) stay current."""
        layout = self.layout(unit)
        lo, hi = layout.shard_range(self.rank_of_shards)
        if unit in self.whole:
            full = values(0, layout.padded_numel)
            if unit in self.low:
                self.low[unit] = install(self.low[unit], full.to(low_dtype))
                self.params[unit] = install(self.params.get(unit), full[lo:hi].clone())
            else:
                self.params[unit] = install(self.params.get(unit), full)
            return
        shard = values(lo, hi)
        if unit in self.offloaded_params:
            self.store.put("param", unit, shard)
            if low_dtype is not None and shard.is_floating_point() and self.store.has("low", unit):
                self.store.put("low", unit, shard.to(low_dtype))  # (none where the masters are the compute copy)
            return
        self.params[unit] = install(self.params.get(unit), shard)
        if unit in self.low:
            self.low[unit] = install(self.low[unit], shard.to(low_dtype))

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module, comm: Comm, compute: bool = False) -> dict[str, torch.Tensor]:
        """Full parameters and this rank's buffers, keyed like `model.state_dict()`: the fp32
        masters, or with `compute` the values in the compute dtype.

        A collective: every rank must call it. Its traffic is not counted in comm_report().
        """
        full: dict[str, torch.Tensor] = {}
        for layout in self.layouts:
            flat = self.full_unit(layout.name, comm, compute)
            for slot in layout.slots:
                slot.read_into(flat, full)
        out = {}
        first: dict[int, str] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            out[fqn] = full[first.setdefault(id(p), fqn)]
        for fqn, _ in model.named_buffers(remove_duplicate=False):
            out[fqn] = self.buffers[fqn].clone()
        return {k: out[k] for k in state_dict_keys(model) if k in out}

    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds now, by category (gradients in flight are settled first).

        param_shards counts all parameter storage (with mixed precision: the fp32 master shards and
        the low-precision copies), of which persistent_params is held whole.
        Categories count resident memory only; `offloaded` is bytes per storage tier. Counted
        from the storages held (a view of a larger buffer counts the whole buffer), not
        estimated from sizes. `device_bytes` and `host_bytes` split what the rank holds by
        memory ([Note: buffer kinds] in `fxzero/runtime/device.py`): on a CUDA rank, the states
        in GPU memory and, in host memory, the cpu tier's; on a CPU rank host memory is the
        device's, and the cpu tier is counted in `offloaded` only.
        """
        self.settle_grads()
        params = storage_bytes([*self.params.values(), *self.low.values()])
        grads = storage_bytes(self.grads.values())
        optim = storage_bytes(t for states in self.optimizer_states.values() for t in states.values())
        held_whole = self.low if self.low else self.params
        resident = [*self.params.values(), *self.low.values(), *self.buffers.values(),
                    *(g for g in self.grads.values() if isinstance(g, torch.Tensor)),
                    *(t for states in self.optimizer_states.values() for t in states.values())]
        tiers = self.store.held_bytes() if self.store is not None else {}
        return {
            "device_bytes": storage_bytes(t for t in resident if t.device.type == self.device.type),
            "host_bytes": storage_bytes(t for t in resident if t.device.type != self.device.type)
            + (tiers.get("cpu", 0) if self.device.type != "cpu" else 0),
            "param_shards": params,
            "persistent_params": storage_bytes(t for u, t in held_whole.items() if u in self.whole),
            "grad_shards": grads,
            "optimizer_states": optim,
            "model_states": params + grads + optim,
            "buffers": storage_bytes(self.buffers.values()),
            "offloaded": self.store.held_bytes() if self.store is not None else {},
        }

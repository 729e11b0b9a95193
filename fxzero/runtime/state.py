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
from typing import Any, Iterable, Optional

import torch
import torch.nn as nn

from fxzero.ir.layout import UnitLayout
from fxzero.runtime.comm import Comm, Pending
from fxzero.runtime.storage.offload_store import OffloadStore

__all__ = ["RankState", "storage_bytes"]


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
    `params` holds the fp32 master shards, a shard even for a unit held whole. Empty in fp32."""

    def compute_params(self, unit: str) -> Optional[torch.Tensor]:
        """What the forward and backward read for `unit` (None: its shard is on a tier)."""
        return self.low.get(unit, self.params.get(unit))

    def master_is_whole(self, unit: str) -> bool:
        return unit in self.whole and not self.low

    def layout(self, unit: str) -> UnitLayout:
        return next(lay for lay in self.layouts if lay.name == unit)

    def optimizer_state(self, unit: str, state: str, initial: float) -> torch.Tensor:
        """`unit`'s optimizer state `state` ("exp_avg", "sum", ...), where its optimizer states live
        on the device; filled with `initial` (its policy's initial value) at the first read."""
        held = self.optimizer_states.setdefault(unit, {})
        if state not in held:
            layout = self.layout(unit)
            held[state] = torch.full((layout.shard_numel,), initial, dtype=layout.dtype)
        return held[state]

    def settle_grads(self) -> None:
        """Wait for the gradients the backward left in flight (the step program waits for them
        one by one, before each unit's update; see [Note: gradients carried into the step])."""
        for unit, grad in self.grads.items():
            if isinstance(grad, Pending):
                self.grads[unit] = grad.wait()

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
        """Full parameters and this rank's buffers, keyed like `model.state_dict()`.

        A collective: every rank must call it. Its traffic is not counted in comm_report().
        """
        full: dict[str, torch.Tensor] = {}
        for layout in self.layouts:
            if self.master_is_whole(layout.name):
                flat = self.params[layout.name]
            else:
                shard = self.params.get(layout.name)
                if layout.name in self.offloaded_params:
                    shard = self.store.get("param", layout.name)
                flat = torch.empty(layout.padded_numel, dtype=layout.dtype)
                comm.all_gather(flat, shard, count=False).wait()
            for slot in layout.slots:
                full[slot.fqn] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        out = {}
        first: dict[int, str] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            out[fqn] = full[first.setdefault(id(p), fqn)]
        for fqn, _ in model.named_buffers(remove_duplicate=False):
            out[fqn] = self.buffers[fqn].clone()
        order = list(model.state_dict(keep_vars=True).keys())
        return {k: out[k] for k in order if k in out}

    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds now, by category (gradients in flight are settled first).

        param_shards counts all parameter storage (with mixed precision: the fp32 master shards and
        the low-precision copies), of which persistent_params is held whole.
        Categories count resident memory only; `offloaded` is bytes per storage tier. Counted
        from the storages held (a view of a larger buffer counts the whole buffer), not
        estimated from sizes.
        """
        self.settle_grads()
        params = storage_bytes([*self.params.values(), *self.low.values()])
        grads = storage_bytes(self.grads.values())
        optim = storage_bytes(t for states in self.optimizer_states.values() for t in states.values())
        held_whole = self.low if self.low else self.params
        return {
            "param_shards": params,
            "persistent_params": storage_bytes(t for u, t in held_whole.items() if u in self.whole),
            "grad_shards": grads,
            "optimizer_states": optim,
            "model_states": params + grads + optim,
            "buffers": storage_bytes(self.buffers.values()),
            "offloaded": self.store.held_bytes() if self.store is not None else {},
        }

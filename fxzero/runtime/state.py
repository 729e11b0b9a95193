"""An engine's state as the user sees it: the full state dict and the memory report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:  # the engine calls these; only its type is named here
    from fxzero.runtime.engine import Engine

__all__ = ["full_state_dict", "memory_report", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@torch.no_grad()
def full_state_dict(engine: "Engine") -> dict[str, torch.Tensor]:
    """Full parameters and this rank's buffers, keyed like `model.state_dict()`.

    A collective: every rank must call it. Its traffic is not counted in comm_report().
    """
    full: dict[str, torch.Tensor] = {}
    for layout in engine.layouts:
        if layout.name in engine._whole:
            flat = engine._params[layout.name]
        else:
            shard = engine._params.get(layout.name)
            if layout.name in engine._offloaded_params:
                shard = engine.store.get("param", layout.name)
            flat = torch.empty(layout.padded_numel, dtype=layout.dtype)
            engine.comm.all_gather(flat, shard, count=False).wait()
        for slot in layout.slots:
            full[slot.fqn] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
    model = engine._model
    out = {}
    first: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        out[fqn] = full[first.setdefault(id(p), fqn)]
    for fqn, _ in model.named_buffers(remove_duplicate=False):
        out[fqn] = engine._buffers[fqn].clone()
    order = list(model.state_dict(keep_vars=True).keys())
    return {k: out[k] for k in order if k in out}


def memory_report(engine: "Engine") -> dict[str, Any]:
    """Bytes this rank holds now, by category, plus the peak of gathered buffers.

    param_shards counts all parameter storage, of which persistent_params is held whole
    (persistent units: every unit at ZeRO-1/2, units under the threshold at ZeRO-3).
    Categories count resident memory only; `offloaded` is bytes per storage tier, and
    staged / staged_peak the shards fetched from a tier and not yet released.

    Counted from the storages the engine holds (a view of a larger buffer counts the whole
    buffer), not estimated from sizes. Gradients in flight must be settled first.
    """
    params = storage_bytes(engine._params.values())
    persistent = storage_bytes(t for u, t in engine._params.items() if u in engine._whole)
    grads = storage_bytes(engine._grads.values())
    optim = storage_bytes(t for moments in engine._moments.values() for t in moments)
    gathered = engine._gathered
    return {
        "param_shards": params,
        "persistent_params": persistent,
        "grad_shards": grads,
        "optimizer_states": optim,
        "model_states": params + grads + optim,
        "buffers": storage_bytes(engine._buffers.values()),
        "gathered": gathered.current,
        "gathered_peak": gathered.peak,
        "staged": gathered.staged,
        "staged_peak": gathered.staged_peak,
        "offloaded": engine.store.held_bytes() if engine.store is not None else {},
    }

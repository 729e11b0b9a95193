"""Materialize each rank's parameter storage unit by unit, never the whole model at once.

Three sources, in order of precedence:
1. a full `state_dict` (e.g. loaded from a checkpoint): each parameter is read and only the
   part in this rank's range is copied;
2. the model's own tensors, when they are real (not on the meta device);
3. the model's own initialization, replayed under `Config.seed` on every rank alike
   (`fxzero.runtime.init_replay`): each layer's `reset_parameters()` as constructed, then a
   Hugging Face model's `post_init()` init (`_init_weights`), or a plain model's
   `self.apply(self._init_weights)`. This reproduces the values of eager construction under
   `torch.manual_seed(seed)`, tied parameters included.

In every case only one module's (or one parameter's) full tensors exist at a time; with an
`_init_weights` of a parent module, also the children's tensors it writes.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn

from fxzero.ir.layout import ParamSlot, UnitLayout, unique_parameters
from fxzero.runtime.init_replay import initial_values

__all__ = ["broadcast_initial_values", "materialize", "rng_from"]


def _alias_to_unique(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied aliases included) -> the FQN fxzero uses for it."""
    first: dict[int, str] = {}
    out = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        out[fqn] = first.setdefault(id(p), fqn)
    return out


class _Sink:
    """Receives full parameter values one at a time and keeps this rank's part of each unit.

    A unit's buffer is allocated when its first parameter arrives. A unit in `spill` is handed
    to `spill_to(unit, buffer)` as soon as its last parameter arrives and is not kept, so a
    model whose shards go to a storage tier never has more than a few units in memory.
    """

    def __init__(self, layouts: list[UnitLayout], rank: int, whole: frozenset[str],
                 spill: frozenset[str] = frozenset(),
                 spill_to: Optional[Callable[[str, torch.Tensor], None]] = None,
                 device: torch.device = torch.device("cpu")) -> None:
        self.whole = whole
        self.device = device
        self.rank = rank
        self.spill, self.spill_to = spill, spill_to
        self.layouts = {layout.name: layout for layout in layouts}
        self.where: dict[str, list[tuple[UnitLayout, ParamSlot]]] = {}  # (several: a tiled parameter's tiles)
        self.storage: dict[str, torch.Tensor] = {}
        self.remaining: dict[str, set[str]] = {}
        for layout in layouts:
            self.remaining[layout.name] = {slot.fqn for slot in layout.slots}
            for slot in layout.slots:
                self.where.setdefault(slot.fqn, []).append((layout, slot))
        self.filled: set[str] = set()

    def _buffer(self, layout: UnitLayout) -> torch.Tensor:
        if layout.name not in self.storage:
            n = layout.padded_numel if layout.name in self.whole else layout.shard_numel
            # (a unit spilled to a tier is assembled in host memory, where the tier keeps it)
            where = "cpu" if layout.name in self.spill else self.device
            self.storage[layout.name] = torch.zeros(n, dtype=layout.dtype, device=where)
        return self.storage[layout.name]

    def put(self, fqn: str, value: torch.Tensor) -> None:
        for layout, slot in self.where[fqn]:
            self._put(layout, slot, fqn, value)

    def _put(self, layout: UnitLayout, slot: ParamSlot, fqn: str, value: torch.Tensor) -> None:
        if tuple(value.shape) != slot.full_shape:
            raise ValueError(f"{fqn}: got shape {tuple(value.shape)}, the model has {slot.full_shape}")
        flat = value.detach().reshape(-1)[slot.start : slot.start + slot.numel].to(layout.dtype)
        buffer = self._buffer(layout)
        if layout.name in self.whole:
            buffer[slot.offset : slot.offset + slot.numel].copy_(flat)
        else:
            lo, hi = layout.shard_range(self.rank)
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                buffer[a - lo : b - lo].copy_(flat[a - slot.offset : b - slot.offset])
        self.filled.add(fqn)
        self.remaining[layout.name].discard(fqn)
        if not self.remaining[layout.name] and layout.name in self.spill:
            self.spill_to(layout.name, self.storage.pop(layout.name))

    def missing(self) -> list[str]:
        return sorted(set(self.where) - self.filled)


def materialize(
    model: nn.Module,
    layouts: list[UnitLayout],
    *,
    rank: int,
    whole: frozenset[str],
    state_dict: Optional[Mapping[str, torch.Tensor]] = None,
    seed: int = 0,
    spill: frozenset[str] = frozenset(),
    spill_to: Optional[Callable[[str, torch.Tensor], None]] = None,
    stats: Optional[dict] = None,
    device: torch.device = torch.device("cpu"),
    holder: Optional[int] = None,
    holder_rng: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's flat parameter storage per unit, and the model's buffers (full), in `device`'s
    memory ([Note: buffer kinds] in `fxzero/runtime/device.py`); the values are computed on the
    CPU (the model's init, a state dict's tensors) one parameter at a time and copied in.

    Args:
        whole: units whose whole flat buffer this rank keeps (persistent units), rather than
            its shard.
        holder: the rank whose model holds every value whole, the others' being meta (a model
            built under `zero.Init` and gathered before initialize): each parameter and buffer is
            broadcast from it, one at a time. A collective.
        holder_rng: then also put every rank's global RNG where the holder's is (the ranks drew
            alike until the model was first gathered: [Note: parameters made beside a held
            model] in fxzero/zero.py).
        spill, spill_to: units whose shard is handed to `spill_to(unit, shard)` as soon as it is
            complete (e.g. written to an NVMe tier) instead of returned.
        stats: if given and the model's own init runs, `stats["peak_bytes"]` is set to the
            most bytes of full (unsharded) tensors it held at once.

    Raises:
        ValueError: if the state_dict lacks parameters or has wrong shapes, or a parameter on
            the meta device has no value and nothing in the model's init sets it.
    """
    sink = _Sink(layouts, rank, whole, spill, spill_to, device)
    buffers: dict[str, torch.Tensor] = {}
    buffer_fqns = [fqn for fqn, _ in model.named_buffers()]
    if state_dict is not None:
        aliases = _alias_to_unique(model)
        for key in state_dict:
            if key in aliases and aliases[key] == key:
                sink.put(key, state_dict[key])
        for fqn in buffer_fqns:
            if fqn in state_dict:
                buffers[fqn] = state_dict[fqn].detach().clone()
    elif holder is not None:  # whole on one rank only ([Note: gathering before initialize] in fxzero/zero.py)
        import torch.distributed as dist

        def from_holder(t: torch.Tensor) -> torch.Tensor:  # (a collective: every rank, the same order)
            value = t.detach() if rank == holder else torch.empty(t.shape, dtype=t.dtype)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(value, src=holder)
            return value

        for fqn, p in unique_parameters(model).items():
            sink.put(fqn, from_holder(p))
        for fqn, b in model.named_buffers():
            buffers[fqn] = from_holder(b).clone()
        if holder_rng:
            rng_from(holder)
    elif not any(p.is_meta for p in model.parameters()):
        for fqn, p in unique_parameters(model).items():
            sink.put(fqn, p)
    else:
        for what, fqn, value in initial_values(model, seed, stats):
            if what == "param":
                sink.put(fqn, value)
            else:
                buffers[fqn] = value.detach().clone()
    for fqn, b in model.named_buffers():
        if fqn not in buffers:
            if b.is_meta:
                raise ValueError(
                    f"buffer {fqn!r} is on the meta device and no value was given for it; "
                    "include it in state_dict=, give its module a reset_parameters(), or set it in "
                    "the model's _init_weights(module)"
                )
            buffers[fqn] = b.detach().clone()
    missing = sink.missing()
    if missing:
        raise ValueError(
            f"no value for parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}: the "
            "state_dict passed to fxzero.compile must hold every parameter of the model"
        )
    buffers = {fqn: b.to(device) for fqn, b in buffers.items()}
    return {lay.name: sink.storage[lay.name] for lay in layouts if lay.name not in spill}, buffers


_BROADCAST_CHUNK = 64 << 20  # bytes per broadcast: few calls, and little more memory than one layer


@torch.no_grad()
def broadcast_initial_values(model: nn.Module, group=None) -> int:
    """Make every rank's parameters and buffers rank 0's, in place (as DeepSpeed and FSDP's
    sync_module_states do): a model built eagerly draws its own random init on each rank, and
    sharding a mix of inits would train a model no rank ever had. Returns the bytes broadcast.

    Tensors of one dtype are broadcast in chunks of about 64 MiB, each flattened into one buffer.
    """
    import torch.distributed as dist

    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if not t.is_meta:
            by_dtype.setdefault(t.dtype, []).append(t)
    sent = 0
    for same in by_dtype.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for i, t in enumerate(same):
            chunk.append(t)
            size += t.numel() * t.element_size()
            if i + 1 == len(same) or size >= _BROADCAST_CHUNK:
                flat = torch.cat([c.detach().reshape(-1) for c in chunk])
                dist.broadcast(flat, src=0, group=group)
                offset = 0
                for c in chunk:
                    c.data.copy_(flat[offset : offset + c.numel()].view_as(c))
                    offset += c.numel()
                sent += size
                chunk, size = [], 0
    return sent


def rng_from(holder: int) -> None:
    """Every rank's global CPU RNG put where `holder`'s is (a collective)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        state = torch.random.get_rng_state()
        dist.broadcast(state, src=holder)
        torch.random.set_rng_state(state)

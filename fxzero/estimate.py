"""Per-rank memory of model states (parameters, gradients, optimizer states) by ZeRO stage.

Two accountings, one set of rules:

- `runtime_model_states(layouts, stage)` counts what fxzero's runtime allocates, unit by unit,
  from the same `UnitLayout`s (`fxzero.units.plan_units`), padding included:

  ====== ============================ ============================ ==========================
  stage  parameters                   gradients                    optimizer states
  ====== ============================ ============================ ==========================
  0      full (no ZeRO: DDP)          full                         full
  1      full flat buffer (padded)    full flat buffer (padded)    this rank's shard
  2      full flat buffer (padded)    this rank's shard            this rank's shard
  3      this rank's shard            this rank's shard            this rank's shard
  ====== ============================ ============================ ==========================

  Frozen units have no gradient and no optimizer state. Units listed as `persistent` are held
  whole at stage 3 too (a persistence threshold).

- `paper_model_states(phi, world, stage)` is the ZeRO paper's arithmetic for Phi parameters on
  N ranks, no padding: mixed precision with Adam (2 + 2 + 12 bytes per parameter) gives
  16 Phi, 4 Phi + 12 Phi/N, 2 Phi + 14 Phi/N and 16 Phi/N for stages 0-3.

Precision "fp32" is how fxzero trains today (4-byte params and grads, two 4-byte moments; the
model's own dtype in the runtime accounting); "mixed" is the paper's 2 + 2 + 12 (the 12 being
fp32 master weights and two moments), used for comparison with DeepSpeed's figures.

Both take the optimizer (`optimizer=`, default AdamW): its states are 4 bytes each per element,
as many as its policy declares ([Note: optimizer states] in `fxzero/config/policies.py`), so
the optimizer's bytes per parameter are 4 x states in fp32 and 4 + 4 x states (the fp32 master
too) in mixed precision: AdamW's 8 and 12 (16 bytes of model states in fp32), Adagrad's 4 and
8 (12 bytes in fp32, 2 + 2 + 8 mixed).

`place(states, stage, offload)` splits them over the tiers a `fxzero.Offload` names, by the
rules the runtime follows: optimizer states go where `Offload.optimizer` says, gradients where
`Offload.grads` says (with the optimizer states when unset) once they are sharded (stage 2 and
3; at stage 1 the full gradient buffer stays on the device), and parameter shards where
`Offload.params` says (stage 3 only).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Literal, Optional

from fxzero.config import AdamW, MixedPrecision, Offload, OptimizerPolicy
from fxzero.ir.layout import UnitLayout

__all__ = [
    "BYTES_PER_PARAM",
    "AccumulationCost",
    "accumulation_costs",
    "ModelStates",
    "BytesByTier",
    "bytes_per_param",
    "paper_model_states",
    "place",
    "runtime_model_states",
]

Precision = Literal["fp32", "mixed"]

STATE_BYTES = 4
"""Bytes per element of each optimizer state (fp32, whatever the compute dtype)."""


def bytes_per_param(precision: Precision, optimizer: OptimizerPolicy = AdamW()) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter: the optimizer's states at 4 bytes
    each, and in mixed precision the fp32 master with them."""
    states = STATE_BYTES * len(optimizer.states)
    return (4, 4, states) if precision == "fp32" else (2, 2, STATE_BYTES + states)


BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {p: bytes_per_param(p) for p in ("fp32", "mixed")}
"""(parameter, gradient, optimizer) bytes per parameter with AdamW: fp32 (4, 4, 8), mixed (2, 2, 12)."""

STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds (floats: the paper's formulas divide by N)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclasses.dataclass(frozen=True)
class BytesByTier:
    """Bytes of one rank's model states on each tier."""

    device: float
    cpu: float = 0.0
    nvme: float = 0.0

    @property
    def total(self) -> float:
        return self.device + self.cpu + self.nvme

    def to_json(self) -> dict:
        return {"device": self.device, "cpu": self.cpu, "nvme": self.nvme, "total": self.total}


def _check(stage: int, precision: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be 0 (no ZeRO), 1, 2 or 3, got {stage!r}")
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_PARAM)}, got {precision!r}")


def paper_model_states(phi: float, world: int, stage: int, precision: Precision = "mixed", *,
                       optimizer: OptimizerPolicy = AdamW()) -> ModelStates:
    """The ZeRO paper's per-rank model states for `phi` parameters on `world` ranks (the paper's
    Adam by default; `optimizer`'s own states otherwise, `bytes_per_param`)."""
    _check(stage, precision)
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    p, g, o = bytes_per_param(precision, optimizer)
    shard_params, shard_grads, shard_optim = stage >= 3, stage >= 2, stage >= 1
    return ModelStates(
        params=p * phi / world if shard_params else p * phi,
        grads=g * phi / world if shard_grads else g * phi,
        optimizer=o * phi / world if shard_optim else o * phi,
    )


def runtime_model_states(
    layouts: Iterable[UnitLayout],
    stage: int,
    precision: Precision = "fp32",
    *,
    persistent: frozenset[str] = frozenset(),
    mixed_precision: Optional[MixedPrecision] = None,
    optimizer: OptimizerPolicy = AdamW(),
) -> ModelStates:
    """Per-rank model states as fxzero's runtime allocates them for these unit layouts.

    With precision "fp32" the bytes per element are the layouts' own dtype (what the runtime
    really holds); with "mixed" they are what the engine holds under `mixed_precision` (default
    `MixedPrecision(reduce_dtype=None)`, the paper's 2 + 2 + 12: the low-precision copy, the
    gradient in the reduce dtype, the fp32 master and two moments), on the same padded layouts:
    its `master_dtype` (fp32, or the compute dtype, when the masters are the compute copy and no
    second copy is held: [Note: low-precision masters]) and its `optimizer_dtype` for the states.
    The optimizer's states are `optimizer`'s (AdamW's two moments by default; Adagrad's one sum).
    A frozen unit keeps its fp32 values beside its low-precision copy (what its state dict is
    made from), counted with the parameters. Stage 0 (no ZeRO) counts every parameter once,
    unpadded, as plain data parallelism does.
    """
    _check(stage, precision)
    if precision == "mixed" and mixed_precision is None:
        mixed_precision = MixedPrecision(reduce_dtype=None)
    states = len(optimizer.states)
    params = grads = optimizer_bytes = 0
    for u in layouts:
        frozen_master = 0
        if precision == "fp32":
            p, g, o = u.itemsize, u.itemsize, states * u.itemsize
        else:
            p, g = mixed_precision.param_dtype.itemsize, mixed_precision.grad_dtype.itemsize
            # A master apart from the compute copy (fp32 masters), and the optimizer's states:
            master = mixed_precision.master_dtype.itemsize if mixed_precision.low_dtype is not None else 0
            o = master + states * mixed_precision.optimizer_dtype.itemsize
            frozen_master = 0 if u.trainable else master
        if stage == 0:
            full = shard = u.numel
            whole_params = True
        else:
            full, shard = u.padded_numel, u.shard_numel
            whole_params = stage in (1, 2) or u.name in persistent
        params += (full if whole_params else shard) * p + shard * frozen_master
        if u.trainable:
            grads += (full if stage in (0, 1) else shard) * g
            optimizer_bytes += (full if stage == 0 else shard) * o
    return ModelStates(params, grads, optimizer_bytes)


@dataclasses.dataclass(frozen=True)
class AccumulationCost:
    """What `gradient_accumulation_steps` micro-steps cost per rank, under one policy."""

    grads_held: float
    """Gradient bytes held between micro-steps: the shards ("sharded"), or the full gradients
    ("local"; at stage 1 the full buffer is held either way)."""
    reduce_scatter_bytes: float
    """Bytes entering this rank's reduce-scatters per optimizer step (the full flat gradients)."""


def accumulation_costs(layouts: Iterable[UnitLayout], stage: int, steps: int,
                       grad_itemsize: int = 4) -> dict[str, AccumulationCost]:
    """Both policies of `Config.gradient_accumulation` over `steps` micro-steps, from the unit
    layouts the runtime allocates (trainable units; gradients of `grad_itemsize` bytes: fp32, or
    the reduce dtype under mixed precision): "sharded" reduce-scatters every micro-step into the
    shards, "local" keeps the full gradients and reduce-scatters once."""
    trainable = [u for u in layouts if u.trainable]
    full = sum(u.padded_numel for u in trainable) * grad_itemsize
    shard = sum(u.shard_numel for u in trainable) * grad_itemsize
    return {
        "sharded": AccumulationCost(grads_held=full if stage == 1 else shard, reduce_scatter_bytes=steps * full),
        "local": AccumulationCost(grads_held=full, reduce_scatter_bytes=full),
    }


def place(states: ModelStates, stage: int, offload: Optional[Offload] = None) -> BytesByTier:
    """Where `states` live under `offload` (see the module doc); no ZeRO (stage 0) offloads nothing."""
    if offload is None or stage == 0:
        return BytesByTier(device=states.total)
    tier = {"device": 0.0, "cpu": 0.0, "nvme": 0.0}
    tier[offload.optimizer.tier] += states.optimizer
    tier[offload.placement("grad").tier if stage >= 2 else "device"] += states.grads
    tier[offload.placement("param").tier if stage == 3 else "device"] += states.params
    return BytesByTier(**tier)


def largest_unit(layouts: Iterable[UnitLayout]) -> Optional[UnitLayout]:
    """The unit with the most elements: at stage 3 the biggest buffer gathered at once."""
    return max(layouts, key=lambda u: u.padded_numel, default=None)

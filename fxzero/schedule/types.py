"""The schedule's types: frozen, versioned, JSON round-trippable values.

A `Schedule` holds per program ("forward", "backward", "step") a `ProgramSchedule`: an ordered
tuple of `fxzero.ir.Instruction`s, each on a named stream with its dependencies, bytes and the
gathered buffers it touches, and the bytes of gathered buffers alive after each; plus the unit
layouts and a fingerprint of the collective sequence every rank must share.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from fxzero.ir.instruction import COLLECTIVES, Instruction
from fxzero.ir.layout import UnitLayout
from fxzero.ir.shapes import InputShapes

__all__ = ["SCHEDULE_VERSION", "Kept", "ProgramSchedule", "Schedule", "ScheduleError"]

SCHEDULE_VERSION = 2
"""2: instructions carry their buffer, tier, keep_full, aligned and dtype; the step program is a
graph program like the others; `kept` entries say what each buffer is."""


class ScheduleError(ValueError):
    """A schedule breaks one of the rules `validate` checks."""


@dataclasses.dataclass(frozen=True)
class Kept:
    """A buffer kept across the forward/backward boundary (`fxzero/passes/keep_for_backward.py`):
    an output of the forward program and an input of the backward program, which frees it."""

    name: str
    buffer: str
    """"gathered" (a unit's gathered parameters) or "fetched" (an offloaded parameter shard)."""
    unit: str
    bytes: int

    def to_json(self) -> list:
        return [self.name, self.buffer, self.unit, self.bytes]

    @classmethod
    def from_json(cls, d: list) -> "Kept":
        return cls(*d)


@dataclasses.dataclass(frozen=True)
class ProgramSchedule:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    instructions: tuple[Instruction, ...]
    gathered_bytes: tuple[int, ...]
    """Bytes of gathered parameter buffers alive after each instruction."""
    kept: tuple[Kept, ...] = ()
    """Buffers kept from the forward for the backward (outputs of the forward program, inputs of
    the backward program, which frees them)."""

    @property
    def kept_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kept)

    @property
    def peak_gathered_bytes(self) -> int:
        return max(self.gathered_bytes, default=0)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "instructions": [i.to_json() for i in self.instructions],
            "gathered_bytes": list(self.gathered_bytes),
            "kept": [k.to_json() for k in self.kept],
        }

    @classmethod
    def from_json(cls, d: dict) -> "ProgramSchedule":
        return cls(
            d["name"],
            tuple(d["inputs"]),
            tuple(d["outputs"]),
            tuple(Instruction.from_json(i) for i in d["instructions"]),
            tuple(d["gathered_bytes"]),
            tuple(Kept.from_json(k) for k in d.get("kept", ())),
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    version: int
    stage: int
    world_size: int
    units: tuple[UnitLayout, ...]
    programs: tuple[ProgramSchedule, ...]
    fingerprint: str
    persistent: tuple[str, ...] = ()
    """Units held whole for the whole step (ZeRO-1/2, or under the persistence threshold)."""
    prefetch_budget_bytes: Optional[int] = None
    """The prefetch pass's budget for gathered buffers alive at once (None: no prefetch)."""
    shapes: Optional[InputShapes] = None
    """The input sizes the schedule serves; where some are symbolic, the sizes its bytes, FLOPs
    and timelines are evaluated at ([Note: any size, one program] in `fxzero/ir/shapes.py`)."""
    device: str = "cpu"
    """The device type the programs were traced for, "cpu" or "cuda" ([Note: tracing for a device]
    in `fxzero/target_device.py`); a rank runs only a schedule for its own device type."""

    def program(self, name: str) -> ProgramSchedule:
        for p in self.programs:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def peak_gathered_bytes(self) -> int:
        return max(p.peak_gathered_bytes for p in self.programs)

    def _kept(self, buffer: str) -> tuple[str, ...]:
        """Units of the forward's kept buffers of one kind, in the order the forward made them."""
        forward = self.program("forward")
        position = {i.name: n for n, i in enumerate(forward.instructions)}
        kept = sorted((k for k in forward.kept if k.buffer == buffer), key=lambda k: position.get(k.name, -1))
        return tuple(k.unit for k in kept)

    @property
    def kept_for_backward(self) -> tuple[str, ...]:
        """Units whose forward gather the backward reuses (Prefetch.keep_for_backward)."""
        return self._kept("gathered")

    @property
    def shards_kept_for_backward(self) -> tuple[str, ...]:
        """Offloaded units whose parameter shard, fetched in the forward, the backward reuses."""
        return self._kept("fetched")

    def collectives(self) -> list[tuple[str, Instruction]]:
        return [(p.name, i) for p in self.programs for i in p.instructions if i.kind in COLLECTIVES]

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "stage": self.stage,
            "world_size": self.world_size,
            "units": [u.to_json() for u in self.units],
            "programs": [p.to_json() for p in self.programs],
            "fingerprint": self.fingerprint,
            "persistent": list(self.persistent),
            "prefetch_budget_bytes": self.prefetch_budget_bytes,
            "shapes": self.shapes.to_json() if self.shapes is not None else None,
            "device": self.device,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, d: dict) -> "Schedule":
        if d.get("version") != SCHEDULE_VERSION:
            raise ValueError(
                f"schedule version {d.get('version')!r} is not {SCHEDULE_VERSION}; "
                "recompile the model with this fxzero to get a current schedule"
            )
        return cls(
            d["version"],
            d["stage"],
            d["world_size"],
            tuple(UnitLayout.from_json(u) for u in d["units"]),
            tuple(ProgramSchedule.from_json(p) for p in d["programs"]),
            d["fingerprint"],
            tuple(d.get("persistent", ())),
            d.get("prefetch_budget_bytes"),
            InputShapes.from_json(d["shapes"]) if d.get("shapes") else None,
            d.get("device", "cpu"),
        )

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        return cls.from_json(json.loads(text))

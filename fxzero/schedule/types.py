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

__all__ = ["SCHEDULE_VERSION", "ProgramSchedule", "Schedule", "ScheduleError"]

SCHEDULE_VERSION = 1


class ScheduleError(ValueError):
    """A schedule breaks one of the rules `validate` checks."""


@dataclasses.dataclass(frozen=True)
class ProgramSchedule:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    instructions: tuple[Instruction, ...]
    gathered_bytes: tuple[int, ...]
    """Bytes of gathered parameter buffers alive after each instruction."""
    kept: tuple[str, ...] = ()
    """Buffers kept from the forward for the backward: gathered buffers
    (Prefetch.keep_for_backward) and fetched parameter shards (offloaded parameters, see
    passes/offload.py). Outputs of the forward program, inputs of the backward program, which
    frees them."""

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
            "kept": list(self.kept),
        }

    @classmethod
    def from_json(cls, d: dict) -> "ProgramSchedule":
        return cls(
            d["name"],
            tuple(d["inputs"]),
            tuple(d["outputs"]),
            tuple(Instruction.from_json(i) for i in d["instructions"]),
            tuple(d["gathered_bytes"]),
            tuple(d.get("kept", ())),
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

    def program(self, name: str) -> ProgramSchedule:
        for p in self.programs:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def peak_gathered_bytes(self) -> int:
        return max(p.peak_gathered_bytes for p in self.programs)

    def _kept(self, source: str) -> tuple[str, ...]:
        forward = self.program("forward")
        kept = set(forward.kept)
        kinds = {i.name: i.kind for i in forward.instructions}
        return tuple(i.unit for i in forward.instructions if i.name in kept and kinds.get(i.reads[0]) == source)

    @property
    def kept_for_backward(self) -> tuple[str, ...]:
        """Units whose forward gather the backward reuses (Prefetch.keep_for_backward)."""
        return self._kept("all_gather")

    @property
    def shards_kept_for_backward(self) -> tuple[str, ...]:
        """Offloaded units whose parameter shard, fetched in the forward, the backward reuses."""
        return self._kept("fetch")

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
        )

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        return cls.from_json(json.loads(text))

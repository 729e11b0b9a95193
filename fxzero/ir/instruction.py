"""`Instruction`: one step of a scheduled program, what the runtime executes and the viewers show.

An instruction is a node of a program's graph, lowered (`fxzero.ir.lower.instruction_of`) to
plain data: its kind, stream, what it reads, its unit, and the bytes, elements and FLOPs it
moves or computes. A `fxzero.schedule.ProgramSchedule` is an ordered tuple of them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["ASYNC", "COLLECTIVES", "IO", "STREAM_OF", "Instruction"]

COLLECTIVES = ("all_gather", "reduce_scatter")
IO = ("fetch", "offload")
"""Transfers between this rank's memory and a storage tier (rank-local: not in the fingerprint)."""
ASYNC = COLLECTIVES + IO
"""Instructions whose result is only valid after their wait."""
STREAM_OF = {"all_gather": "comm", "reduce_scatter": "comm", "fetch": "io", "offload": "io"}  # else "compute"


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    """The value it defines (the FX node name in its program's graph)."""
    kind: str
    """compute | all_gather | reduce_scatter | fetch | offload | wait | free | optim_step."""
    stream: str
    """compute | comm | io: collectives run on the comm stream, transfers to and from a storage
    tier (fetch, offload) on the io stream, everything else computes."""
    reads: tuple[str, ...] = ()
    """Values it reads (instruction names or program inputs)."""
    deps: tuple[int, ...] = ()
    """Indices of earlier instructions of the same program it must run after."""
    unit: Optional[str] = None
    touches: tuple[str, ...] = ()
    """Gathered buffers (names of the waits that produced them) it reads, directly or via views."""
    numel: int = 0
    """Elements moved (collectives) or produced (compute)."""
    bytes: int = 0
    """Bytes moved (collectives) or produced (compute)."""
    flops: int = 0
    """Floating point operations (compute; from torch's FLOP formulas, 0 where it has none)."""
    read_bytes: int = 0
    """Bytes of the tensors it reads (compute), for a memory-bound time estimate."""
    algorithm: str = ""
    """How a collective is carried out, when not natively (e.g. a reduce-scatter as all_reduce);
    for a fetch or offload, the tier ("cpu", "nvme")."""
    state: str = ""
    """For a fetch or offload: which state of the unit it moves (one of STATE_KINDS)."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict) -> "Instruction":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

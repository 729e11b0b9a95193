"""`Instruction`: one step of a scheduled program, what the runtime executes and the viewers show.

An instruction is a node of a program's graph, lowered (`fxzero.ir.lower.instruction_of`) to
plain data: its kind, stream, what it reads, its unit, the bytes, elements and FLOPs it moves or
computes, and, for the fxzero:: operators, everything the runtime needs to carry it out (which
buffer it makes or releases, which tier and state it moves, how a collective runs). The
executor, the validator and the liveness analysis read these fields, never the graph's nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

__all__ = ["ASYNC", "BUFFERS", "COLLECTIVES", "IO", "STREAM_OF", "BufferKind", "Instruction"]

COLLECTIVES = ("all_gather", "reduce_scatter")
IO = ("fetch", "offload")
"""Transfers between this rank's memory and a storage tier (rank-local: not in the fingerprint)."""
ASYNC = COLLECTIVES + IO
"""Instructions whose result is only valid after their wait."""
STREAM_OF = {"all_gather": "comm", "reduce_scatter": "comm", "fetch": "io", "offload": "io"}  # else "compute"

BufferKind = Literal["", "gathered", "persistent", "fetched", "flat_grad", "grad_shard", "token"]
BUFFERS = ("", "gathered", "persistent", "fetched", "flat_grad", "grad_shard", "token")
"""What an instruction's buffer is (`Instruction.buffer`):

- "gathered": a unit's full flat parameters, gathered for a while and freed (all_gather, its wait,
  the free that releases it);
- "persistent": a unit's full flat buffer held for the whole step (ZeRO-1/2, persistent units):
  the step's all_gather refills it in place, and an optim_step or cast writes this rank's slice of it;
- "fetched": a state shard read from a tier into a buffer of its own (fetch, its wait, its free);
- "flat_grad": a unit's gradients flattened into one padded buffer (the reduce-scatter's input);
- "grad_shard": this rank's reduced gradient shard (reduce_scatter and its wait);
- "token": an offload's receipt: the state is on its tier once the wait returns.
"""


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    """The value it defines (the FX node name in its program's graph)."""
    kind: str
    """compute | all_gather | reduce_scatter | fetch | offload | wait | free | optim_step | cast
    (mixed precision: a master shard into its low-precision copy) | check (float16: whether a
    gradient shard is finite)."""
    stream: str
    """compute | comm | io: collectives run on the comm stream, transfers to and from a storage
    tier (fetch, offload) on the io stream, everything else computes."""
    reads: tuple[str, ...] = ()
    """Values it reads (instruction names or program inputs), in argument order."""
    deps: tuple[int, ...] = ()
    """Indices of earlier instructions of the same program it must run after."""
    unit: Optional[str] = None
    touches: tuple[str, ...] = ()
    """Gathered buffers (names of the waits that produced them) it reads, directly or via views."""
    numel: int = 0
    """Elements moved (collectives, transfers) or produced (compute)."""
    bytes: int = 0
    """Bytes moved (collectives, transfers) or produced (compute)."""
    flops: int = 0
    """Floating point operations (compute; from torch's FLOP formulas, 0 where it has none)."""
    read_bytes: int = 0
    """Bytes of the tensors it reads (compute), for a memory-bound time estimate."""
    algorithm: str = ""
    """How a collective is carried out when not natively: "all_reduce" for a reduce-scatter done
    as an all-reduce and a slice (chosen by `passes/choose_collectives.py`); "" otherwise."""
    tier: str = ""
    """For a fetch or offload: the tier it reads or writes ("cpu", "nvme")."""
    state: str = ""
    """For a fetch or offload: which state of the unit it moves (one of `fxzero.config.state_kinds(optimizer)`, or "low")."""
    buffer: str = ""
    """The buffer this instruction makes, waits for, frees or updates (one of `BUFFERS`)."""
    keep_full: bool = False
    """For a reduce_scatter: ZeRO-1, the averaged shard goes back into this rank's slice of the
    flat gradient, which stays allocated as the unit's gradient."""
    aligned: bool = False
    """For a reduce_scatter: its result is written to a tier, so it is allocated 4096-aligned
    (written in place with O_DIRECT)."""
    dtype: str = ""
    """The dtype of the value it makes (a fetch: of the state it reads), e.g. "float32"."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict) -> "Instruction":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

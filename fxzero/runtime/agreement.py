"""[Note: one collective sequence] Ranks agree on the collectives they are about to issue.

Before any collective of a step (and before any gather outside a program, such as the one
`model.state_dict()` makes at ZeRO-3), every rank checks that every rank is about to issue the
same collectives: one 8-byte all-gather of a digest of their sequence. Ranks whose inputs differ
in shape compile and cache their own programs, and train; ranks whose collectives would differ
all raise here, naming the first difference, instead of hanging or pairing one rank's gather
with another's unrelated one.
"""

from __future__ import annotations

import torch

from fxzero.runtime.comm import Comm
from fxzero.schedule.validate import first_difference, sequence_digest

__all__ = ["agree"]


def agree(comm: Comm, sequence: tuple[str, ...], *, timeout: float, where: str,
          digest: int | None = None) -> None:
    """Check that every rank is about to issue `sequence`; a world of one always is.

    Args:
        sequence: the collectives, one line each (`schedule.validate.collective_sequence`).
        where: what this rank is doing, for the error when the others do not come
            ("the start of this forward", "model.state_dict()").
        digest: `sequence_digest(sequence)`, when the caller keeps it.

    Raises:
        RuntimeError: on every rank, when the sequences differ; on this rank, when the others
            do not come within `timeout` seconds (a rank died, or is elsewhere).
    """
    if comm.world_size == 1:
        return
    digest = sequence_digest(sequence) if digest is None else digest
    mine = torch.tensor([digest], dtype=torch.int64)
    digests = torch.empty(comm.world_size, dtype=torch.int64)
    try:
        comm.all_gather(digests, mine, count=False).wait()
    except Exception as e:
        raise RuntimeError(f"[rank {comm.rank}] the other ranks did not reach {where} within "
                           f"Config.collective_timeout={timeout:g} s (a rank died, or is still elsewhere: every "
                           f"rank must reach it). {e}") from e
    if (digests != digest).any():  # every rank sees it: all take this branch together
        raise first_difference(comm.all_gather_object(sequence), rank=comm.rank)

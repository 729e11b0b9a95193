"""[Note: one collective sequence] Ranks agree on the collectives they are about to issue.

Before any collective of a step (and before any gather outside a program, such as the one
`model.state_dict()` makes at ZeRO-3), every rank checks that every rank is about to issue the
same collectives: one 8-byte all-gather of a digest of their sequence. Ranks whose inputs differ
in shape compile and cache their own programs, and train; ranks whose collectives would differ
all raise here, naming the first difference, instead of hanging or pairing one rank's gather
with another's unrelated one.

[Note: a state_dict() on some ranks only]
One difference is DeepSpeed's own protocol rather than a mistake: rank 0 alone takes the
module's `state_dict()` (DeepSpeed returns empty placeholders at ZeRO-3, and the program
overwrites that file next), while the other ranks go on to gather the parameters with
GatheredParameters. A `state_dict()` gather yields (`agree(..., yields=True)`): when the ranks
that do not yield all agree among themselves on a GatheredParameters gather, the yielding ones
issue nothing, returning placeholders and saying so (`fxzero/runtime/user_module.py`), and the
others agree again, with the yielding ranks' next collective. Every other difference is the
error: a state_dict() on one rank while the others train on is a mistake, not this protocol.
"""

from __future__ import annotations

import torch

from fxzero.runtime.comm import Comm
from fxzero.schedule.validate import first_difference, sequence_digest

__all__ = ["agree"]


def agree(comm: Comm, sequence: tuple[str, ...], *, timeout: float, where: str,
          digest: int | None = None, yields_to: str | None = None) -> bool:
    """Check that every rank is about to issue `sequence`; a world of one always is.

    Args:
        sequence: the collectives, one line each (`schedule.validate.collective_sequence`).
        where: what this rank is doing, for the error when the others do not come
            ("the start of this forward", "model.state_dict()").
        digest: `sequence_digest(sequence)`, when the caller keeps it.
        yields_to: this rank's collectives are left out when the other ranks all agree on
            collectives each of whose lines begins with this ([Note: a state_dict() on some
            ranks only]).

    Returns:
        True: go on. False (only with `yields_to`): the other ranks are at those; issue nothing.

    Raises:
        RuntimeError: on every rank, when the sequences differ (and not every difference is a
            yielding rank's); on this rank, when the others do not come within `timeout`
            seconds (a rank died, or is elsewhere).
    """
    if comm.world_size == 1:
        return True
    digest = sequence_digest(sequence) if digest is None else digest
    mine = torch.tensor([digest], dtype=torch.int64)
    digests = torch.empty(comm.world_size, dtype=torch.int64)
    try:
        comm.all_gather(digests, mine, count=False).wait()
    except Exception as e:
        raise RuntimeError(f"[rank {comm.rank}] the other ranks did not reach {where} within "
                           f"Config.collective_timeout={timeout:g} s (a rank died, or is still elsewhere: every "
                           f"rank must reach it). {e}") from e
    if not (digests != digest).any():
        return True
    # (every rank sees the difference, and decides from what all sent: all take one branch)
    seen = comm.all_gather_object((sequence, yields_to))
    staying = {seq for seq, y in seen if y is None}
    yielding = {y for _, y in seen if y is not None}
    if len(staying) == 1 and yielding and all(line.startswith(y) for line in next(iter(staying)) for y in yielding):
        if yields_to is not None:
            return False  # (the others go on with theirs; this rank's next collective meets them)
        return agree(comm, sequence, timeout=timeout, where=where, digest=digest)  # (once the yielding ranks come)
    raise first_difference([seq for seq, _ in seen], rank=comm.rank)

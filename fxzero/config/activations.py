"""`Activations`: what the forward keeps for the backward, and what the backward recomputes.

[Note: recomputing a unit]
With `recompute="unit"` the forward keeps, of each unit's computation, only what flows into it
from outside the unit (the previous unit's output, masks, positions) and what a random operator
drew; the backward recomputes the rest of the unit's forward from those, right where its own
backward needs it, after the unit's backward all-gather, which brings the parameters anyway: no
extra gather, as `torch.utils.checkpoint` around each block does for FSDP without its second
gather (pytorch#105635). A unit here is a module the units policy made a unit (a block); the
root unit's computation (embeddings, the head, the loss) stays resident.

Random operators (dropout, attention with dropout) are recomputed too: the forward keeps the
generator's state from just before each draw, and the backward draws again from it ([Note:
replaying random operators] in `fxzero/ir/rng.py`), so a recomputed step equals a resident one
bit for bit at the cost of a state (5056 bytes on the CPU, 16 on CUDA) instead of a mask. Tensor
values are recomputed by the same operators on the same inputs, so they are equal bit for bit.
"""

from __future__ import annotations

import dataclasses

__all__ = ["RECOMPUTE", "Activations"]

RECOMPUTE = ("none", "unit", "selective")
"""Values of `Activations.recompute`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Activations:
    """What the forward keeps for the backward ([Note: recomputing a unit])."""

    recompute: str = "none"
    """"none": every activation the backward reads is kept from the forward; "unit": of each unit,
    its inputs are kept and the rest recomputed in the backward, random operators drawing again
    from the generator state kept for them;
    "selective": of each unit, the outputs of matmuls and attention are kept too and the cheap
    operators recomputed, what is kept chosen by a minimum cut over bytes ([Note: selective
    recompute] in `fxzero/passes/recompute_cut.py`)."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Activations(recompute=...) must be one of {RECOMPUTE}, got {self.recompute!r}")

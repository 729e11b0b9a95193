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

[Note: keeping attention]
A fused attention (`scaled_dot_product_attention`'s flash, memory-efficient or CPU kernel) costs
4·s²·h FLOPs a sequence in its forward and makes s·h values and a logsumexp of s per head: at
sequence 1024 and width 512 it is a third of a GPT block's forward FLOPs for as many bytes as
the block's input, and its share grows with the sequence (s/6h of the block's matmuls). Its
backward recomputes the attention scores from q, k, v and the logsumexp in any case, so keeping
its outputs is all its backward needs from it. With `keep_attention=True` a unit keeps them
beside its inputs and recomputes the rest of its forward (the projections that make q, k and v,
the norms, the MLP): the same rule as torch's selective checkpointing policies that save SDPA's
outputs (torchtitan's "op" mode). A recomputed attention with dropout draws again from its
generator state; a kept one needs no state. What is kept is what the forward made, so the step
is still equal bit for bit to the resident one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from fxzero.config.placement import Cpu, Nvme

__all__ = ["BUDGET_CHOICES", "RECOMPUTE", "Activations"]

RECOMPUTE = ("none", "unit", "selective")
"""Values of `Activations.recompute`."""

BUDGET_CHOICES = ("recompute", "offload")
"""What `Activations.budget_choices` may name."""


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

    keep_attention: bool = False
    """With recompute="unit" (or a model's own torch.utils.checkpoint regions): each unit (region)
    keeps its fused attentions' outputs (the output, the logsumexp) beside its inputs, and its
    backward recomputes the rest of its forward but not the attention ([Note: keeping
    attention]): for a transformer block, as many bytes again as its input for a third or more
    of its recompute (more at longer sequences)."""

    offload: Optional[Union[Cpu, Nvme]] = None
    """Where saved activations the backward needs late wait between their last forward use and
    their backward use: None keeps them in memory; `fxzero.Cpu()` (host memory: on a CPU rank
    they are there already, so it changes nothing and says so) or `fxzero.Nvme(path=...)` (files,
    written and read back ahead of use on the io stream; `write_behind_bytes` does not apply: a
    copy in memory is what offloading avoids). Which tensors: [Note: activations on a tier] in
    `fxzero/passes/offload_activations.py`; with `recompute="unit"`, of what each unit keeps."""
    offload_min_bytes: int = 1 << 20
    """With `offload`: saved tensors smaller than this stay in memory (a file and a call each, for little)."""

    memory_budget: Optional[int] = None
    """Bytes of activations a rank may hold between its forward and its backward
    (`memory_report()["activations"]` after a forward): the compiler chooses for every saved
    tensor among keeping it, recomputing it in the backward and, with `offload`, moving it to the
    tier, at the least added step time the cost model predicts ([Note: planning activations
    under a budget] in `fxzero/passes/activation_budget.py`). It chooses what to recompute
    itself: leave `recompute` at "none". Needs a cost model (`Config.cost_model`)."""

    budget_choices: tuple[str, ...] = BUDGET_CHOICES
    """What the memory budget's planner may do with a saved tensor besides keeping it:
    ("recompute", "offload") by default; ("offload",) moves tensors to the tier and recomputes
    nothing (ZeRO-Infinity's way), ("recompute",) the other way round."""

    def __post_init__(self) -> None:
        if self.offload is not None and not isinstance(self.offload, (Cpu, Nvme)):
            raise TypeError(f"Activations(offload=...) must be None, fxzero.Cpu() or fxzero.Nvme(path=...), "
                            f"got {self.offload!r}")
        if self.offload_min_bytes < 0:
            raise ValueError(f"Activations(offload_min_bytes=...) must be >= 0, got {self.offload_min_bytes}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Activations(recompute=...) must be one of {RECOMPUTE}, got {self.recompute!r}")
        if not isinstance(self.keep_attention, bool):
            raise TypeError(f"Activations(keep_attention=...) must be True or False, got {self.keep_attention!r}")
        if self.keep_attention and (self.recompute == "selective" or self.memory_budget is not None):
            why = ("the memory budget's planner chooses what to keep itself" if self.memory_budget is not None else
                   "selective recompute keeps attention's outputs already")
            raise ValueError(f"Activations(keep_attention=True) applies to recompute='unit' (and a model's own "
                             f"checkpointed regions), and here {why}: leave keep_attention unset")
        if self.memory_budget is not None:
            if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget <= 0:
                raise ValueError(f"Activations(memory_budget=...) must be a positive number of bytes, "
                                 f"got {self.memory_budget!r}")
            if self.recompute != "none":
                raise ValueError(f"Activations(memory_budget=...) chooses what to recompute itself; "
                                 f"recompute={self.recompute!r} would overrule it: leave recompute at 'none'")
        choices = tuple(self.budget_choices)
        if not choices or any(c not in BUDGET_CHOICES for c in choices):
            raise ValueError(f"Activations(budget_choices=...) names what the planner may do besides keeping a "
                             f"tensor, one or both of {BUDGET_CHOICES}; got {self.budget_choices!r}")
        object.__setattr__(self, "budget_choices", choices)
        if choices != BUDGET_CHOICES and self.memory_budget is None:
            raise ValueError("Activations(budget_choices=...) says what a memory budget's planner may do, and "
                             "no memory_budget is set: set memory_budget=BYTES, or leave budget_choices out")
        if choices == ("offload",) and self.memory_budget is not None and self.offload is None:
            raise ValueError("Activations(budget_choices=('offload',)) lets the planner only offload, and no tier "
                             "is set: add offload=fxzero.Nvme(path=...)")

"""`requires_grad` changed after the engine was built: honoured where that is exact, refused
by name where it is not.

[Note: requires_grad after compile]
The units are planned once, from each parameter's requires_grad when the engine is built: a
frozen parameter lives in a `<unit>:frozen` unit that has no gradient, no optimizer state and no
update (`fxzero/units.py`). What a later change means:

- Freezing a trained parameter (True -> False) is honoured from the next forward, exactly as
  torch treats a parameter whose `.grad` is None: the programs are traced again (the program
  cache is cleared), the parameter gets no gradient from that program's backward (its elements
  of the unit's gradient are zero), and its unit, memory and states stay as planned.
- The update follows torch's: a parameter is updated at an accumulation boundary when some
  backward of that accumulation gave it a gradient (torch's `.grad` is then not None), with the
  sum of what they gave; one that none gave a gradient (frozen, or unused by the forward, in all
  of them: `gradless_fqns` of each backward's program, intersected: `GradWindow`) is left as
  it is, parameter and optimizer states, and adds nothing to the clipping norm. So requires_grad
  may change between any two forwards, in the middle of an accumulation too (DeepSpeed's
  "unbalanced gradients").
- Unfreezing it again is as exact only if no optimizer step skipped it meanwhile: its unit's
  step count (Adam's bias correction, Adagrad's decay, ...) went on at that step while torch's
  count for it stopped. Otherwise it is refused.
- Unfreezing a parameter that was frozen when the engine was built (False -> True) would need a
  new layout of this rank's state (a gradient, optimizer states, a trained unit): refused.

Refusals are errors at the next forward naming the parameters and the ways out: set
requires_grad before `fxzero.initialize`/`fxzero.compile`, or build a new engine. Every rank must
make the same change (the collectives do not change, so a rank that differs is not caught).
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from fxzero.ir.layout import UnitLayout

__all__ = ["GradWindow", "RequiresGradWatch"]


def _names(fqns: list[str]) -> str:
    return f"{fqns[:5]}{' ...' if len(fqns) > 5 else ''}"


class RequiresGradWatch:
    """Compares each parameter's requires_grad at every forward with the last seen
    ([Note: requires_grad after compile]).

    Args:
        model: the user's module (its parameter objects keep their identity: `user_module.py`).
        layouts: the units the engine was built with.
    """

    def __init__(self, model: nn.Module, layouts: list[UnitLayout]) -> None:
        self._params = dict(model.named_parameters(remove_duplicate=True))
        self._built = {f: p.requires_grad for f, p in self._params.items()}
        self._seen = dict(self._built)
        self._trained = {s.fqn for lay in layouts if lay.trainable for s in lay.slots}
        self._skipped: set[str] = set()  # trained parameters an optimizer step left out (behind torch's count)

    def stepped(self, skipped: frozenset[str]) -> None:
        """An optimizer step updated every trained parameter but `skipped` (no gradient in its accumulation)."""
        self._skipped.update(skipped & self._trained)

    def signature(self) -> tuple[bool, ...]:
        """Each parameter's requires_grad as last seen: what a program was traced for."""
        return tuple(self._seen.values())

    def changed(self, rank: int) -> bool:
        """Whether requires_grad changed since the last forward (then the programs must be traced
        again); raises RuntimeError for a change that cannot be honoured exactly."""
        now = {f: p.requires_grad for f, p in self._params.items()}
        if now == self._seen:
            return False
        moved = sorted(f for f in now if now[f] != self._seen[f])
        ways = ("set requires_grad before fxzero.initialize / fxzero.compile, or build a new engine (fxzero.compile / "
                "fxzero.initialize) after changing it")
        unfrozen = sorted(f for f in moved if now[f] and not self._built[f])
        if unfrozen:
            raise RuntimeError(
                f"[rank {rank}] parameters {_names(unfrozen)} were frozen (requires_grad=False) when the engine was "
                "built and now require grad: fxzero planned them into frozen units, with no gradient and no "
                f"optimizer state, so it cannot train them; {ways}")
        late = sorted(f for f in moved if now[f] and f in self._skipped)
        if late:
            raise RuntimeError(
                f"[rank {rank}] parameters {_names(late)} require grad again after optimizer steps that skipped "
                "them: their units' step counts went on (Adam's bias correction, a schedule's step) where torch's "
                f"would have stopped for them, so their next updates would not be torch's; {ways}")
        self._seen = now
        return True


class GradWindow:
    """The parameters no backward since the last accumulation boundary gave a gradient: what the
    next update leaves alone ([Note: requires_grad after compile])."""

    def __init__(self) -> None:
        self.gradless: Optional[frozenset[str]] = None
        """None: no backward yet since the last boundary."""

    def backward(self, gradless: frozenset[str]) -> None:
        """A backward ran whose program gives no gradient to `gradless`."""
        self.gradless = gradless if self.gradless is None else self.gradless & gradless

    def reset(self) -> None:
        self.gradless = None

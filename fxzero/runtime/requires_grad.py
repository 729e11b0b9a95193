"""`requires_grad` changed after the engine was built: honoured where that is exact, refused
by name where it is not.

[Note: requires_grad after compile]
The units are planned once, from each parameter's requires_grad when the engine is built: a
frozen parameter lives in a `<unit>:frozen` unit that has no gradient, no optimizer state and no
update (`fxzero/units.py`). What a later change means:

- Freezing a trained parameter (True -> False) is honoured from the next forward, exactly as
  torch treats a parameter whose `.grad` is None: the programs are traced again (the program
  cache is cleared), the parameter gets no gradient (its elements of the unit's gradient are
  zero, so it adds nothing to the clipping norm), and the update skips its elements, leaving
  the parameter and its optimizer states untouched (`gradless_fqns`, as for a parameter the
  forward does not use). Its unit, memory and states stay as planned.
- Unfreezing it again is as exact only if no optimizer step ran meanwhile: its unit's step count
  (Adam's bias correction, Adagrad's decay, ...) went on while torch's count for it would have
  stopped. Otherwise it is refused.
- Unfreezing a parameter that was frozen when the engine was built (False -> True) would need a
  new layout of this rank's state (a gradient, optimizer states, a trained unit): refused.
- A change in the middle of a gradient accumulation (between a backward and its step) is refused:
  torch would still update the parameter with the gradient it kept, and the step runs with the
  gradients of the last program.

Refusals are errors at the next forward naming the parameters and the ways out: set
requires_grad before `fxzero.initialize`/`fxzero.compile`, or build a new engine. Every rank must
make the same change (the collectives do not change, so a rank that differs is not caught).
"""

from __future__ import annotations

import torch.nn as nn

from fxzero.ir.layout import UnitLayout

__all__ = ["RequiresGradWatch"]


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
        self._frozen_at: dict[str, int] = {}  # trained parameter -> optimizer steps when it was frozen

    def changed(self, rank: int, steps: int, pending: bool) -> bool:
        """Whether requires_grad changed since the last forward (then the programs must be traced
        again); raises RuntimeError for a change that cannot be honoured exactly.

        Args:
            steps: optimizer steps so far (`engine.global_steps`).
            pending: gradients of an unfinished accumulation are held.
        """
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
        late = sorted(f for f in moved if now[f] and self._frozen_at.get(f, steps) != steps)
        if late:
            raise RuntimeError(
                f"[rank {rank}] parameters {_names(late)} require grad again after optimizer steps that skipped "
                "them: their units' step counts went on (Adam's bias correction, a schedule's step) where torch's "
                f"would have stopped for them, so their next updates would not be torch's; {ways}")
        if pending:
            raise RuntimeError(
                f"[rank {rank}] requires_grad of {_names(moved)} changed in the middle of a gradient accumulation "
                "(after a backward, before its step): change it after engine.step() at an accumulation boundary")
        for f in moved:
            if now[f]:
                self._frozen_at.pop(f, None)
            elif f in self._trained:
                self._frozen_at[f] = steps
        self._seen = now
        return True

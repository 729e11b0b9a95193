"""`InputShapes`: which input sizes one compiled program serves, and the sizes its figures are for.

[Note: any size, one program]
A program traced with some input dims symbolic (`fxzero/trace.py`: the dims a call changed, or
dims the user marked with `torch._dynamo.mark_dynamic`) runs at every size its guards accept:
each dim is a size (static) or a symbol ("s0"), and the guards are what torch's ShapeEnv
recorded while the model ran on fake tensors (a dim the model needs at one size is specialized
to it; an equality between two inputs' dims, a bound such as `s0 <= 512`, the dims >= 2 of
0/1 specialization). The runtime checks them per call (`accepts`), so a call outside them gets
another program, never a wrong answer. Strides are left out: the programs read sizes only
(views were canonicalized to reshapes, `passes/canonicalize.py`).

Sizes a program cannot know until it runs (the rows `nonzero` or a boolean mask selects) are
unbacked symbols ("u0"). The schedule's bytes, FLOPs and memory timeline are numbers, so they
are evaluated at `sizes`: each input symbol at the traced example's size, each data-dependent
size at its largest (every element selected), an upper bound for memory. `fxzero schedule`
prints them with the schedule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch

__all__ = ["Dim", "InputShapes"]

Dim = Union[int, str]
"""One dim of a traced input: its size, or the symbol it was traced as."""


@dataclasses.dataclass(frozen=True)
class InputShapes:
    shapes: tuple[tuple[Dim, ...], ...]
    """Per tensor input, in call order: each dim's size, or its symbol ("s0")."""
    guards: tuple[str, ...] = ()
    """Python expressions over the inputs (`L['t0'].size()[1]` is input 0's dim 1) that must all
    hold, as torch's ShapeEnv produced them."""
    sizes: tuple[tuple[str, int], ...] = ()
    """The size every symbol is evaluated at for the schedule's figures: an input's symbol at the
    traced example's size; a data-dependent size (listed in `estimated`) at its upper bound."""
    estimated: tuple[str, ...] = ()
    """The symbols of `sizes` that are data-dependent (nonzero, masking): upper bounds."""
    specialized: tuple[tuple[int, int, str], ...] = ()
    """(input, dim, where) of each dim asked to be symbolic that the model needs at one size: the
    trace fixed it there (`where`: the code that did), so every size of it is its own program."""
    check: Optional[Callable[[dict], bool]] = dataclasses.field(default=None, compare=False, repr=False)
    """The compiled guards (None when read from JSON: guards from a file are shown, never run)."""

    @classmethod
    def static(cls, tensors: Sequence[Any]) -> "InputShapes":
        """The shapes of a program traced at these sizes only."""
        return cls(tuple(tuple(int(d) for d in t.shape) for t in tensors))

    @classmethod
    def traced(cls, shapes, guards: Sequence[str], sizes: dict[str, int], estimated: Sequence[str],
               specialized: Sequence[tuple[int, int, str]] = ()) -> "InputShapes":
        """Shapes with guards from this process's trace: compiled once here to run per call."""
        code = compile(" and ".join(f"({g})" for g in guards) or "True", "<fxzero shape guards>", "eval")
        check = functools.partial(_evaluate, code, _guard_namespace())
        return cls(tuple(tuple(s) for s in shapes), tuple(guards), tuple(sorted(sizes.items())),
                   tuple(sorted(estimated)), tuple(specialized), check)

    @property
    def dynamic(self) -> bool:
        """Whether any input dim is symbolic (the program serves more than one size)."""
        return any(isinstance(d, str) for shape in self.shapes for d in shape)

    @property
    def data_dependent(self) -> bool:
        return bool(self.estimated)

    def accepts(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the program runs these inputs (sizes and guards; dtypes are the cache key's)."""
        if len(tensors) != len(self.shapes):
            return False
        for t, shape in zip(tensors, self.shapes):
            if t.dim() != len(shape):
                return False
            if any(isinstance(d, int) and d != n for d, n in zip(shape, t.shape)):
                return False
        if not self.guards:
            return True
        if self.check is None:
            raise RuntimeError("these shapes were read from a file: their guards are shown, never run; "
                               "recompile the model to run it")
        return self.check({f"t{i}": t for i, t in enumerate(tensors)})

    def dims_differing(self, tensors: Sequence[torch.Tensor]) -> set[tuple[int, int]]:
        """(input, dim) of every dim that is symbolic here or whose size differs from the call's:
        the dims a program serving both this and the call must trace symbolically."""
        out = set()
        for i, (t, shape) in enumerate(zip(tensors, self.shapes)):
            if t.dim() != len(shape):
                continue
            out |= {(i, d) for d, (s, n) in enumerate(zip(shape, t.shape)) if isinstance(s, str) or s != n}
        return out

    def describe(self) -> str:
        """One line: "[4, s0] [4, s0]; s0=37 (traced)" or "[4, 37] [4, 37]"."""
        text = " ".join("[" + ", ".join(map(str, s)) + "]" for s in self.shapes)
        if self.sizes:
            text += "; figures at " + ", ".join(
                f"{k}={v}" + (" (largest: data-dependent)" if k in self.estimated else "") for k, v in self.sizes)
        return text

    def to_json(self) -> dict:
        return {"shapes": [list(s) for s in self.shapes], "guards": list(self.guards),
                "sizes": {k: v for k, v in self.sizes}, "estimated": list(self.estimated),
                "specialized": [list(s) for s in self.specialized]}

    @classmethod
    def from_json(cls, d: dict) -> "InputShapes":
        return cls(tuple(tuple(s) for s in d["shapes"]), tuple(d.get("guards", ())),
                   tuple(sorted(d.get("sizes", {}).items())), tuple(d.get("estimated", ())),
                   tuple(tuple(s) for s in d.get("specialized", ())))


def _guard_namespace() -> dict:
    from fxzero._compat import SYMPY_INTERP

    return dict(SYMPY_INTERP)


def _evaluate(code, namespace: dict, inputs: dict) -> bool:
    return bool(eval(code, namespace, {"L": inputs}))  # noqa: S307 (our own trace's guards, never a file's)

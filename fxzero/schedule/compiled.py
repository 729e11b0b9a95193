"""`CompiledProgram`: what the compiler hands the runtime for one input signature.

The compiler (`fxzero.compiler.compile_program`) makes it; the runtime runs its programs by its
schedule and never imports the compiler; the CLI records it as artifacts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch.fx as fx

from fxzero.ir.layout import UnitLayout
from fxzero.ir.program import Program
from fxzero.ir.shapes import InputShapes
from fxzero.ir.signature import JointSignature
from fxzero.schedule.types import Schedule

__all__ = ["CompiledProgram"]


@dataclasses.dataclass
class CompiledProgram:
    """The compiler's products for one input signature."""

    signature: JointSignature
    layouts: list[UnitLayout]
    programs: dict[str, Program]
    """"forward", "backward" and "step": the executable graphs the schedule refers to by node name."""
    schedule: Schedule
    pass_trace: list[Any]
    """One `fxzero.passes.runner.PassRecord` per pass, in order."""
    joint: fx.GraphModule
    """The rewritten joint graph, for viewing."""

    @property
    def shapes(self) -> Optional[InputShapes]:
        """The input sizes the program serves (`Schedule.shapes`; the runtime checks each call's)."""
        return self.schedule.shapes

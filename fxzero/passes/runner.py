"""The generic pass runner: contract checks before running, lint and a trace after each pass.

A pass is a function `fn(gm, ctx) -> PassResult` (knobs bound with functools.partial when the
pipeline is built) wrapped in a `Pass` that says what it REQUIRES and PROVIDES. The runner
refuses a pipeline whose order breaks a contract before running anything, naming the pass and
what came before it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Optional

import torch.fx as fx

from fxzero.ir.signature import JointSignature
from fxzero.ir.layout import UnitLayout

__all__ = ["Pass", "PassContext", "PassResult", "PassRecord", "check_pipeline", "run_pipeline"]


@dataclasses.dataclass
class PassContext:
    """What passes share besides the graph: the layouts, the trace's signature, their products."""

    layouts: list[UnitLayout]
    signature: JointSignature
    world_size: int
    programs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Filled by the split pass: "forward" and "backward" `Program`s."""
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the joint graph's flat outputs are, kept current by the passes that change them."""

    def layout(self, unit: str) -> UnitLayout:
        for layout in self.layouts:
            if layout.name == unit:
                return layout
        raise KeyError(unit)


@dataclasses.dataclass(frozen=True)
class PassResult:
    gm: fx.GraphModule
    changed: bool
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Pass-specific counts worth showing (e.g. {"all_gathers": 10})."""


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[fx.GraphModule, PassContext], PassResult]
    requires: frozenset[str] = frozenset()
    provides: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One line of the pass trace: what a pass changed and how long it took."""

    name: str
    changed: bool
    seconds: float
    nodes_before: int
    nodes_after: int
    kinds_after: dict[str, int]
    summary: dict[str, Any]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _kind_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for node in gm.graph.nodes:
        counts[node.meta.get("fxzero", {}).get("kind", node.op)] += 1
    return dict(sorted(counts.items()))


def check_pipeline(passes: list[Pass], available: frozenset[str] = frozenset()) -> None:
    """Raise ValueError if some pass requires a capability no earlier pass provides."""
    have = set(available)
    for i, p in enumerate(passes):
        missing = p.requires - have
        if missing:
            before = ", ".join(q.name for q in passes[:i]) or "nothing"
            raise ValueError(
                f"pass {p.name!r} requires {sorted(missing)}, which no earlier pass provides "
                f"(runs after: {before}); reorder the pipeline or add the pass that provides it"
            )
        have |= p.provides


def run_pipeline(
    gm: fx.GraphModule, ctx: PassContext, passes: list[Pass], *, available: frozenset[str] = frozenset()
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run `passes` in order; returns the final graph and the pass trace."""
    check_pipeline(passes, available)
    records = []
    for p in passes:
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        result: Optional[PassResult] = p.fn(gm, ctx)
        if not isinstance(result, PassResult):
            raise TypeError(f"pass {p.name!r} returned {type(result).__name__}, not a PassResult")
        gm = result.gm
        gm.graph.lint()
        records.append(
            PassRecord(
                name=p.name,
                changed=result.changed,
                seconds=round(time.perf_counter() - start, 6),
                nodes_before=before,
                nodes_after=len(gm.graph.nodes),
                kinds_after=_kind_counts(gm),
                summary=dict(result.summary),
            )
        )
    # Python code is generated once, for the final graph: no pass runs or reads the code of the
    # graph it is given (each reads and rewrites nodes), and generating it after every pass was
    # a third of a compile.
    gm.recompile()
    return gm, records

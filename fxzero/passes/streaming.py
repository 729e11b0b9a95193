"""Streaming: the one rule by which offloaded states flow through memory, unit after unit.

Over a sequence of items (units, in the order a program uses them), the reads an item needs are
issued `lookahead` items ahead of it, and the writes it makes are waited for `lookahead` items
after it, so reads, writes and compute overlap while only about 2 * lookahead + 1 items' states
are in memory at once:

    item:     0   1   2   3   ...          (lookahead = 1)
    issue:   r0  r2  r3  r4                 item k's reads go with item max(0, k - lookahead)'s
             r1
    retire:          w0  w1  w2             item k's writes are waited for before item
                                            k + lookahead + 1's, or at the end

`issue_point` and `retire_point` say it; the offload passes and the step program place their
nodes by them, so the rule is written once. With a cost model a read may be issued later than
that, where the compute before its use covers it (`compute_seconds`: what each node is
predicted to take).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch.fx as fx

from fxzero.ir.layout import UnitLayout
from fxzero.ir.lower import instruction_of

__all__ = ["compute_seconds", "issue_point", "prepend_all", "retire_behind", "retire_point", "streamed"]


def issue_point(k: int, lookahead: int) -> int:
    """The item whose turn issues item k's reads."""
    return max(0, k - lookahead)


def retire_point(k: int, lookahead: int) -> int:
    """The item before whose writes item k's writes are waited for (past the end: at the end)."""
    return k + lookahead + 1


def streamed(n: int, lookahead: int) -> Iterator[tuple[str, int]]:
    """The order of a streamed loop over n items: ("issue", j), ("run", i) and ("retire", k)
    events, each item's reads issued at its `issue_point`, its writes retired right after the
    run of the item before its `retire_point`."""
    issued = 0
    for i in range(n):
        while issued < n and issue_point(issued, lookahead) <= i:
            yield "issue", issued
            issued += 1
        yield "run", i
        done = i + 1 - (lookahead + 1)  # the item whose retire_point is i + 1
        if done >= 0:
            yield "retire", done
    for k in range(max(0, n - lookahead), n):
        yield "retire", k


def prepend_all(anchor: fx.Node, nodes: Sequence[fx.Node]) -> None:
    """Move `nodes`, in order, to just before `anchor`."""
    for n in nodes:
        anchor.prepend(n)


def retire_behind(writes: Sequence[tuple[fx.Node, Sequence[fx.Node]]], lookahead: int,
                  end: Optional[fx.Node] = None) -> None:
    """Per item, in program order: (its first write, the waits of its writes). Item k's waits
    move to just before item `retire_point(k)`'s first write, or, past the last item, before
    `end` (None: they stay where they are)."""
    for k, (_, waits) in enumerate(writes):
        later = retire_point(k, lookahead)
        if later < len(writes):
            prepend_all(writes[later][0], waits)
        elif end is not None:
            prepend_all(end, waits)


def compute_seconds(graph: fx.Graph, layouts: dict[str, UnitLayout], cost_model) -> dict[fx.Node, float]:
    """Predicted compute time of each node (0 for everything but compute)."""
    out = {}
    for n in graph.nodes:
        ins = instruction_of(n, layouts) if n.op == "call_function" else None
        out[n] = cost_model.compute_seconds(ins) if ins is not None and ins.kind == "compute" else 0.0
    return out

"""offload_activations: saved activations the backward needs late wait on a storage tier.

With `Activations(offload=Cpu() | Nvme(...))`. Before::

    h = gelu(a)                                  # forward; saved for the backward
    ...h's last forward use...; ...more forward...
    ...backward...; gh = gelu_backward(g, h)

After::

    h = gelu(a)
    ...h's last forward use...
    o = offload(h, "blocks.1", "activation")     # io stream, right after the last forward use
    ...more forward...
    t = wait(o)                                  # the forward's end: written; t, a receipt, is saved instead of h
    ...backward...
    f = fetch("blocks.1", "activation", numel, dtype, t)   # issued its lead ahead of the use
    ...backward compute, covering the read...
    w = wait(f); h_1 = view(w, h.shape)          # right before the first backward use
    gh = gelu_backward(g, h_1); ...; free(w)     # after the last backward reader

A saved view of an offloaded tensor (a reshape the backward reads) is not saved: its view is
taken again of the fetched copy (views move no data), so the storage leaves memory whole.

[Note: activations on a tier]
The candidates are the tensors the forward saves for the backward, after `separate_phases` chose
what to recompute (with `recompute="unit"`, a unit's inputs and its random draws: offload then
moves what the unit keeps), that own their storage (a view goes with its owner), are computed
in the forward (not a model input, a gathered or fetched buffer), dense (its elements fill its
storage, in any order of dimensions: attention's output is transposed), and of static size
(a size known only at run time stays resident). Of those, the default rule offloads a tensor when

1. it has at least `Activations.offload_min_bytes` (small ones cost a file and a call for little);
2. another unit computes in the forward after its last use, and in the backward before its first
   use: the last unit's tensors (the head and the loss, read at once by the backward) stay. The
   program's units follow each other where its parameter views change unit;
3. with a cost model, its write and its read each hide behind compute on the one io stream:
   writes in order of last use, each starting once its tensor is complete and the stream is free,
   must end by the forward's end (whose waits then cost nothing); reads, placed as late as
   their uses allow (latest use first, one at a time), must start in the backward. The read's
   start is the fetch's issue point: its lead is the cost model's. Without a cost model the
   fetch is issued at the start of the unit before the one that reads it.

A planner (a later pass or a memory budget) sets the choice per tensor instead:
`ctx.outputs["activation_placement"] = {name: "keep" | tier}`, names from `saved_tensors`, which
gives each candidate's bytes, write and read time and gaps; tensors it leaves out follow the rule.
The choice depends on the sizes the program was traced at; offloads are rank-local (no collective),
so ranks may differ in them without disagreeing on the collective sequence.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch
import torch.fx as fx

from fxzero.ir.alias import alias_closure, alias_root, alias_source
from fxzero.ir.instruction import Instruction
from fxzero.ir.ops import OPS
from fxzero.ir.sizes import value_size
from fxzero.ir.tags import BACKWARD, FORWARD, is_kind, kind, phase, tag
from fxzero.passes.runner import Pass, PassContext, PassResult
from fxzero.passes.streaming import compute_seconds

__all__ = ["ACTIVATION", "PLACEMENT", "SavedTensor", "make", "saved_tensors"]

REQUIRES = frozenset({"phases", "params_gathered"})
PROVIDES = frozenset({"activations_offloaded"})

ACTIVATION = "activation"
"""The `state` of an activation's offload and fetch nodes (and instructions)."""
PLACEMENT = "activation_placement"
"""`ctx.outputs` key a planner sets: saved tensor name -> "keep" or a tier name."""


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """A saved tensor that could wait on a tier, and what that would cost ([Note: activations on a tier])."""

    name: str
    """Its node in the joint graph (the owner of the storage the backward reads)."""
    unit: Optional[str]
    """The unit whose forward computes it (None: before any unit's parameters are read)."""
    bytes: int
    write_s: float
    """Predicted write to the tier (0.0 without a cost model)."""
    read_s: float
    forward_gap_s: float
    """Predicted forward compute after its last forward use (0.0 without a cost model)."""
    backward_gap_s: float
    """Predicted backward compute before its first backward use."""
    forward_gap_units: int
    """Units that compute in the forward after its last use."""
    backward_gap_units: int
    """Units that compute in the backward before its first use."""


class _Candidate(NamedTuple):
    root: fx.Node
    members: list[fx.Node]  # saved nodes whose storage is root's (root itself, views of it)
    last_forward: fx.Node  # its last forward reader (root itself if none)
    first_backward: fx.Node


# -- predicates ------------------------------------------------------------------------------------

def _is_static_dense(val) -> bool:
    """A tensor of static size whose elements fill its storage from its start, in some order of
    its dimensions (written and read back as that storage, in that layout)."""
    if not (isinstance(val, torch.Tensor) and val.numel() > 0 and val.storage_offset() == 0
            and not any(isinstance(d, torch.SymInt) for d in (*val.shape, *val.stride()))):
        return False
    expected = 1
    for stride, size in sorted((s, d) for d, s in zip(val.shape, val.stride()) if d > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _can_offload(root: fx.Node) -> bool:
    """An ATen value of the forward that owns its storage (see the module doc)."""
    return (root.op == "call_function" and phase(root) == FORWARD and kind(root) in (None, "compute")
            and not root.meta.get("fxzero", {}).get("kept") and _is_static_dense(root.meta.get("val")))


def _view_chain(node: fx.Node, root: fx.Node) -> Optional[list[fx.Node]]:
    """The views from root (exclusive) to node, if each takes only its source as a node argument."""
    chain = []
    while node is not root:
        src = alias_source(node)
        if src is None or any(a is not src for a in node.all_input_nodes):
            return None
        chain.append(node)
        node = src
    return chain[::-1]


# -- analysis --------------------------------------------------------------------------------------

def _segments(nodes: list[fx.Node]) -> dict[fx.Node, tuple[int, Optional[str]]]:
    """Each node's unit segment (index, unit): a new segment starts where a parameter view of
    another unit is taken, so a program's units follow each other."""
    out, index, unit = {}, 0, None
    for n in nodes:
        if is_kind(n, "param_view") and n.meta["fxzero"].get("unit") != unit:
            if unit is not None:
                index += 1
            unit = n.meta["fxzero"].get("unit")
        out[n] = (index, unit)
    return out


def _candidates(graph: fx.Graph) -> list[_Candidate]:
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and phase(n) == FORWARD and any(phase(u) == BACKWARD for u in n.users):
            groups.setdefault(alias_root(n), []).append(n)
    out = []
    for root, members in groups.items():
        if not _can_offload(root) or any(_view_chain(m, root) is None for m in members):
            continue
        closure = set(alias_closure(root))
        readers = [u for c in closure for u in c.users if u not in closure]
        forward = [u for u in readers if phase(u) == FORWARD]
        backward = [u for m in members for u in m.users if phase(u) == BACKWARD]
        out.append(_Candidate(root, members, max(forward, key=order.__getitem__, default=root),
                              min(backward, key=order.__getitem__)))
    return sorted(out, key=lambda c: order[c.root])


def _through_views(node: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """The first node that reads `node`'s data: itself, or, for a view, its first reader's (as
    `_forward_first` sinks a backward view to its first reader, the analysis may run before it)."""
    while kind(node) is None and alias_source(node) is not None and node.users:
        node = min(node.users, key=order.__getitem__)
    return node


class _Timeline(NamedTuple):
    """One phase's nodes in program order, their unit segments and predicted start times."""

    nodes: list[fx.Node]
    segments: dict[fx.Node, tuple[int, Optional[str]]]
    start_s: dict[fx.Node, float]
    end_s: float

    @classmethod
    def of(cls, graph: fx.Graph, which: str, seconds: Optional[dict[fx.Node, float]]) -> "_Timeline":
        nodes = [n for n in graph.nodes if n.op == "call_function" and phase(n) == which]
        start, t = {}, 0.0
        for n in nodes:
            start[n] = t
            t += seconds.get(n, 0.0) if seconds is not None else 0.0
        return cls(nodes, _segments(nodes), start, t)

    @property
    def last_segment(self) -> int:
        return max((i for i, _ in self.segments.values()), default=0)


def _io_seconds(cost_model, tier: str, which: str, nbytes: int) -> float:
    if cost_model is None:
        return 0.0
    return cost_model.io_seconds(Instruction(name="", kind=which, stream="io", tier=tier, bytes=nbytes))


def _analyse(graph: fx.Graph, ctx: PassContext, tier: str, cost_model):
    seconds = compute_seconds(graph, {lay.name: lay for lay in ctx.layouts}, cost_model) if cost_model else None
    fwd, bwd = _Timeline.of(graph, FORWARD, seconds), _Timeline.of(graph, BACKWARD, seconds)
    rows, order = [], {n: i for i, n in enumerate(graph.nodes)}
    for c in _candidates(graph):
        nbytes = value_size(c.root.meta["val"])[1]
        last, first = c.last_forward, _through_views(c.first_backward, order)
        first = first if first in bwd.start_s else c.first_backward
        after = fwd.start_s[last] + (seconds.get(last, 0.0) if seconds is not None else 0.0)
        rows.append((c, SavedTensor(
            name=c.root.name, unit=fwd.segments[c.root][1], bytes=nbytes,
            write_s=_io_seconds(cost_model, tier, "offload", nbytes), read_s=_io_seconds(cost_model, tier, "fetch", nbytes),
            forward_gap_s=fwd.end_s - after, backward_gap_s=bwd.start_s[first],
            forward_gap_units=fwd.last_segment - fwd.segments[last][0],
            backward_gap_units=bwd.segments[first][0])))
    return rows, fwd, bwd


def saved_tensors(gm: fx.GraphModule, ctx: PassContext, *, tier: str, cost_model=None) -> list[SavedTensor]:
    """Every saved tensor that could wait on `tier`, with its bytes, its predicted write and read
    and the compute around it (forward order): what a planner weighs ([Note: activations on a tier])."""
    return [row for _, row in _analyse(gm.graph, ctx, tier, cost_model)[0]]


def _default_rule(rows: list[tuple[_Candidate, SavedTensor]], fwd: _Timeline, min_bytes: int,
                  priced: bool) -> set[str]:
    """Names the rule offloads (module doc, 1-3)."""
    chosen = [s for _, s in rows if s.bytes >= min_bytes and s.forward_gap_units > 0 and s.backward_gap_units > 0]
    if not priced:
        return {s.name for s in chosen}
    written, io_free = [], 0.0
    for s in sorted(chosen, key=lambda s: fwd.end_s - s.forward_gap_s):  # by the end of the last use
        begin = max(io_free, fwd.end_s - s.forward_gap_s)
        if begin + s.write_s <= fwd.end_s:
            written.append(s)
            io_free = begin + s.write_s
    out, io_busy_from = set(), float("inf")
    for s in sorted(written, key=lambda s: s.backward_gap_s, reverse=True):  # (the gap: when its first reader starts)
        begin = min(s.backward_gap_s, io_busy_from) - s.read_s
        if begin >= 0.0:
            out.add(s.name)
            io_busy_from = begin
    return out


def _issue_points(rows, chosen: set[str], bwd: _Timeline, priced: bool) -> dict[str, fx.Node]:
    """Where each chosen tensor's fetch is issued: the latest start its read and the io stream
    allow (priced), else the first node of the unit before the one that reads it."""
    out: dict[str, fx.Node] = {}
    picked = sorted(((c, s) for c, s in rows if s.name in chosen), key=lambda r: bwd.nodes.index(r[0].first_backward),
                    reverse=True)
    io_busy_from = float("inf")
    for c, s in picked:
        use = c.first_backward
        if priced:
            begin = max(0.0, min(bwd.start_s[use], io_busy_from) - s.read_s)
            io_busy_from = begin
            out[s.name] = next((n for n in reversed(bwd.nodes[: bwd.nodes.index(use) + 1]) if bwd.start_s[n] <= begin),
                               bwd.nodes[0])
        else:
            target = max(0, bwd.segments[use][0] - 1)
            out[s.name] = next(n for n in bwd.nodes if bwd.segments[n][0] == target)
    return out


# -- apply -----------------------------------------------------------------------------------------

def _offload_one(graph: fx.Graph, c: _Candidate, unit: Optional[str], tier: str, issue: fx.Node,
                 forward_end: fx.Node) -> fx.Node:
    """Rewrite one saved tensor as in the module doc; returns the forward's wait (to order them)."""
    root, val = c.root, c.root.meta["val"]
    with graph.inserting_after(c.last_forward):
        start = graph.call_function(OPS["offload"], (root, unit or "", ACTIVATION))
    start.meta["val"] = val.new_empty(0)
    tag(start, kind="offload", unit=unit, phase=FORWARD, state=ACTIVATION, tier=tier)
    with graph.inserting_after(forward_end):
        done = graph.call_function(OPS["wait"], (start,))
    done.meta["val"] = val.new_empty(0)
    tag(done, kind="wait", unit=unit, phase=FORWARD, waits_for=start.name)

    numel = val.numel()
    with graph.inserting_before(issue):
        fetch = graph.call_function(OPS["fetch"], (unit or "", ACTIVATION, numel, val.dtype, done))
    fetch.meta["val"] = torch.empty(numel, dtype=val.dtype, device="meta")  # (as offload_params' fetches: no memory)
    tag(fetch, kind="fetch", unit=unit, phase=BACKWARD, state=ACTIVATION, tier=tier)
    with graph.inserting_before(c.first_backward):
        fetched = graph.call_function(OPS["wait"], (fetch,))
        copy = graph.call_function(torch.ops.aten.view.default, (fetched, list(val.shape)))
    fetched.meta["val"] = fetch.meta["val"]
    copy.meta["val"] = val
    tag(fetched, kind="wait", unit=unit, phase=BACKWARD, waits_for=fetch.name)
    tag(copy, phase=BACKWARD)
    for member in c.members:
        source = copy
        with graph.inserting_before(c.first_backward):
            for view in _view_chain(member, root):  # the saved view, taken again of the copy
                source = graph.node_copy(view, lambda n, s=source: s)
                source.meta = {**view.meta, "fxzero": {**view.meta.get("fxzero", {}), "phase": BACKWARD}}
        for user in [u for u in member.users if phase(u) == BACKWARD]:
            user.replace_input_with(member, source)
    for view in reversed([v for m in c.members for v in _view_chain(m, root)]):
        if not view.users:  # (a view taken only to be saved: taken in the backward now)
            graph.erase_node(view)
    order = {n: i for i, n in enumerate(graph.nodes)}
    closure = set(alias_closure(fetched))
    last = max((u for n in closure for u in n.users if u not in closure), key=order.__getitem__)
    with graph.inserting_after(last):
        freed = graph.call_function(OPS["free"], (fetched,))
    tag(freed, kind="free", unit=unit, phase=BACKWARD)
    return done


def _forward_first(graph: fx.Graph) -> None:
    """Every backward node after every forward one, each phase in its own order (a topological
    order still: no forward value reads a backward one), so the forward's end, where the writes
    are waited for, comes before any fetch. And a backward view of a forward value (a `detach`
    autograd took of a tensor it saved) sinks to just before its first reader: views move no
    data, and where the trace left them, at the backward's start, they would make the tensor
    read at once."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in [n for n in graph.nodes if n.op == "call_function" and phase(n) == BACKWARD]:
        out.prepend(n)
    for n in reversed([n for n in graph.nodes if n.op == "call_function" and phase(n) == BACKWARD]):
        if kind(n) is None and alias_source(n) is not None and phase(alias_root(n)) == FORWARD and n.users:
            order = {m: i for i, m in enumerate(graph.nodes)}
            min(n.users, key=order.__getitem__).prepend(n)


def _check_placement(placement: dict, names: set[str], tier: str) -> None:
    for name, where in placement.items():
        if name not in names:
            raise ValueError(f"ctx.outputs[{PLACEMENT!r}] names {name!r}, which is not a saved tensor that can be "
                             f"offloaded; choose among saved_tensors(): {sorted(names)[:8]}...")
        if where not in ("keep", tier):
            raise ValueError(f"ctx.outputs[{PLACEMENT!r}][{name!r}] = {where!r}: use 'keep' or {tier!r}, the tier "
                             "Activations(offload=...) names")


def offload_activations_pass(gm: fx.GraphModule, ctx: PassContext, *, tier: str, min_bytes: int,
                             cost_model=None) -> PassResult:
    """Offload saved activations to `tier` by the placement a planner set, else the rule
    ([Note: activations on a tier])."""
    graph = gm.graph
    _forward_first(graph)
    rows, fwd, bwd = _analyse(graph, ctx, tier, cost_model)
    on_cpu = all(c.root.meta["val"].device.type == "cpu" for c, _ in rows)
    if not rows or (tier == "cpu" and on_cpu):
        # (A CPU program's activations are in host memory already: the cpu tier would copy them there.)
        return PassResult(gm, changed=False, summary={"tier": tier, "offloaded": 0, "candidates": len(rows)})
    placement = dict(ctx.outputs.get(PLACEMENT) or {})
    _check_placement(placement, {s.name for _, s in rows}, tier)
    ruled = _default_rule([r for r in rows if r[1].name not in placement], fwd, min_bytes, cost_model is not None)
    chosen = {name for name, where in placement.items() if where == tier} | ruled
    issue = _issue_points(rows, chosen, bwd, cost_model is not None)
    forward_end = fwd.nodes[-1]
    for c, s in rows:
        if s.name in chosen:
            forward_end = _offload_one(graph, c, s.unit, tier, issue[s.name], forward_end)
    offloaded = [s for _, s in rows if s.name in chosen]
    return PassResult(gm, changed=bool(offloaded), summary={
        "tier": tier, "candidates": len(rows), "offloaded": len(offloaded),
        "offloaded_bytes": sum(s.bytes for s in offloaded), "planned": len(placement)})


def make(*, tier: str, min_bytes: int, cost_model=None) -> Pass:
    """`tier`: "cpu" or "nvme"; `min_bytes`: the rule's smallest tensor; `cost_model` (optional)
    prices writes, reads and compute ([Note: activations on a tier])."""
    return Pass("offload_activations",
                functools.partial(offload_activations_pass, tier=tier, min_bytes=min_bytes, cost_model=cost_model),
                requires=REQUIRES, provides=PROVIDES)

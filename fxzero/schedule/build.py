"""Building: the programs, ordered and lowered into a validated `Schedule`.

`build_schedule` is one pure function from the compiled programs (forward, backward and step,
each an FX graph) and the unit layouts to a `Schedule`: a priority topological order of each
program's nodes, each lowered to an `Instruction` with its dependencies; a memory timeline of
gathered buffers; the fingerprint; and `validate` before it is returned.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import networkx as nx
import torch.fx as fx

from fxzero.ir.alias import alias_root, mutated_args
from fxzero.ir.instruction import ASYNC, Instruction
from fxzero.ir.layout import UnitLayout
from fxzero.ir.lower import instruction_of, is_fetched_shard
from fxzero.ir.program import Program
from fxzero.ir.shapes import InputShapes
from fxzero.ir.sizes import itemsize_of
from fxzero.ir.tags import kind, output_node
from fxzero.schedule.types import SCHEDULE_VERSION, Kept, ProgramSchedule, Schedule
from fxzero.schedule.validate import fingerprint_of, validate

__all__ = ["build_schedule"]

PROGRAMS = ("forward", "backward", "step")


def _order(graph: fx.Graph) -> tuple[list[fx.Node], dict[fx.Node, set[fx.Node]]]:
    """Priority topological order of the program's instructions, and each one's dependencies.

    Dependencies are data edges, plus the edges of [Note: ordered by mutation]. Priority:
    program order, the order the tracer recorded and the passes kept valid, which keeps every
    rank's collective sequence identical. (Prefetch changes the order of nodes, not this.)

    [Note: ordered by mutation]
    An operator that changes a buffer in place (`free`, `optim_step`, `all_gather_into`: their
    schemas say so) reads and writes the buffer's storage without a data edge to every other
    node that reads it, directly or through a view. So it runs after every earlier reader of that
    storage (for an asynchronous reader, a gather or an offload, after the reader's wait: only
    then has it finished reading), and every later reader runs after it.
    """
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    position = {n: i for i, n in enumerate(nodes)}
    deps: dict[fx.Node, set[fx.Node]] = {n: {i for i in n.all_input_nodes if i in position} for n in nodes}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        for root in {alias_root(i) for i in n.all_input_nodes}:
            readers.setdefault(root, []).append(n)
    for n in nodes:
        for root in {alias_root(a) for a in mutated_args(n)}:
            for r in readers.get(root, ()):
                if r is n:
                    continue
                if position[r] < position[n]:
                    deps[n].add(r)
                    deps[n] |= {w for w in r.users if kind(w) == "wait"} if kind(r) in ASYNC else set()
                else:
                    deps[r].add(n)
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((d, n) for n in nodes for d in deps[n] if d is not n)
    order = list(nx.lexicographical_topological_sort(dag, key=position.__getitem__))
    return order, deps


def _gathered_timeline(instructions: Iterable[Instruction], kept_in: Iterable[Kept] = ()) -> tuple[int, ...]:
    """Bytes of gathered buffers alive after each instruction: +all_gather, -free; buffers kept
    from the forward are alive from the start."""
    size_of = {k.name: k.bytes for k in kept_in if k.buffer == "gathered"}
    live, out = sum(size_of.values()), []
    for ins in instructions:
        if ins.kind == "all_gather" and ins.buffer == "gathered":
            size_of[ins.name] = ins.bytes
            live += ins.bytes
        elif ins.kind == "wait" and ins.reads[0] in size_of:
            size_of[ins.name] = size_of.pop(ins.reads[0])  # the wait's value is the buffer
        elif ins.kind == "free" and ins.reads[0] in size_of:  # (else a fetched shard)
            live -= size_of.pop(ins.reads[0])
        out.append(live)
    return tuple(out)


def _kept(node: fx.Node, layouts: dict[str, UnitLayout]) -> Kept:
    layout = layouts[node.meta["fxzero"]["unit"]]
    if is_fetched_shard(node):
        return Kept(node.name, "fetched", layout.name, layout.shard_numel * layout.itemsize)
    return Kept(node.name, "gathered", layout.name, layout.padded_numel * itemsize_of(node, layout.itemsize))


def _program_schedule(program: Program, layouts: dict[str, UnitLayout]) -> ProgramSchedule:
    graph = program.gm.graph
    order, deps = _order(graph)
    index = {n: i for i, n in enumerate(order)}
    instructions = []
    for n in order:
        ins = instruction_of(n, layouts)
        instructions.append(dataclasses.replace(ins, deps=tuple(sorted(index[d] for d in deps[n] if d is not n))))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    results = output_node(graph).args[0]
    outputs = [r.name if isinstance(r, fx.Node) else "" for r in results]
    # Buffers kept across the forward/backward boundary: outputs of the forward, inputs of the backward.
    crossing = [n for n in (*placeholders, *results) if isinstance(n, fx.Node) and n.meta.get("fxzero", {}).get("kept")]
    kept = tuple(_kept(n, layouts) for n in crossing)
    return ProgramSchedule(
        program.name,
        tuple(n.name for n in placeholders),
        tuple(outputs),
        tuple(instructions),
        _gathered_timeline(instructions, [k for k in kept if k.name in {p.name for p in placeholders}]),
        kept,
    )


def build_schedule(programs: dict[str, Program], layouts: list[UnitLayout], *, stage: int, world_size: int,
                   persistent: frozenset[str], prefetch_budget_bytes: Optional[int] = None,
                   shapes: Optional[InputShapes] = None, device: str = "cpu") -> Schedule:
    """The Schedule of the forward, backward and step programs (from the passes); `shapes`: the
    input sizes it serves (its figures are for `shapes.sizes` where some are symbolic); `device`: the
    device type its programs were traced for."""
    by_name = {u.name: u for u in layouts}
    progs = tuple(_program_schedule(programs[name], by_name) for name in PROGRAMS)
    schedule = Schedule(
        SCHEDULE_VERSION, stage, world_size, tuple(layouts), progs, fingerprint_of(progs, layouts, stage),
        tuple(u.name for u in layouts if u.name in persistent),
        prefetch_budget_bytes,
        shapes,
        device,
    )
    validate(schedule)
    return schedule

"""Building: the split programs, ordered and lowered into a validated `Schedule`.

`build_schedule` is one pure function from the split programs and the unit layouts to a
`Schedule`: a priority topological order of each program's nodes, each lowered to an
`Instruction` with its dependencies; the step program; a memory timeline of gathered buffers;
the fingerprint; and `validate` before it is returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import networkx as nx
import torch.fx as fx

from fxzero.config import STATE_KINDS
from fxzero.ir.instruction import ASYNC, Instruction
from fxzero.ir.layout import UnitLayout
from fxzero.ir.lower import gathered_root, instruction_of
from fxzero.ir.tags import kind
from fxzero.schedule.types import SCHEDULE_VERSION, ProgramSchedule, Schedule
from fxzero.schedule.validate import fingerprint_of, validate

__all__ = ["build_schedule"]


def _order(graph: fx.Graph) -> tuple[list[fx.Node], dict[fx.Node, set[fx.Node]]]:
    """Priority topological order of the program's instructions, and each one's dependencies.

    Dependencies are data edges, plus: a free runs after every reader of its buffer or of a
    view of it (the free reads only the buffer itself, so no data edge says this).
    Priority: program order, the order the tracer recorded, which is already a valid order and
    keeps every rank's collective sequence identical. (Prefetch changes priorities, not this.)
    """
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    position = {n: i for i, n in enumerate(nodes)}
    deps: dict[fx.Node, set[fx.Node]] = {n: {i for i in n.all_input_nodes if i in position} for n in nodes}
    readers: dict[fx.Node, set[fx.Node]] = {}
    for n in nodes:
        for root in filter(None, map(gathered_root, n.all_input_nodes)):
            readers.setdefault(root, set()).add(n)
    for n in nodes:
        if kind(n) == "free":
            buf = n.args[0]
            deps[n] |= readers.get(buf, set()) - {n}
            # A fetched shard is read by its gather, which has read it only once the gather's
            # wait returns.
            deps[n] |= {w for r in buf.users if kind(r) in ASYNC for w in r.users if kind(w) == "wait"}
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((d, n) for n in nodes for d in deps[n])
    order = list(nx.lexicographical_topological_sort(dag, key=position.__getitem__))
    return order, deps


def _gathered_timeline(instructions: Iterable[Instruction], kept_in: Optional[dict[str, int]] = None) -> tuple[int, ...]:
    """Bytes of gathered buffers alive after each instruction: +all_gather, -free; buffers kept
    from the forward (`kept_in`: name -> bytes) are alive from the start."""
    size_of = dict(kept_in or {})
    live, out = sum(size_of.values()), []
    for ins in instructions:
        if ins.kind == "all_gather":
            size_of[ins.name] = ins.bytes
            live += ins.bytes
        elif ins.kind == "wait" and ins.reads[0] in size_of:
            size_of[ins.name] = size_of.pop(ins.reads[0])  # the wait's value is the buffer
        elif ins.kind == "free" and ins.reads[0] in size_of:  # (else a fetched shard)
            live -= size_of.pop(ins.reads[0])
        out.append(live)
    return tuple(out)


def _program_schedule(program, layouts: dict[str, UnitLayout]) -> ProgramSchedule:
    graph = program.gm.graph
    order, deps = _order(graph)
    index = {n: i for i, n in enumerate(order)}
    instructions = []
    for n in order:
        ins = instruction_of(n, layouts)
        instructions.append(dataclasses.replace(ins, deps=tuple(sorted(index[d] for d in deps[n]))))
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in graph.nodes if n.op == "output")
    outputs = [r.name if isinstance(r, fx.Node) else "" for r in out.args[0]]
    kept = [n for n in graph.nodes if n.meta.get("fxzero", {}).get("kept") and (n.op == "placeholder" or n in out.args[0])]
    kept_in = {}
    for n in kept:
        if n.op == "placeholder" and n.meta["fxzero"]["kept"] == "gathered":
            layout = layouts[n.meta["fxzero"]["unit"]]
            kept_in[n.name] = layout.padded_numel * layout.itemsize
    return ProgramSchedule(
        program.name,
        tuple(placeholders),
        tuple(outputs),
        tuple(instructions),
        _gathered_timeline(instructions, kept_in),
        tuple(n.name for n in kept),
    )


def _io(kind: str, state: str, layout: UnitLayout, tier: str, reads: tuple[str, ...] = ()) -> Instruction:
    return Instruction(
        name=f"{kind}:{state}:{layout.name}", kind=kind, stream="io", unit=layout.name, reads=reads,
        numel=layout.shard_numel, bytes=layout.shard_numel * layout.itemsize, algorithm=tier, state=state,
    )


def _wait(ins: Instruction) -> Instruction:
    return Instruction(name=f"wait:{ins.name}", kind="wait", stream="compute", unit=ins.unit, reads=(ins.name,))


def _with_deps(instructions: list[Instruction]) -> list[Instruction]:
    """Each instruction's deps: the instructions that define what it reads."""
    index = {ins.name: i for i, ins in enumerate(instructions)}
    return [
        dataclasses.replace(ins, deps=tuple(sorted(index[r] for r in ins.reads if r in index)))
        for ins in instructions
    ]


def _carry_gradients(backward: ProgramSchedule, step_units: frozenset[str]
                     ) -> tuple[ProgramSchedule, list[Instruction]]:
    """The backward without its trailing waits for gradients (reduce-scatters whose results only
    leave the program), and those reduce-scatters, in issue order: the step waits for them.

    [Note: gradients carried into the step]
    The backward's last reduce-scatters (the embedding's, issued after the last compute) would
    otherwise be waited for at the backward's end with nothing left to overlap them. Instead the
    waits the backward ends with move into the step (what is in flight when the backward ends
    does not change): the collectives complete while the step updates the units whose gradients
    arrived first, and the step waits for each gradient right before that unit's update ("the
    optimizer step waits only for what it needs"). The backward's output is then the collective
    itself; `validate` checks that the step program waits for every one of them.
    """
    by_name = {ins.name: ins for ins in backward.instructions}
    read = {r for ins in backward.instructions for r in ins.reads}
    outputs = set(backward.outputs)
    # Only the waits the backward ends with: those placed earlier (the prefetch pass bounds the
    # flat gradients in flight by its budget) stay where they are.
    last = max((i for i, ins in enumerate(backward.instructions) if ins.kind != "wait"), default=-1)
    carried = [
        ins for ins in backward.instructions[last + 1 :]
        if ins.kind == "wait" and ins.name in outputs and ins.name not in read and ins.unit in step_units
        and by_name[ins.reads[0]].kind == "reduce_scatter"
    ]
    if not carried:
        return backward, []
    dropped = {ins.name for ins in carried}
    keep = [i for i, ins in enumerate(backward.instructions) if ins.name not in dropped]
    new_index = {old: new for new, old in enumerate(keep)}
    instructions = tuple(
        dataclasses.replace(backward.instructions[i], deps=tuple(new_index[d] for d in backward.instructions[i].deps
                                                                 if d in new_index))
        for i in keep
    )
    rename = {ins.name: ins.reads[0] for ins in carried}
    program = dataclasses.replace(
        backward, outputs=tuple(rename.get(o, o) for o in backward.outputs), instructions=instructions,
        gathered_bytes=tuple(backward.gathered_bytes[i] for i in keep),
    )
    position = {ins.name: i for i, ins in enumerate(backward.instructions)}
    return program, sorted((by_name[ins.reads[0]] for ins in carried), key=lambda rs: position[rs.name])


def _step_program(layouts: list[UnitLayout], persistent: frozenset[str],
                  tiers: Optional[dict[str, str]] = None, lookahead: int = 1,
                  updated_in_backward: frozenset[str] = frozenset(),
                  carried: Iterable[Instruction] = ()) -> ProgramSchedule:
    """The optimizer step: AdamW on each trainable unit's shard; persistent units re-gathered.

    Units whose gradients are ready are updated first, in layout order; then those whose
    gradient is still in flight (`carried`: its reduce-scatter, issued by the backward), in the
    order they were issued, each waited for right before its update; see [Note: gradients
    carried into the step].

    With offloaded states (`tiers`: state kind -> tier, for the kinds not on the device), each
    unit's step reads its states from their tiers (fetch, wait) and writes back what it changed
    (offload), streamed unit by unit: the fetches of the next `lookahead` units are issued before
    this unit's update, and this unit's writes are waited for `lookahead` units later, so reads,
    writes and the update overlap while only about 2 * lookahead + 1 units' states are in memory.
    """
    tiers = tiers or {}
    in_flight = {ins.unit: ins for ins in carried}
    arrival = {unit: i for i, unit in enumerate(in_flight)}
    trainable = sorted((lay for lay in layouts if lay.trainable and lay.name not in updated_in_backward),
                       key=lambda lay: arrival.get(lay.name, -1))  # stable: the ready ones in layout order

    def fetched(layout: UnitLayout) -> list[str]:
        return [k for k in STATE_KINDS if k in tiers and not (k == "param" and layout.name in persistent)]

    def fetches(layout: UnitLayout) -> list[Instruction]:
        return [_io("fetch", k, layout, tiers[k]) for k in fetched(layout)]

    instructions: list[Instruction] = []
    issued = 0  # units whose fetches are issued
    writes: list[list[Instruction]] = []  # per unit, its offloads still to be waited for
    for i, layout in enumerate(trainable):
        while issued < min(len(trainable), i + 1 + lookahead):
            instructions += fetches(trainable[issued])
            issued += 1
        waits = [_wait(f) for f in fetches(layout)]
        if layout.name in in_flight:
            waits.append(_wait(in_flight[layout.name]))
        instructions += waits
        step = Instruction(
            name=f"optim_step:{layout.name}", kind="optim_step", stream="compute", unit=layout.name,
            reads=tuple(w.name for w in waits), numel=layout.shard_numel,
            bytes=layout.shard_numel * layout.itemsize,
        )
        instructions.append(step)
        if layout.name in persistent:
            start = Instruction(
                name=f"all_gather:{layout.name}", kind="all_gather", stream="comm", unit=layout.name,
                reads=(step.name,), numel=layout.padded_numel, bytes=layout.padded_numel * layout.itemsize,
            )
            instructions += [start, _wait(start)]
        # The update changed the parameter shard and the moments; the gradient is consumed.
        offloads = [_io("offload", k, layout, tiers[k], (step.name,)) for k in fetched(layout) if k != "grad"]
        instructions += offloads
        writes.append(offloads)
        if len(writes) > lookahead:
            instructions += [_wait(o) for o in writes.pop(0)]
    for offloads in writes:
        instructions += [_wait(o) for o in offloads]
    # The re-gathered buffer is the persistent parameter buffer, not a transient one.
    instructions = _with_deps(instructions)
    return ProgramSchedule("step", (), (), tuple(instructions), tuple(0 for _ in instructions))


def build_schedule(programs: dict[str, Any], layouts: list[UnitLayout], *, stage: int,
                   world_size: int, persistent: frozenset[str],
                   prefetch_budget_bytes: Optional[int] = None,
                   tiers: Optional[dict[str, str]] = None, lookahead: int = 1,
                   updated_in_backward: Iterable[str] = ()) -> Schedule:
    """The Schedule of the forward and backward programs (from the split pass) and the step.

    Args:
        tiers: state kind ("param", "grad", "exp_avg", "exp_avg_sq") -> tier name, for the
            states offloaded from the device (the step program fetches and writes them back).
        lookahead: units whose step states are fetched ahead of the one being updated.
        updated_in_backward: units the backward program updates (no step instructions).
    """
    by_name = {u.name: u for u in layouts}
    updated_in_backward = frozenset(updated_in_backward)
    backward = _program_schedule(programs["backward"], by_name)
    stepped = frozenset(u.name for u in layouts if u.trainable and u.name not in updated_in_backward)
    backward, carried = _carry_gradients(backward, stepped)
    progs = (
        _program_schedule(programs["forward"], by_name),
        backward,
        _step_program(layouts, persistent, tiers, lookahead, updated_in_backward, carried),
    )
    schedule = Schedule(
        SCHEDULE_VERSION, stage, world_size, tuple(layouts), progs, fingerprint_of(progs, layouts, stage),
        tuple(u.name for u in layouts if u.name in persistent),
        prefetch_budget_bytes,
    )
    validate(schedule)
    return schedule

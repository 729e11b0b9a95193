"""The schedule: a frozen, versioned, JSON round-trippable program the runtime executes.

`build_schedule` is one pure function from the split programs and the unit layouts to a
`Schedule`: per program ("forward", "backward", "step") an ordered list of instructions, each
on a named stream with its dependencies, bytes and the gathered buffers it touches; a memory
timeline; and a fingerprint of the collective sequence that every rank must share.

`validate` rejects a schedule that would read a collective's result before its wait, use a
gathered buffer after its free, free twice or leave a gathered buffer allocated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Iterable, Optional

import networkx as nx
import torch
import torch.fx as fx
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from fxzero.config import STATE_KINDS
from fxzero.passes.analysis import alias_source, kind
from fxzero.units import UnitLayout

__all__ = [
    "Instruction",
    "ProgramSchedule",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "check_fingerprints",
    "validate",
]

SCHEDULE_VERSION = 1
COLLECTIVES = ("all_gather", "reduce_scatter")
IO = ("fetch", "offload")
"""Transfers between this rank's memory and a storage tier (rank-local: not in the fingerprint)."""
ASYNC = COLLECTIVES + IO
"""Instructions whose result is only valid after their wait."""
STREAM_OF = {"all_gather": "comm", "reduce_scatter": "comm", "fetch": "io", "offload": "io"}  # else "compute"



class ScheduleError(ValueError):
    """A schedule breaks one of the rules `validate` checks."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    """The value it defines (the FX node name in its program's graph)."""
    kind: str
    """compute | all_gather | reduce_scatter | fetch | offload | wait | free | optim_step."""
    stream: str
    """compute | comm | io: collectives run on the comm stream, transfers to and from a storage
    tier (fetch, offload) on the io stream, everything else computes."""
    reads: tuple[str, ...] = ()
    """Values it reads (instruction names or program inputs)."""
    deps: tuple[int, ...] = ()
    """Indices of earlier instructions of the same program it must run after."""
    unit: Optional[str] = None
    touches: tuple[str, ...] = ()
    """Gathered buffers (names of the waits that produced them) it reads, directly or via views."""
    numel: int = 0
    """Elements moved (collectives) or produced (compute)."""
    bytes: int = 0
    """Bytes moved (collectives) or produced (compute)."""
    flops: int = 0
    """Floating point operations (compute; from torch's FLOP formulas, 0 where it has none)."""
    read_bytes: int = 0
    """Bytes of the tensors it reads (compute), for a memory-bound time estimate."""
    algorithm: str = ""
    """How a collective is carried out, when not natively (e.g. a reduce-scatter as all_reduce);
    for a fetch or offload, the tier ("cpu", "nvme")."""
    state: str = ""
    """For a fetch or offload: which state of the unit it moves (one of STATE_KINDS)."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict) -> "Instruction":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclasses.dataclass(frozen=True)
class ProgramSchedule:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    instructions: tuple[Instruction, ...]
    gathered_bytes: tuple[int, ...]
    """Bytes of gathered parameter buffers alive after each instruction."""
    kept: tuple[str, ...] = ()
    """Buffers kept from the forward for the backward: gathered buffers
    (Prefetch.keep_for_backward) and fetched parameter shards (offloaded parameters, see
    passes/offload.py). Outputs of the forward program, inputs of the backward program, which
    frees them."""

    @property
    def peak_gathered_bytes(self) -> int:
        return max(self.gathered_bytes, default=0)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "instructions": [i.to_json() for i in self.instructions],
            "gathered_bytes": list(self.gathered_bytes),
            "kept": list(self.kept),
        }

    @classmethod
    def from_json(cls, d: dict) -> "ProgramSchedule":
        return cls(
            d["name"],
            tuple(d["inputs"]),
            tuple(d["outputs"]),
            tuple(Instruction.from_json(i) for i in d["instructions"]),
            tuple(d["gathered_bytes"]),
            tuple(d.get("kept", ())),
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    version: int
    stage: int
    world_size: int
    units: tuple[UnitLayout, ...]
    programs: tuple[ProgramSchedule, ...]
    fingerprint: str
    persistent: tuple[str, ...] = ()
    """Units held whole for the whole step (ZeRO-1/2, or under the persistence threshold)."""
    prefetch_budget_bytes: Optional[int] = None
    """The prefetch pass's budget for gathered buffers alive at once (None: no prefetch)."""

    def program(self, name: str) -> ProgramSchedule:
        for p in self.programs:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def peak_gathered_bytes(self) -> int:
        return max(p.peak_gathered_bytes for p in self.programs)

    def _kept(self, source: str) -> tuple[str, ...]:
        forward = self.program("forward")
        kept = set(forward.kept)
        kinds = {i.name: i.kind for i in forward.instructions}
        return tuple(i.unit for i in forward.instructions if i.name in kept and kinds.get(i.reads[0]) == source)

    @property
    def kept_for_backward(self) -> tuple[str, ...]:
        """Units whose forward gather the backward reuses (Prefetch.keep_for_backward)."""
        return self._kept("all_gather")

    @property
    def shards_kept_for_backward(self) -> tuple[str, ...]:
        """Offloaded units whose parameter shard, fetched in the forward, the backward reuses."""
        return self._kept("fetch")

    def collectives(self) -> list[tuple[str, Instruction]]:
        return [(p.name, i) for p in self.programs for i in p.instructions if i.kind in COLLECTIVES]

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "stage": self.stage,
            "world_size": self.world_size,
            "units": [u.to_json() for u in self.units],
            "programs": [p.to_json() for p in self.programs],
            "fingerprint": self.fingerprint,
            "persistent": list(self.persistent),
            "prefetch_budget_bytes": self.prefetch_budget_bytes,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, d: dict) -> "Schedule":
        if d.get("version") != SCHEDULE_VERSION:
            raise ValueError(
                f"schedule version {d.get('version')!r} is not {SCHEDULE_VERSION}; "
                "recompile the model with this fxzero to get a current schedule"
            )
        return cls(
            d["version"],
            d["stage"],
            d["world_size"],
            tuple(UnitLayout.from_json(u) for u in d["units"]),
            tuple(ProgramSchedule.from_json(p) for p in d["programs"]),
            d["fingerprint"],
            tuple(d.get("persistent", ())),
            d.get("prefetch_budget_bytes"),
        )

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        return cls.from_json(json.loads(text))


# ---------------------------------------------------------------------------------------------
# Building


def _value_bytes(val: Any) -> tuple[int, int]:
    if isinstance(val, torch.Tensor):
        return val.numel(), val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        parts = [_value_bytes(v) for v in val]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    return 0, 0


def _flops(node: fx.Node) -> int:
    """FLOPs of an ATen node by torch's own formulas (matmuls, convolutions, attention)."""
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0

    def val(a):
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args, kwargs = tree_map(val, (node.args, node.kwargs))
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that cannot read these arguments: count nothing, never fail
        return 0


def _gathered_root(node: fx.Node) -> Optional[fx.Node]:
    """The gathered buffer (an all_gather's wait) that node's value views, if any."""
    while True:
        if node.meta.get("fxzero", {}).get("kept") == "gathered":  # in the backward: a placeholder
            return node
        if kind(node) == "wait" and node.args and kind(node.args[0]) == "all_gather":
            return node
        src = alias_source(node)
        if src is None:
            return None
        node = src


def instruction_of(node: fx.Node, layouts: dict[str, UnitLayout]) -> Instruction:
    """The instruction a node of a program becomes (kind, stream, bytes, FLOPs; no deps yet)."""
    meta = node.meta.get("fxzero", {})
    k = meta.get("kind")
    unit = meta.get("unit")
    k = k if k in ("all_gather", "reduce_scatter", "wait", "free", "optim_step", *IO) else "compute"
    touches = sorted({r.name for r in map(_gathered_root, node.all_input_nodes) if r is not None})
    algorithm = meta.get("algorithm", "") if k in ASYNC else ""
    if k in COLLECTIVES:
        layout = layouts[unit]
        numel = layout.padded_numel
        nbytes = numel * layout.itemsize
    elif k in IO or k == "optim_step":
        layout = layouts[unit]
        numel = layout.shard_numel
        nbytes = numel * layout.itemsize
    else:
        numel, nbytes = _value_bytes(node.meta.get("val"))
    flops = _flops(node) if k == "compute" else 0
    read_bytes = sum(_value_bytes(i.meta.get("val"))[1] for i in node.all_input_nodes) if k == "compute" else 0
    if k == "compute" and alias_source(node) is not None:
        nbytes = read_bytes = 0  # a view moves no data
    return Instruction(
        name=node.name,
        kind=k,
        stream=STREAM_OF.get(k, "compute"),
        reads=tuple(n.name for n in node.all_input_nodes),
        unit=unit if k != "compute" else meta.get("unit"),
        touches=tuple(touches),
        numel=numel,
        bytes=nbytes,
        flops=flops,
        read_bytes=read_bytes,
        algorithm=algorithm,
        state=meta.get("state", "") if k in IO else "",
    )


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
        for root in filter(None, map(_gathered_root, n.all_input_nodes)):
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


def fingerprint_of(programs: Iterable[ProgramSchedule], units: Iterable[UnitLayout], stage: int) -> str:
    """A digest of everything every rank must agree on: layouts and the collective sequence."""
    h = hashlib.sha256(f"stage={stage};".encode())
    for u in units:
        h.update(json.dumps(u.to_json(), sort_keys=True).encode())
    for p in programs:
        for i in p.instructions:
            if i.kind in COLLECTIVES:
                h.update(f"{p.name}|{i.kind}|{i.algorithm}|{i.unit}|{i.numel}|{i.bytes};".encode())
    return h.hexdigest()[:16]


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


# ---------------------------------------------------------------------------------------------
# Validation


def _validate_program(p: ProgramSchedule, carried_in: Optional[dict[str, Instruction]] = None
                      ) -> dict[str, Instruction]:
    """Check one program; `carried_in` are collectives an earlier program left in flight for
    this one to wait for. Returns those this program leaves in flight (its outputs)."""
    defined = set(p.inputs)
    # collective and transfer results not yet waited for
    pending: dict[str, Instruction] = dict(carried_in or {})
    # gathered buffers and fetched shards, which must be freed (those kept from the forward too)
    live: set[str] = set(p.kept) & defined
    freed: set[str] = set()
    names = [i.name for i in p.instructions]
    for idx, ins in enumerate(p.instructions):
        where = f"{p.name} program, instruction {idx} ({ins.kind} {ins.name})"
        for dep in ins.deps:
            if not 0 <= dep < idx:
                raise ScheduleError(f"{where}: depends on instruction {dep}, which does not run before it")
        for r in ins.reads:
            if r in pending and ins.kind != "wait":
                raise ScheduleError(
                    f"{where}: reads {r}, the result of a {pending[r].kind} of unit "
                    f"{pending[r].unit!r}, before its wait (missing wait)"
                )
            if r not in defined and r not in pending:
                raise ScheduleError(f"{where}: reads {r} before it is defined")
        for b in ins.touches if ins.kind != "free" else ():  # a free is checked below
            if b in freed:
                raise ScheduleError(f"{where}: uses gathered buffer {b} after it was freed")
        if ins.kind in ASYNC:
            pending[ins.name] = ins
            continue
        if ins.kind == "wait":
            (src,) = ins.reads
            if src not in pending:
                raise ScheduleError(f"{where}: waits for {src}, which is not an outstanding collective or transfer")
            # The step program re-gathers into the persistent parameter buffers (ZeRO-1/2),
            # which are never freed, and its fetched states are consumed by the update; in the
            # forward and backward every gather and every fetch makes a transient buffer.
            if pending.pop(src).kind in ("all_gather", "fetch") and p.name != "step":
                live.add(ins.name)
        if ins.kind == "free":
            (buf,) = ins.reads
            if buf in freed:
                raise ScheduleError(f"{where}: frees {buf} a second time (double free)")
            if buf not in live:
                raise ScheduleError(f"{where}: frees {buf}, which is not a gathered or fetched buffer")
            live.discard(buf)
            freed.add(buf)
        defined.add(ins.name)
    carried_out = {name: ins for name, ins in pending.items()
                   if name in p.outputs and ins.kind == "reduce_scatter" and name not in (carried_in or {})}
    for name in carried_out:
        del pending[name]
    if pending:
        first = next(iter(pending.values()))
        raise ScheduleError(
            f"{p.name} program: {first.kind} {first.name} of unit {first.unit!r} is never waited for (missing wait)"
        )
    live -= set(p.kept) & set(p.outputs)  # kept for the backward, which frees them
    if live:
        raise ScheduleError(f"{p.name} program: gathered or fetched buffers {sorted(live)} are never freed")
    assert len(set(names)) == len(names), f"duplicate instruction names in {p.name}"
    return carried_out


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError if the schedule breaks a rule; the message names the instruction."""
    if schedule.fingerprint != fingerprint_of(schedule.programs, schedule.units, schedule.stage):
        raise ScheduleError(
            "schedule fingerprint does not match its contents: the schedule was edited after "
            "it was built; rebuild it with build_schedule"
        )
    carried: dict[str, Instruction] = {}  # a program's reduce-scatters the next one waits for
    for p in schedule.programs:
        carried = _validate_program(p, carried)
    if carried:
        first = next(iter(carried.values()))
        raise ScheduleError(f"{first.kind} {first.name} of unit {first.unit!r} is never waited for (missing wait)")


def check_fingerprints(fingerprints: list[str], *, rank: int) -> None:
    """Raise if the ranks' schedule fingerprints differ (they would issue different collectives)."""
    if len(set(fingerprints)) > 1:
        groups: dict[str, list[int]] = {}
        for r, fp in enumerate(fingerprints):
            groups.setdefault(fp, []).append(r)
        detail = "; ".join(f"ranks {rs}: {fp}" for fp, rs in groups.items())
        raise RuntimeError(
            f"[rank {rank}] the ranks compiled different schedules ({detail}), so they would "
            "issue different collectives and hang; make sure every rank builds the same model "
            "with the same config and the same input shapes"
        )

"""Validation: the rules a schedule must keep before it runs, and the ranks' fingerprints.

`validate` rejects a schedule that would read a collective's result before its wait, use a
gathered buffer after its free, free twice or leave a gathered buffer allocated, or break a rule
of the streams ([Note: stream rules]);
`collective_sequence` is what a step issues, which every rank must issue alike: the engine
compares the ranks' digests before each step and `first_difference` turns a difference into an
error on every rank, instead of a hang.
"""

from __future__ import annotations

import hashlib
import json
from typing import Iterable, Optional

from fxzero.ir.instruction import ASYNC, COLLECTIVES, Instruction
from fxzero.ir.layout import UnitLayout
from fxzero.schedule.types import ProgramSchedule, Schedule, ScheduleError

__all__ = ["collective_sequence", "fingerprint_of", "first_difference", "sequence_digest", "validate"]


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


def _validate_program(p: ProgramSchedule, carried_in: Optional[dict[str, Instruction]] = None
                      ) -> dict[str, Instruction]:
    """Check one program; `carried_in` are collectives an earlier program left in flight for
    this one to wait for. Returns those this program leaves in flight (its outputs)."""
    defined = set(p.inputs)
    # collective and transfer results not yet waited for
    pending: dict[str, Instruction] = dict(carried_in or {})
    # gathered buffers and fetched shards, which must be freed (those kept from the forward too)
    live: set[str] = set(p.kept_names) & defined
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
            # A gathered buffer or a fetched shard is transient: it must be freed. (The step
            # program's gathers refill the persistent buffers, which are never freed.)
            if pending.pop(src).buffer in ("gathered", "fetched"):
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
    live -= set(p.kept_names) & set(p.outputs)  # kept for the backward, which frees them
    if live:
        raise ScheduleError(f"{p.name} program: gathered or fetched buffers {sorted(live)} are never freed")
    assert len(set(names)) == len(names), f"duplicate instruction names in {p.name}"
    return carried_out


def _ancestors(p: ProgramSchedule) -> list[int]:
    """For each instruction, the set of instructions it runs after through its dependencies,
    directly or not, as a bit set (bit j: instruction j)."""
    out: list[int] = []
    for ins in p.instructions:
        bits = 0
        for d in ins.deps:
            bits |= (1 << d) | out[d]
        out.append(bits)
    return out


def _check_streams(p: ProgramSchedule) -> None:
    """[Note: stream rules]

    The runtime may run each stream on its own device queue (compute; collectives; copies to
    and from a tier), ordered across queues only by the events it records after an instruction
    and waits for before another: the schedule's dependencies. So these must hold, checked here
    on every schedule (the "missing wait" and "use after free" rules above are the third and the
    order on the compute stream):

    1. A side-stream instruction runs after every instruction that made a value it reads (an
       all-gather after the cast that wrote its shard, a reduce-scatter after the compute that
       flattened its gradient): otherwise the side stream reads a buffer still being written.
    2. A free runs after every instruction that read the buffer it frees, and where a reader is
       on a side stream, after that reader's wait: a buffer is released (and its memory reused)
       only once every stream that touched it is past its last use. (No `record_stream`: as FSDP2
       and torch's own offloading, the order is the schedule's, not the caching allocator's.)
    """
    ancestors = _ancestors(p)
    index = {ins.name: i for i, ins in enumerate(p.instructions)}
    wait_of = {ins.reads[0]: i for i, ins in enumerate(p.instructions) if ins.kind == "wait"}
    for idx, ins in enumerate(p.instructions):
        where = f"{p.name} program, instruction {idx} ({ins.kind} {ins.name}"
        if ins.stream != "compute":
            for r in ins.reads:
                j = index.get(r)
                if j is not None and j < idx and p.instructions[j].stream == "compute" and not ancestors[idx] >> j & 1:
                    raise ScheduleError(
                        f"{where}, on the {ins.stream} stream): reads {r}, made by instruction {j} on the compute "
                        "stream, without depending on it (no event orders them: the side stream may read it before "
                        "it is written)")
        if ins.kind != "free":
            continue
        (buf,) = ins.reads
        for j, other in enumerate(p.instructions[:idx]):
            if buf not in other.touches and buf not in other.reads or other.kind == "wait" and other.name == buf:
                continue
            after = wait_of.get(other.name, j) if other.stream != "compute" else j
            if not ancestors[idx] >> after & 1:
                what = f"the wait of {other.kind} {other.name}" if after != j else f"{other.kind} {other.name}"
                raise ScheduleError(
                    f"{where}): frees {buf} without depending on {what} (instruction {after}), which "
                    f"{'reads it on the ' + other.stream + ' stream' if other.stream != 'compute' else 'reads it'}: "
                    "the buffer could be reused while a stream still reads it")


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
        _check_streams(p)
    if carried:
        first = next(iter(carried.values()))
        raise ScheduleError(f"{first.kind} {first.name} of unit {first.unit!r} is never waited for (missing wait)")


def collective_sequence(schedule) -> tuple[str, ...]:
    """The collectives a step of `schedule` issues, in issue order, one line each: what every rank
    must issue alike. They do not depend on the inputs' shapes (each unit's gathers and
    reductions move its own flat buffer), so ranks whose inputs differ in shape agree on them."""
    return tuple(f"{program}: {ins.kind} of {ins.unit or '-'} ({ins.numel} x {ins.dtype or '?'}"
                 f"{', as ' + ins.algorithm if ins.algorithm else ''})"
                 for program, ins in schedule.collectives())


def sequence_digest(sequence: tuple[str, ...]) -> int:
    """A signed 63-bit digest of a collective sequence, cheap to compare across ranks."""
    import hashlib

    return int.from_bytes(hashlib.blake2b("\n".join(sequence).encode(), digest_size=8).digest(), "big") >> 1


def first_difference(sequences: list[tuple[str, ...]], *, rank: int) -> RuntimeError:
    """The error every rank raises when the ranks' collective sequences differ: the ranks of each
    sequence, and the first collective where they part."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, seq in enumerate(sequences):
        groups.setdefault(seq, []).append(r)
    (a, ranks_a), (b, ranks_b) = list(groups.items())[:2]
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    at = lambda seq: seq[i] if i < len(seq) else "(nothing: its step ends)"  # noqa: E731
    hint = ("Every rank must compile the same collectives: the same model, config and training mode on every rank, "
            "and no Python branch in the forward on an input's shape or values or on the rank (shapes may differ; "
            "the branches they take may not). A module whose forward chooses which of its children run (a "
            "mixture of experts' router) can be a ZeRO-3 leaf instead: deepspeed.utils.set_z3_leaf_modules(model, "
            "[ItsClass]) or Config.leaf_modules, and its parameters are gathered as one unit whatever runs")
    if any(s and not s[0].startswith(("forward:", "backward:", "step:")) for s in (a, b)):
        hint = ("Gathering the model's parameters (model.state_dict() at ZeRO-3, fxzero.zero.GatheredParameters) "
                "is a collective: call it on every rank at the same point, for the same module and parameters")
    if any(at(s).startswith(WRITTEN) for s in (a, b)):  # ([Note: writes into the user's module])
        wrote = lambda seq: at(seq) if at(seq).startswith(WRITTEN) else "no such write"  # noqa: E731
        return RuntimeError(
            f"[rank {rank}] the ranks wrote different values into the model after compile: ranks {ranks_a}: "
            f"{wrote(a)}; ranks {ranks_b}: {wrote(b)}. Each rank computes with its own values, so every rank must make "
            "the same writes: model.load_state_dict(sd) on every rank with the same state dict (fxzero broadcasts "
            "nothing), initializations drawn alike on every rank, or a write inside "
            "fxzero.zero.GatheredParameters(params, modifier_rank=0), which gives rank 0's values to every rank")
    return RuntimeError(
        f"[rank {rank}] the ranks' programs would issue different collectives, which would hang: at collective "
        f"{i}, ranks {ranks_a} issue {at(a)} and ranks {ranks_b} issue {at(b)}. {hint}")


WRITTEN = "values written into "
"""How the forward's agreement lines that announce a rank's writes into the model begin."""

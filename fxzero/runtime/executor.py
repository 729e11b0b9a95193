"""Execute exactly the schedule: one instruction at a time, collectives and I/O asynchronous.

`ProgramRunner` walks a `ProgramSchedule` (forward, backward or step) in order. Compute
instructions call their FX node's ATen target; `all_gather`, `reduce_scatter`, `fetch` and
`offload` start an asynchronous collective or transfer whose handle is kept until the matching
`wait`; `free` hands a buffer back (to the pool, or resized to zero, so a use after free fails
loudly instead of reading stale data); `optim_step` calls the engine's optimizer on the shard.
What each fxzero instruction does is read from its fields (buffer, tier, state, keep_full,
aligned, dtype), never from the graph. A value is dropped from the environment right after its
last reader, so activations and gathered views die as early as the schedule says.

[Note: accumulating on a tier]
With gradients on a tier (offloaded with the optimizer states) and gradient accumulation, the
backward's `offload` of a gradient shard adds what the tier holds before writing: the sum of
the micro-steps lives on the tier, as DeepSpeed's offloaded gradients accumulate in host memory.
The first backward of an accumulation overwrites (the step cleared nothing on the tier: the
engine's gradients dict is empty, so `accumulate_grads` is False). The read is synchronous, so
a micro-step after the first pays one read of each shard in its backward.

[Note: accumulating locally]
With Config(gradient_accumulation="local"), a backward before the accumulation's boundary does
not reduce: each unit's flat gradient, the buffer its reduce-scatter would read, is kept
whole in `unreduced` (the next micro-step's adds into it), and the reduce-scatter yields an
empty token that its wait, the gradient checks and the tier writes pass through. The
boundary's backward adds what was kept into its flat gradient and reduces that, once per
optimizer step: traffic / gradient_accumulation_steps, at the price of the full gradients
held in between (FSDP2's set_requires_gradient_sync(False)).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx as fx

from fxzero._compat import pytree
from fxzero.ir.instruction import Instruction
from fxzero.runtime.activation_store import ActivationStore
from fxzero.runtime.comm import Comm, Pending
from fxzero.runtime.storage.aligned import aligned_empty
from fxzero.runtime.storage.offload_store import OffloadStore
from fxzero.runtime.storage.pool import BufferPool
from fxzero.schedule import ProgramSchedule

__all__ = ["GatheredMemory", "GradientFlags", "ProgramRunner", "Timed", "Update"]


def _binder(tree: Any) -> Callable[[dict], Any]:
    """A function of the environment giving `tree` (an instruction's arguments) with each fx.Node
    replaced by its value. The structure is walked once, when the instruction compiles; walking it
    at every run (`pytree.tree_map`) cost about a tenth of a small model's step."""
    if isinstance(tree, fx.Node):
        name = tree.name
        return lambda env: env[name]
    if not any(isinstance(leaf, fx.Node) for leaf in pytree.tree_leaves(tree)):
        return lambda env: tree
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):  # (not a namedtuple)
        parts = [_binder(item) for item in tree]
        if isinstance(tree, tuple):
            return lambda env: tuple([part(env) for part in parts])
        return lambda env: [part(env) for part in parts]
    if isinstance(tree, dict):
        items = [(key, _binder(value)) for key, value in tree.items()]
        return lambda env: {key: part(env) for key, part in items}
    return lambda env: pytree.tree_map(lambda a: env[a.name] if isinstance(a, fx.Node) else a, tree)


class Timed(NamedTuple):
    """One executed instruction of a recorded timeline."""

    program: str
    index: int
    start: float
    end: float


Update = Callable[..., None]
"""`update(ins, param, grad, *states)`: an `optim_step`, in place (the engine's optimizer); `states`
are the optimizer's per-element states in the order its policy declares them (AdamW's exp_avg and
exp_avg_sq, Adagrad's sum): the instruction's reads after the parameter and the gradient."""


@dataclasses.dataclass
class GatheredMemory:
    """Bytes of gathered parameter buffers alive now, and the most seen at once; likewise for
    state shards fetched from a storage tier (staged), which live until they are freed."""

    current: int = 0
    peak: int = 0
    staged: int = 0
    staged_peak: int = 0

    def add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def stage(self, n: int) -> None:
        self.staged += n
        self.staged_peak = max(self.staged_peak, self.staged)


@dataclasses.dataclass
class GradientFlags:
    """What the backward found of the gradient shards since the last step: what its `check`
    instructions saw (float16), and the sum of squares of each shard it wrote to a tier (for
    the global norm, which the step can no longer read from memory).

    Both stay tensors on the gradients' device ([Note: no host sync in a step] in
    `fxzero/runtime/stepping.py`): the backward never waits for the device to read them."""

    checks: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    """(unit, 1.0 where its gradient shard was not finite, else 0.0), in the order checked."""
    sum_of_squares: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """unit -> sum of squares (float64) of the gradient shard last written to its tier (after an
    accumulation's additions, so the last micro-step's is the accumulated gradient's)."""

    def record(self, unit: str, grad: torch.Tensor) -> None:
        self.checks.append((unit, torch.isfinite(grad).all().logical_not().to(torch.float32).reshape(1)))

    def nonfinite(self, device: torch.device) -> torch.Tensor:
        """How many checks found a gradient that is not finite (a float32 tensor of one element)."""
        if not self.checks:
            return torch.zeros(1, device=device)
        return torch.stack([flag for _, flag in self.checks]).sum(0)

    def first(self) -> Optional[str]:
        """The first unit whose gradient was not finite (reads the flags: for error messages)."""
        return next((unit for unit, flag in self.checks if flag.item() > 0), None)

    def reset(self) -> None:
        self.checks.clear()
        self.sum_of_squares.clear()


class CollectiveTimeout(RuntimeError):
    """A collective whose peers did not arrive within `Config.collective_timeout`."""


def is_timeout(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is a collective's timeout (gloo's, NCCL's, the shared-memory barrier's)."""
    while e is not None:
        text = str(e).lower()
        if "timed out" in text or "timeout" in text:
            return True
        e = e.__cause__
    return False


class _Written(NamedTuple):
    """An offload in flight; its wait yields an empty token (the value now lives in its tier)."""

    pending: Any

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        return _TOKEN


_TOKEN = torch.empty(0)


def last_reads(program: ProgramSchedule) -> dict[int, list[str]]:
    """For each instruction index, the values whose last reader it is (outputs are never dropped)."""
    last: dict[str, int] = {}
    for i, ins in enumerate(program.instructions):
        for r in ins.reads:
            last[r] = i
    keep = set(program.outputs)
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            out.setdefault(i, []).append(name)
    return out


class ProgramRunner:
    """Runs one scheduled program against its FX graph (whose nodes the compute instructions call).

    Args:
        store: the offloaded states (programs with fetch / offload instructions).
        update: runs `optim_step` instructions (programs that update units).
        pool: per-unit buffers reused across units and steps.
        flags: where `check` instructions record non-finite gradients (shared by the engine).
        activations: where saved activations go (programs with activation offloads and fetches).
    """

    def __init__(self, program: ProgramSchedule, gm: fx.GraphModule, comm: Comm, memory: GatheredMemory,
                 store: Optional[OffloadStore] = None, update: Optional[Update] = None,
                 pool: Optional[BufferPool] = None, flags: Optional[GradientFlags] = None,
                 activations: Optional[ActivationStore] = None):
        self.program = program
        self.activations = activations
        self.flags = flags if flags is not None else GradientFlags()
        self.comm = comm
        self.memory = memory
        self.store = store
        self.update = update
        self.pool = pool or BufferPool(per_size=0)  # per_size 0: nothing kept
        self._kept_buffer = {k.name: k.buffer for k in program.kept}
        fetched = {i.name for i in program.instructions if i.kind == "fetch" and i.state == "activation"}
        self._activation_buffers = {i.name for i in program.instructions if i.kind == "wait" and i.reads[0] in fetched}
        self._inputs = frozenset(program.inputs)
        nodes = {n.name: n for n in gm.graph.nodes}
        self.steps: list[tuple[Instruction, Callable[[dict], Any]]] = [
            (ins, self._compile(ins, nodes[ins.name])) for ins in program.instructions
        ]
        self.drop_after = last_reads(program)
        self.accumulate_grads = False
        self.divide_before = False
        """Config.gradient_division == "before": each rank's gradient divided by the world size
        before the reduce-scatter sums it."""
        self.unreduced: Optional[dict[str, torch.Tensor]] = None
        self.defer_reduction = False
        """Config(gradient_accumulation="local"): the full gradients kept since the last boundary
        (unit -> flat buffer), and whether this backward adds into them instead of reducing."""
        """Whether gradient shards written to a tier add to what the tier holds (the engine sets
        it for each backward after the first of an accumulation)."""

    def _compile(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        """A closure computing the instruction from the environment."""
        build = getattr(self, f"_{ins.kind}", None)
        if build is None:
            raise AssertionError(f"instruction kind {ins.kind!r} cannot run in a graph program")
        return build(ins, node)

    def _compute(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        if ins.buffer == "flat_grad":
            return self._flatten_grads(node)
        target, args_of, kwargs_of = node.target, _binder(tuple(node.args)), _binder(dict(node.kwargs))

        def compute(env: dict) -> Any:
            return target(*args_of(env), **kwargs_of(env))

        return compute

    def _flatten_grads(self, node: fx.Node) -> Callable[[dict], Any]:
        """fxzero::flatten_grads into a pooled buffer (its reduce-scatter hands it back)."""
        grads_in, numels, padded, dtype = node.args

        def flatten(env: dict) -> torch.Tensor:
            out = self.pool.take(padded, dtype)
            offset = 0
            for g, n in zip(grads_in, numels):
                if g is None:
                    out[offset : offset + n].zero_()
                else:
                    out[offset : offset + n].copy_(env[g.name].reshape(-1))
                offset += n
            out[offset:].zero_()  # padding
            return out

        return flatten

    def _all_gather(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        (src,) = ins.reads
        if ins.buffer == "persistent":
            # Every rank updated its own slice of the unit's full buffer; gather the others' into it.
            def regather(env: dict) -> Pending:
                full = env[src]
                n = full.numel() // self.comm.world_size
                mine = full[self.comm.rank * n : (self.comm.rank + 1) * n].clone()
                return self.comm.all_gather(full, mine)

            return regather

        def all_gather(env: dict) -> Pending:
            shard = env[src]
            numel = shard.numel() * self.comm.world_size
            out = self.pool.take(numel, shard.dtype) if shard.device.type == "cpu" else shard.new_empty(numel)
            self.memory.add(ins.bytes)
            return self.comm.all_gather(out, shard)

        return all_gather

    def _reduce_scatter(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        (src,) = ins.reads
        via_all_reduce = ins.algorithm == "all_reduce"

        def reduce_scatter(env: dict) -> Pending:
            flat = env[src]
            held = self.unreduced
            if held is not None:  # [Note: accumulating locally]
                earlier = held.pop(ins.unit, None)
                if earlier is not None:
                    flat.add_(earlier)
                    self.pool.give(earlier)
                if self.defer_reduction:
                    held[ins.unit] = flat  # (out of the pool until the boundary's backward)
                    return Pending(None, _TOKEN)
            n = flat.numel() // self.comm.world_size
            # A gradient shard written to a tier is written from an aligned buffer (O_DIRECT in place).
            out = aligned_empty(n, flat.dtype) if ins.aligned and flat.device.type == "cpu" else flat.new_empty(n)
            pending = self.comm.reduce_scatter(out, flat, via_all_reduce=via_all_reduce,
                                               divide_before=self.divide_before)
            if not ins.keep_full:
                # The flat gradient goes back to the pool once the collective has read it.
                finish_first = pending.finish

                def release() -> torch.Tensor:
                    result = finish_first() if finish_first else pending.result
                    self.pool.give(flat)
                    return result

                return pending._replace(finish=release)
            # ZeRO-1: the averaged shard goes back into this rank's slice of the full buffer,
            # which stays allocated as the unit's gradient.
            mine = flat[self.comm.rank * n : (self.comm.rank + 1) * n]

            def finish() -> torch.Tensor:
                result = pending.finish() if pending.finish else pending.result
                return mine.copy_(result)

            return pending._replace(finish=finish)

        return reduce_scatter

    def _fetch(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        if ins.state == "activation":  # [Note: activations on a tier, at run time] (activation_store.py)
            return self._fetch_activation(ins)
        store = self._need_store(ins)
        dtype = getattr(torch, ins.dtype)

        def fetch(env: dict) -> Any:
            self.memory.stage(ins.bytes)
            return store.fetch(ins.state, ins.unit, ins.numel, dtype, pool=self.pool)

        return fetch

    def _fetch_activation(self, ins: Instruction) -> Callable[[dict], Any]:
        stash, (receipt,), dtype = self._need_activations(ins), ins.reads, getattr(torch, ins.dtype)

        def fetch_activation(env: dict) -> Any:
            self.memory.stage(ins.bytes)  # (counted with the fetched shards until its free)
            return stash.read(env[receipt], ins.numel, dtype, self.pool)

        return fetch_activation

    def _need_activations(self, ins: Instruction) -> ActivationStore:
        if self.activations is None:
            raise RuntimeError(f"{ins.kind} {ins.name}: the program moves saved activations but no activation "
                               "store was given")
        return self.activations

    def _offload(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        if ins.state == "activation":
            stash, (src,) = self._need_activations(ins), ins.reads
            return lambda env: stash.write(ins, env[src])
        store = self._need_store(ins)
        (src,) = ins.reads
        if ins.state != "grad":
            return lambda env: _Written(store.write(ins.state, ins.unit, env[src]))

        def offload_grad(env: dict) -> _Written:
            grad = env[src]
            if grad.numel() == 0:  # deferred ([Note: accumulating locally]): nothing to write
                return _Written(Pending(None, grad))
            if self.accumulate_grads:  # [Note: accumulating on a tier]
                grad = grad.add_(store.fetch("grad", ins.unit, grad.numel(), grad.dtype).wait())
            self.flags.sum_of_squares[ins.unit] = torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2
            return _Written(store.write("grad", ins.unit, grad))

        return offload_grad

    def _optim_step(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        if self.update is None:
            raise RuntimeError(f"optim_step {ins.name}: the program updates units but no optimizer was given")
        update, reads = self.update, ins.reads
        return lambda env: update(ins, *(env[r] for r in reads))

    def _cast(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        low_name, master_name = ins.reads
        rank, world = self.comm.rank, self.comm.world_size

        def cast(env: dict) -> None:
            low, master = env[low_name], env[master_name]
            if ins.buffer == "persistent":  # the unit's whole buffer: this rank's slice of it
                n = low.numel() // world
                low = low[rank * n : (rank + 1) * n]
            low.copy_(master)

        return cast

    def _check(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        (src,) = ins.reads
        flags, unit = self.flags, ins.unit

        def check(env: dict) -> torch.Tensor:
            flags.record(unit, env[src])
            return _TOKEN

        return check

    def _wait(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        (src,) = ins.reads
        if src in self._inputs:
            # A collective an earlier program left in flight; the engine may have settled it
            # already (memory_report waits for the gradients in flight).
            return lambda env: env[src].wait() if isinstance(env[src], (Pending, _Written)) else env[src]
        return lambda env: env[src].wait()

    def _free(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        (src,) = ins.reads
        staged = ins.buffer == "fetched"
        if src in self._activation_buffers:  # uncounted; its memory goes when the program drops it, not to the pool
            return lambda env: self.memory.stage(-env[src].numel() * env[src].element_size())
        return lambda env: self.release(env[src], staged)

    def _timed_out(self, index: int, ins: Instruction, error: Exception) -> "CollectiveTimeout":
        waited = ins.reads[0] if ins.kind == "wait" and ins.reads else ins.name
        return CollectiveTimeout(
            f"[rank {self.comm.rank}] a collective timed out in the {self.program.name} program at instruction "
            f"{index} ({ins.kind} {ins.name} of {waited}, unit {ins.unit or '-'}): the other ranks did not join it "
            f"within Config.collective_timeout (a rank died, or went another way). {error}")

    def release(self, buf: torch.Tensor, staged: bool = False) -> None:
        """Free a gathered buffer (or, `staged`, a fetched shard): uncount it and hand it back
        to the pool."""
        if staged:  # counted by its tensor's bytes, as the fetch counted it
            self.memory.stage(-buf.numel() * buf.element_size())
        else:
            self.memory.add(-buf.untyped_storage().nbytes())
        self.pool.give(buf)

    def release_kept(self, name: str, value: torch.Tensor) -> None:
        """Free a buffer this (forward) program kept for a backward that will not run."""
        self.release(value, self._kept_buffer[name] == "fetched")

    def _need_store(self, ins: Instruction) -> OffloadStore:
        if self.store is None:
            raise RuntimeError(f"{ins.kind} {ins.name}: the program moves offloaded state but no store was given")
        return self.store

    @torch.no_grad()
    def run(self, inputs: dict[str, Any], record: Optional[list] = None) -> list[Any]:
        """Run the program on `inputs` (consumed: the dict is emptied).

        Args:
            record: if given, one `Timed(program, index, start, end)` per instruction is
                appended (time.perf_counter seconds), the recorded timeline of this run.
        """
        missing = self._inputs - set(inputs)
        assert not missing, f"{self.program.name} program is missing inputs {sorted(missing)}"
        env = dict(inputs)
        inputs.clear()  # the caller's dict must not keep values alive past their last use
        clock = time.perf_counter
        for i, (ins, fn) in enumerate(self.steps):
            start = clock() if record is not None else 0.0
            try:
                env[ins.name] = fn(env)
            except Exception as e:
                if is_timeout(e):
                    raise self._timed_out(i, ins, e) from e
                raise
            if record is not None:
                record.append(Timed(self.program.name, i, start, clock()))
            for name in self.drop_after.get(i, ()):
                del env[name]
        return [env[name] for name in self.program.outputs]

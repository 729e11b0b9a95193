"""Execute exactly the schedule: one instruction at a time, collectives asynchronous.

The executor walks a `ProgramSchedule` in order. Compute instructions call their FX node's
ATen target; `all_gather` and `reduce_scatter` start an asynchronous collective whose handle is
kept until the matching `wait`; `free` resizes a gathered buffer's storage to zero, so a use
after free fails loudly instead of reading stale data. A value is dropped from the environment
right after its last reader, so activations and gathered views die as early as the schedule says.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from fxzero.ir.ops import OPS
from fxzero.ir.tags import kind as kind_of
from fxzero.runtime.comm import Comm, Pending
from fxzero.runtime.storage.pool import BufferPool
from fxzero.runtime.storage.aligned import aligned_empty
from fxzero.ir.instruction import Instruction
from fxzero.schedule import ProgramSchedule

if TYPE_CHECKING:
    from fxzero.runtime.storage.offload_store import OffloadStore

__all__ = ["GatheredMemory", "ProgramRunner", "Timed"]


class Timed(NamedTuple):
    """One executed instruction of a recorded timeline."""

    program: str
    index: int
    start: float
    end: float

_RUNTIME_TARGET = {torch.ops.aten.view.default: torch.ops.aten.reshape.default}


@dataclasses.dataclass
class GatheredMemory:
    """Bytes of gathered parameter buffers alive now, and the most seen at once; likewise for
    shards fetched from a storage tier (staged), which live until their gather is done."""

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


class _Written(NamedTuple):
    """An offload in flight; its wait yields an empty token (the value now lives in its tier)."""

    pending: Any

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        return _TOKEN


_TOKEN = torch.empty(0)


def _is_fetched_shard(node: fx.Node) -> bool:
    """Whether `node` (a free's operand) is a parameter shard fetched from a tier: a fetch's
    wait, or, in the backward, such a shard kept from the forward (a placeholder)."""
    if node.meta.get("fxzero", {}).get("kept") == "fetched":
        return True
    return bool(node.args) and isinstance(node.args[0], fx.Node) and kind_of(node.args[0]) == "fetch"


def _last_reads(program: ProgramSchedule) -> dict[int, list[str]]:
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
    """Runs one scheduled program (forward or backward) against its FX graph."""

    def __init__(self, program: ProgramSchedule, gm: fx.GraphModule, comm: Comm, memory: GatheredMemory,
                 store: Optional["OffloadStore"] = None, update: Optional[Callable[..., Any]] = None,
                 pool: Optional[BufferPool] = None):
        """`update(unit, param, grad, exp_avg, exp_avg_sq) -> (param, exp_avg, exp_avg_sq)` runs
        an `optim_step` instruction of the program (units updated in the backward)."""
        self.program = program
        self.comm = comm
        self.memory = memory
        self.store = store
        self.update = update
        self.pool = pool or BufferPool(per_size=0)  # per_size 0: nothing kept, as before
        nodes = {n.name: n for n in gm.graph.nodes}
        self._fetched_outputs = {name: _is_fetched_shard(nodes[name]) for name in program.kept if name in nodes}
        self.steps: list[tuple[Instruction, Callable[[dict], Any]]] = []
        for ins in program.instructions:
            self.steps.append((ins, self._compile(ins, nodes[ins.name])))
        self.drop_after = _last_reads(program)

    def _compile(self, ins: Instruction, node: fx.Node) -> Callable[[dict], Any]:
        """A closure computing the instruction from the environment."""

        def load(env: dict) -> tuple[tuple, dict]:
            def get(a):
                return env[a.name] if isinstance(a, fx.Node) else a

            return tree_map(get, node.args), tree_map(get, node.kwargs)

        kind = ins.kind
        if kind == "compute":
            # [Note: view strides] The graph was traced with fake (meta) kernels, whose output
            # strides can differ from the CPU kernels' (e.g. native_batch_norm_backward), so a
            # view that was legal in the trace may not be legal at run time. The graph is
            # functional, so a copying reshape computes the same values.
            target = _RUNTIME_TARGET.get(node.target, node.target)
            if target is OPS["flatten_grads"]:
                return self._flatten_grads(node, load)

            def compute(env: dict) -> Any:
                args, kwargs = load(env)
                return target(*args, **kwargs)

            return compute
        if kind == "all_gather":
            src = node.args[0].name

            def all_gather(env: dict) -> Pending:
                shard = env[src]
                numel = shard.numel() * self.comm.world_size
                out = self.pool.take(numel, shard.dtype) if shard.device.type == "cpu" else shard.new_empty(numel)
                self.memory.add(ins.bytes)
                return self.comm.all_gather(out, shard)

            return all_gather
        if kind == "reduce_scatter":
            src, keep_full = node.args[0].name, bool(node.args[3])
            via_all_reduce = ins.algorithm == "all_reduce"
            offloaded = any(kind_of(u) == "offload" for w in node.users for u in w.users)

            def reduce_scatter(env: dict) -> Pending:
                flat = env[src]
                n = flat.numel() // self.comm.world_size
                # An offloaded gradient shard is written to NVMe straight from an aligned buffer.
                out = aligned_empty(n, flat.dtype) if offloaded and flat.device.type == "cpu" else flat.new_empty(n)
                pending = self.comm.reduce_scatter(out, flat, via_all_reduce=via_all_reduce)
                if not keep_full:
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
        if kind == "fetch":
            unit, state = node.args[1], node.args[2]
            val = node.args[0].meta["val"]  # the unit placeholder: shard-sized (insert_gather_free)
            store = self._need_store(ins)

            def fetch(env: dict) -> Any:
                self.memory.stage(ins.bytes)
                return store.fetch(state, unit, val.numel(), val.dtype, pool=self.pool)

            return fetch
        if kind == "offload":
            src, unit, state = node.args[0].name, node.args[1], node.args[2]
            store = self._need_store(ins)

            def offload(env: dict) -> _Written:
                return _Written(store.write(state, unit, env[src]))

            return offload
        if kind == "optim_step":
            names = [a.name for a in node.args[:4]]
            unit = node.args[4]
            if self.update is None:
                raise RuntimeError(f"optim_step {ins.name}: the program updates units but no optimizer was given")

            def optim_step(env: dict) -> tuple:
                return self.update(unit, *(env[n] for n in names))

            return optim_step
        if kind == "wait":
            src = node.args[0].name
            return lambda env: env[src].wait()
        if kind == "free":
            src = node.args[0]  # the wait of a gather (a gathered buffer) or of a fetch (a shard)
            staged = _is_fetched_shard(src)

            def free(env: dict) -> None:
                self.release(env[src.name], staged)

            return free
        raise AssertionError(f"instruction kind {kind!r} cannot run in a graph program")

    def _flatten_grads(self, node: fx.Node, load) -> Callable[[dict], Any]:
        """fxzero::flatten_grads into a pooled buffer (its reduce-scatter hands it back)."""

        def flatten(env: dict) -> torch.Tensor:
            (grads, numels, padded, dtype), _ = load(env)
            out = self.pool.take(padded, dtype)
            offset = 0
            for g, n in zip(grads, numels):
                if g is None:
                    out[offset : offset + n].zero_()
                else:
                    out[offset : offset + n].copy_(g.reshape(-1))
                offset += n
            out[offset:].zero_()  # padding
            return out

        return flatten

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
        self.release(value, self._fetched_outputs.get(name, False))

    def _need_store(self, ins: Instruction):
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
        missing = set(self.program.inputs) - set(inputs)
        assert not missing, f"{self.program.name} program is missing inputs {sorted(missing)}"
        env = dict(inputs)
        inputs.clear()  # the caller's dict must not keep values alive past their last use
        clock = time.perf_counter
        for i, (ins, fn) in enumerate(self.steps):
            start = clock() if record is not None else 0.0
            env[ins.name] = fn(env)
            if record is not None:
                record.append(Timed(self.program.name, i, start, clock()))
            for name in self.drop_after.get(i, ()):
                del env[name]
        return [env[name] for name in self.program.outputs]

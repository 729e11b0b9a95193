"""The Engine: what `fxzero.compile` returns; runs the compiled programs on this rank.

    engine = fxzero.compile(model, config=fxzero.Config(...))
    loss = loss_fn(engine(x), y)   # forward program: gathers, computes, frees
    engine.backward(loss)          # same as loss.backward(): backward program, reduce-scatters
    engine.step()                  # AdamW on this rank's shard; ZeRO-1/2 re-gather; grads cleared

[Note: how the programs meet autograd]
The forward program runs inside a `torch.autograd.Function`, so the user's loss, computed
eagerly outside the graph, backpropagates into our backward program: `loss.backward()` hands
the Function the gradients of the model's outputs, and the Function runs the backward program
with those as its grad_output inputs. The values the backward needs (saved activations) are
held by the Function's context and released when the backward has run.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxzero import cost
from fxzero.compiler import CompiledProgram, compile_program, plan_layouts
from fxzero.passes import persistent_units
from fxzero.config import Config
from fxzero.runtime.comm import Comm, Pending, make_comm
from fxzero.runtime.executor import GatheredMemory, ProgramRunner
from fxzero.runtime.host_memory import keep_freed_host_memory
from fxzero.runtime.materialize import materialize
from fxzero.runtime.storage.offload_store import OffloadStore
from fxzero.runtime.storage.pool import BufferPool
from fxzero.runtime.optim import AdamWState
from fxzero.runtime.step import StepRunner, update_streamed
from fxzero.schedule import check_fingerprints

__all__ = ["Engine"]

def _ensure_process_group() -> None:
    """Join the launcher's process group (torchrun sets WORLD_SIZE) if the user has not."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class _Compiled:
    """One input signature's compiled program, with runners bound to this rank's comm."""

    def __init__(self, compiled: CompiledProgram, comm: Comm, memory: GatheredMemory,
                 store: Optional[OffloadStore], optimizer, optim: dict[str, AdamWState], pool: BufferPool) -> None:
        self.compiled = compiled
        schedule, programs = compiled.schedule, compiled.programs
        layouts = {lay.name: lay for lay in compiled.layouts}
        gradless = frozenset(compiled.signature.gradless_fqns)

        def update(unit, param, grad, exp_avg, exp_avg_sq):  # units updated in the backward
            m, v = update_streamed(layouts[unit], comm.rank, optimizer, param, grad, exp_avg, exp_avg_sq,
                                   optim, gradless)
            return param, m, v

        self.forward = ProgramRunner(schedule.program("forward"), programs["forward"].gm, comm, memory, store,
                                     pool=pool)
        self.backward = ProgramRunner(schedule.program("backward"), programs["backward"].gm, comm, memory, store,
                                      update, pool=pool)
        self.step = StepRunner(schedule.program("step"), compiled.layouts, comm, store, optimizer, pool)


class _RunProgram(torch.autograd.Function):
    """See [Note: how the programs meet autograd]."""

    @staticmethod
    def forward(ctx, engine: "Engine", compiled: _Compiled, for_backward: bool, anchor: torch.Tensor,
                *inputs: torch.Tensor):
        outputs, saved = engine._run_forward(compiled, inputs, for_backward)
        ctx.engine, ctx.compiled, ctx.saved = engine, compiled, saved
        sig = compiled.compiled.signature
        ctx.shapes = [(o.shape, o.dtype) for o in outputs]
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, sig.differentiable) if not d])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        if ctx.saved is None:
            raise RuntimeError(
                f"[rank {ctx.engine.rank}] backward ran twice through one fxzero forward; "
                "call forward again for each backward"
            )
        sig = ctx.compiled.compiled.signature
        grad_outputs = [
            g if g is not None else torch.zeros(shape, dtype=dtype)
            for g, (shape, dtype), d in zip(grads, ctx.shapes, sig.differentiable)
            if d
        ]
        saved, ctx.saved = ctx.saved, None
        ctx.engine._run_backward(ctx.compiled, saved, grad_outputs)
        return (None, None, None, None) + (None,) * (len(ctx.needs_input_grad) - 4)


class Engine:
    """Runs a model under ZeRO on this rank. Build it with `fxzero.compile`."""

    def __init__(self, model: nn.Module, config: Config, *, state_dict: Optional[Mapping[str, torch.Tensor]] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxzero.compile expects an nn.Module, got {type(model).__name__}")
        _ensure_process_group()
        if config.keep_host_memory and not torch.cuda.is_available():
            keep_freed_host_memory()
        self.config = config
        self.comm = make_comm(config.link_emulation, config.transport)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self._model = model
        self.cost_model = cost.resolve(config.cost_model, self.comm, config.link_emulation)
        self.layouts = plan_layouts(model, config, self.world_size, self.cost_model)
        self.num_params = sum(layout.numel for layout in self.layouts)
        self._whole = persistent_units(config, self.layouts)  # units held whole, not sharded
        self.store: Optional[OffloadStore] = None
        spilled: frozenset[str] = frozenset()  # units whose parameter shards live on a tier
        if config.offload.tiers():
            self.store = OffloadStore(config.offload, self.rank)
            self.store.reserve(self._offloaded_bytes())
            if self.store.offloaded("param"):
                spilled = frozenset(lay.name for lay in self.layouts if lay.name not in self._whole)
        self._params, self._buffers = materialize(
            model, self.layouts, rank=self.rank, whole=self._whole, state_dict=state_dict, seed=config.seed,
            spill=spilled, spill_to=lambda unit, shard: self.store.put("param", unit, shard),
        )
        self._offloaded_params = spilled
        self._grads: dict[str, torch.Tensor] = {}
        self._optim: dict[str, AdamWState] = {}
        self._cache: dict[Any, _Compiled] = {}
        self._gathered = GatheredMemory()
        self._pool = BufferPool()  # per-unit buffers reused across units and steps (runtime/pool.py)
        self._anchor = torch.empty(0, requires_grad=True)  # gives the forward's outputs a grad_fn
        self._record: Optional[list] = None  # the recorded timeline, while recording
        self._last: Optional[_Compiled] = None

    def _offloaded_bytes(self) -> dict[str, int]:
        """Bytes each offloadable state kind takes on its tier, for this rank."""
        placement = self.config.offload.placement
        sharded = [lay for lay in self.layouts if lay.name not in self._whole]
        trainable = [lay for lay in self.layouts if lay.trainable]

        def on_tier(kind: str, units) -> int:
            return sum(OffloadStore.stored_bytes(placement(kind), lay.shard_numel * lay.itemsize) for lay in units)

        if self.config.offload.step_in_backward:  # only persistent units' gradients are stored
            trainable = [lay for lay in trainable if lay.name in self._whole]
        return {
            "param": on_tier("param", sharded),
            "grad": on_tier("grad", trainable),
            "exp_avg": on_tier("exp_avg", trainable),
            "exp_avg_sq": on_tier("exp_avg_sq", trainable),
        }

    # -- compile ---------------------------------------------------------------------------

    def _compiled_for(self, inputs: tuple[torch.Tensor, ...]) -> _Compiled:
        key = (self._model.training, tuple((tuple(x.shape), x.dtype) for x in inputs))
        if key not in self._cache:
            compiled = compile_program(
                self._model, inputs, self.config, world_size=self.world_size, layouts=self.layouts,
                cost_model=self.cost_model,
            )
            check_fingerprints(self.comm.all_gather_object(compiled.schedule.fingerprint), rank=self.rank)
            self._cache[key] = _Compiled(compiled, self.comm, self._gathered, self.store, self.config.optimizer,
                                         self._optim, self._pool)
        return self._cache[key]

    @property
    def program(self) -> CompiledProgram:
        """What the compiler produced for the most recently run input signature: the rewritten
        graph, the pass trace, the programs and the schedule that ran."""
        if self._last is None:
            raise RuntimeError("no program has run yet: call the engine on an input first")
        return self._last.compiled

    @property
    def schedule(self):
        """The schedule of the most recently run input signature."""
        return self.program.schedule

    # -- forward / backward ----------------------------------------------------------------

    def __call__(self, *inputs: torch.Tensor) -> Any:
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"[rank {self.rank}] input {i} is a {type(x).__name__}; pass tensors")
        compiled = self._compiled_for(tuple(inputs))
        self._last = compiled
        sig = compiled.compiled.signature
        outputs = _RunProgram.apply(self, compiled, torch.is_grad_enabled(), self._anchor, *inputs)
        return pytree.tree_unflatten(list(outputs), sig.out_spec)

    forward = __call__

    def _bind(self, runner: ProgramRunner, program, values: dict[str, Any]) -> dict[str, Any]:
        """The program's inputs by placeholder name, from what each placeholder is (its key)."""
        env = {}
        for name, (kind, key) in zip(runner.program.inputs, program.inputs):
            if kind == "unit":
                env[name] = self._params.get(key)  # None: the shard is on a tier, fetched by the program
            elif kind == "buffer":
                env[name] = self._buffers[key]
            else:
                env[name] = values[kind][key]
        return env

    def _run_forward(self, compiled: _Compiled, inputs, for_backward: bool = True
                     ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
        """The outputs and the values saved for the backward (None when no backward can follow:
        under no_grad, whose buffers kept for the backward are released here)."""
        program = compiled.compiled.programs["forward"]
        results = compiled.forward.run(self._bind(compiled.forward, program, {"input": inputs}), self._record)
        sig = compiled.compiled.signature
        n_out, n_buf = sig.num_outputs, len(sig.mutated_buffers)
        for fqn, value in zip(sig.mutated_buffers, results[n_out : n_out + n_buf]):
            self._buffers[fqn] = value
        saved = results[n_out + n_buf :]
        if not for_backward:
            kept = set(compiled.forward.program.kept)
            names = [key for kind, key in program.outputs if kind == "saved"]
            for name, value in zip(names, saved):
                if name in kept:
                    compiled.forward.release_kept(name, value)
            saved = None
        return results[:n_out], saved

    def _run_backward(self, compiled: _Compiled, saved: list[torch.Tensor], grad_outputs: list[torch.Tensor]) -> None:
        program = compiled.compiled.programs["backward"]
        saved_names = [key for kind, key in program.inputs if kind == "saved"]
        values = {"saved": dict(zip(saved_names, saved)), "grad_output": grad_outputs}
        env = self._bind(compiled.backward, program, values)
        # From here the program's environment holds the only references to the activations,
        # so each is freed right after its last use in the backward.
        saved.clear()
        values.clear()
        results = compiled.backward.run(env, self._record)
        for (_, unit), grad in zip(program.outputs, results):
            if unit in self._grads:
                raise RuntimeError(
                    f"[rank {self.rank}] unit {unit!r} already holds a gradient: call step() "
                    "between backward passes (gradient accumulation is not supported yet)"
                )
            self._grads[unit] = grad

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` through the last forward: the same as `loss.backward()`."""
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            raise TypeError(
                f"[rank {self.rank}] engine.backward expects a loss tensor computed from the "
                "engine's outputs (it does not require grad: was it computed under no_grad?)"
            )
        loss.backward()

    # -- optimizer step --------------------------------------------------------------------

    def _layout(self, unit: str):
        return next(lay for lay in self.layouts if lay.name == unit)

    def _shard_of(self, unit: str) -> torch.Tensor:
        """This rank's parameter shard: the storage (ZeRO-3) or a view into the full buffer."""
        if unit not in self._whole:
            return self._params[unit]
        lo, hi = self._layout(unit).shard_range(self.rank)
        return self._params[unit][lo:hi]

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shard of every trainable unit, then clear the gradients."""
        if self._last is None:
            raise RuntimeError(f"[rank {self.rank}] step() before any forward/backward")
        step_program = self._last.compiled.schedule.program("step")
        missing = [i.unit for i in step_program.instructions if i.kind == "optim_step" and i.unit not in self._grads]
        if missing:
            raise RuntimeError(
                f"[rank {self.rank}] step() found no gradient for units {missing}: call "
                "engine.backward(loss) after the forward and before step()"
            )
        self._last.step.run(
            shard_of=self._shard_of, full_of=self._params.__getitem__, grads=self._grads, optim=self._optim,
            gradless=frozenset(self._last.compiled.signature.gradless_fqns),
        )
        self._grads.clear()

    def record_timeline(self, on: bool = True) -> None:
        """Start (or stop) recording when each forward/backward instruction runs."""
        self._record = [] if on else None

    def timeline(self) -> list:
        """The instructions run since recording started: `Timed(program, index, start, end)`."""
        return list(self._record or [])

    def zero_grad(self) -> None:
        self._settle_grads()
        self._grads.clear()

    def _settle_grads(self) -> None:
        """Wait for the gradients the backward left in flight (the step waits for them one by
        one, before each unit's update; see [Note: gradients carried into the step])."""
        for unit, grad in self._grads.items():
            if isinstance(grad, Pending):
                self._grads[unit] = grad.wait()

    # -- state and reports -----------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and this rank's buffers, keyed like `model.state_dict()`.

        A collective: every rank must call it. Its traffic is not counted in comm_report().
        """
        full: dict[str, torch.Tensor] = {}
        for layout in self.layouts:
            if layout.name in self._whole:
                flat = self._params[layout.name]
            else:
                shard = self._params.get(layout.name)
                if layout.name in self._offloaded_params:
                    shard = self.store.get("param", layout.name)
                flat = torch.empty(layout.padded_numel, dtype=layout.dtype)
                self.comm.all_gather(flat, shard, count=False).wait()
            for slot in layout.slots:
                full[slot.fqn] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        out = {}
        first: dict[int, str] = {}
        for fqn, p in self._model.named_parameters(remove_duplicate=False):
            out[fqn] = full[first.setdefault(id(p), fqn)]
        for fqn, _ in self._model.named_buffers(remove_duplicate=False):
            out[fqn] = self._buffers[fqn].clone()
        order = list(self._model.state_dict(keep_vars=True).keys())
        return {k: out[k] for k in order if k in out}

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by category, plus the peak of gathered buffers.

        param_shards counts all parameter storage, of which persistent_params is held whole
        (persistent units: every unit at ZeRO-1/2, units under the threshold at ZeRO-3).
        Categories count resident memory only; `offloaded` is bytes per storage tier, and
        staged / staged_peak the shards fetched from a tier and not yet released.

        Counted from the storages the engine holds (a view of a larger buffer counts the whole
        buffer), not estimated from sizes.
        """
        params = _storage_bytes(self._params.values())
        persistent = _storage_bytes(t for u, t in self._params.items() if u in self._whole)
        self._settle_grads()
        grads = _storage_bytes(self._grads.values())
        optim = sum(s.nbytes for s in self._optim.values())
        return {
            "param_shards": params,
            "persistent_params": persistent,
            "grad_shards": grads,
            "optimizer_states": optim,
            "model_states": params + grads + optim,
            "buffers": _storage_bytes(self._buffers.values()),
            "gathered": self._gathered.current,
            "gathered_peak": self._gathered.peak,
            "staged": self._gathered.staged,
            "staged_peak": self._gathered.staged_peak,
            "offloaded": self.store.held_bytes() if self.store is not None else {},
        }

    def io_report(self, reset: bool = False) -> dict[str, dict]:
        """Per storage tier: bytes, seconds, calls and GB/s read and written since the last reset
        (empty when nothing is offloaded)."""
        return self.store.report(reset) if self.store is not None else {}

    def close(self) -> None:
        """Finish offload I/O in flight and remove this rank's NVMe files (also done at exit)."""
        self._settle_grads()
        if self.store is not None:
            self.store.close()

    def comm_report(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes sent per collective kind since the last reset."""
        return self.comm.report(reset=reset)

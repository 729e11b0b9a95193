"""The Engine: what `fxzero.compile` returns; runs the compiled programs on this rank.

    engine = fxzero.compile(model, config=fxzero.Config(...))
    loss = loss_fn(engine(x), y)   # forward program: gathers, computes, frees
    engine.backward(loss)          # same as loss.backward(): backward program, reduce-scatters
    engine.step()                  # step program: AdamW on this rank's shards; ZeRO-1/2 re-gather

The engine is handed everything it runs (`fxzero.api.compile` builds it): the process group's
comm, the unit layouts, this rank's parameter storage and buffers, the offload store, and a
function that compiles the program of a new input signature. It never imports the compiler.
Each compiled program runs on three `ProgramRunner`s, one executor for every program; the
forward runs inside the autograd bridge ([Note: how the programs meet autograd] in
`fxzero/runtime/autograd.py`).
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn as nn

from fxzero.config import Config
from fxzero.config.batch import BatchSizes
from fxzero._compat import maybe_mark_dynamic, pytree
from fxzero.ir.hook_ops import hooks_signature
from fxzero.ir.instruction import Instruction
from fxzero.ir.signature import flatten_call
from fxzero.runtime.activation_store import ActivationStore
from fxzero.runtime.agreement import agree
from fxzero.runtime.autograd import RunProgram, SavedActivations
from fxzero.runtime.comm import Comm
from fxzero.runtime.comm import Pending
from fxzero.runtime.engine_surface import EngineSurface
from fxzero.runtime.executor import GatheredMemory, ProgramRunner
from fxzero.runtime.host_memory import release_freed_host_memory
from fxzero.runtime.optimizer import ShardedOptimizer
from fxzero.runtime.outside_grads import GradientProbe, reaches
from fxzero.runtime.random_ltd.routing import RandomLTDRouting
from fxzero.runtime.requires_grad import GradWindow, RequiresGradWatch
from fxzero.runtime.stepping import StepControl, StepLog
from fxzero.runtime.throughput import ThroughputTimer
from fxzero.runtime.optim import WholeSums, optim_step
from fxzero.runtime.state import RankState, storage_bytes
from fxzero.runtime.parameter_offload import ParameterOffload, give_external_parameters
from fxzero.runtime.user_module import UserModule
from fxzero.module_state import changed, fingerprint, observe, snapshot
from fxzero.runtime.storage.pool import BufferPool
from fxzero.schedule.validate import collective_sequence, sequence_digest
from fxzero.schedule.compiled import CompiledProgram

__all__ = ["DeepSpeedEngine", "Engine", "Runners"]

Compiler = Callable[..., CompiledProgram]
"""Compiles the program of one call, `(args, kwargs, forward_only, module=None)` (`fxzero.compiler.compile_program`,
bound to the model; `module`: a module with the model's parameters to compile instead, a `GradientProbe`)."""


class Runners(NamedTuple):
    """One input signature's compiled program, with a runner per program bound to this rank."""

    compiled: CompiledProgram
    forward: ProgramRunner
    backward: ProgramRunner
    step: ProgramRunner
    sequence: tuple[str, ...]
    """The collectives a step of it issues (`collective_sequence`)."""
    digest: int


class Engine(EngineSurface):
    """Runs a model under ZeRO on this rank. Build it with `fxzero.compile`."""

    def __init__(self, model: nn.Module, config: Config, *, comm: Comm, cost_model: Any, state: RankState,
                 compiler: Compiler, optimizer: ShardedOptimizer, group_of: dict[str, int],
                 batch: BatchSizes) -> None:
        """See `fxzero.api.compile`, which builds every argument.

        Args:
            state: this rank's model states, materialized (parameters and buffers).
            compiler: compiles the program of a new input signature.
            optimizer: the param groups' hyperparameters, read at every update.
            group_of: each parameter FQN's param group (absent: group 0).
            batch: the batch triple, resolved for this world (`fxzero/config/batch.py`).
        """
        self.config = config
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.cost_model = cost_model
        self.state = state
        self.layouts = state.layouts
        self.num_params = sum(layout.numel for layout in state.layouts)
        self.store = state.store
        self._model = model
        self._compile = compiler
        self._layout = {lay.name: lay for lay in state.layouts}
        self._cache: collections.OrderedDict[Any, Runners] = collections.OrderedDict()  # (LRU, bounded)
        self._gathered = GatheredMemory()
        self._trim_host = state.device.type == "cpu" and not config.keep_host_memory
        self._activations = SavedActivations()  # (counted by the autograd bridge, autograd.py)
        offload = config.activations.offload  # saved activations on a tier (a CPU rank's cpu tier: where they are)
        self._stash = (ActivationStore(offload, self.rank)
                       if offload is not None and not (offload.tier == "cpu" and state.device.type == "cpu") else None)
        self._pool = BufferPool(device=state.device)  # per-unit buffers reused across units and steps (storage/pool.py)
        self._anchor = torch.empty(0, requires_grad=True)  # gives the forward's outputs a grad_fn
        self._record: Optional[list] = None  # the recorded timeline, while recording
        self._last: Optional[Runners] = None
        self._stepping: Optional[Runners] = None  # the last program with a backward: what step() runs
        self.optimizer = optimizer
        optimizer.attach(self)  # (its state_dict is this engine's shards: [Note: the optimizer's own state dict])
        self._group_of = group_of
        self._ranges: dict[tuple[str, frozenset], list] = {}  # (unit, gradless) -> its shard's group ranges
        self._unreduced: dict[str, torch.Tensor] = {}  # gradient_accumulation="local": full gradients kept
        self.control = StepControl(config, comm, state, batch)  # accumulation, scaling, clipping, schedule
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.global_rank = self.rank
        self.device = state.device
        """Where the model's inputs go (`inputs.to(engine.device)`): `cuda:LOCAL_RANK` on a CUDA
        rank, else the CPU (`fxzero/runtime/device.py`)."""
        self._log = StepLog(config.steps_per_print, self.rank)
        self.tput_timer = ThroughputTimer(batch.train_batch_size)
        """DeepSpeed's throughput counter: samples per second from each forward to its step()
        (`fxzero/runtime/throughput.py`)."""
        self.training_dataloader: Any = None
        """The loader `fxzero.initialize` built (its position is saved in checkpoints), or None."""
        self._failed_load: Optional[str] = None
        self.deepspeed_stage: Optional[int] = None
        """The stage a DeepSpeed config asked for where fxzero runs another (0 runs as 1), else None."""
        self._no_sync = False  # inside engine.no_sync(): backwards keep their gradients unreduced
        self.without_optimizer: Optional[str] = None
        """Why there is nothing to train with (a DeepSpeed config without an "optimizer" section,
        and none passed to initialize): backward() and step() refuse, naming it, as DeepSpeed's do;
        forwards (evaluation) run. None: the config's optimizer."""
        self._eager: set = set()  # program keys whose forward the trace cannot follow: run eagerly
        self._warned_eager = False
        self._module_state = None  # the modules' attributes after the last call ([Note: module attributes changed after compile])
        self._traced_or_eager = False
        self._warned_state = False
        self._by_state: dict[tuple, tuple] = {}  # a state's programs, set aside while another is current
        self._state_key: Optional[tuple] = None  # (module attributes, requires_grad, gradient hooks) now
        self._eager_forward = False  # a forward ran eagerly since the last backward (on every rank alike)
        self._probes: dict[tuple, Runners] = {}  # ([Note: gradients from outside the program])
        self._step_applied = False
        mp = config.mixed_precision
        self._user = UserModule(model, state, comm, compute_dtype=mp.param_dtype if mp is not None else None,
                                timeout=config.collective_timeout, zero3=config.stage == 3)
        """Keeps the user's module a view of what this engine trains ([Note: the user's module])."""
        self._requires_grad = RequiresGradWatch(model, state.layouts)  # ([Note: requires_grad after compile])
        self._window = GradWindow()  # what no backward of this accumulation gave a gradient: the update skips it
        self._user.engine = self
        if config.stage == 3:  # (what programs reach for in DeepSpeed's ZeRO-3 optimizer and modules)
            give_external_parameters(model)
            if config.gather_for_generate:
                self._user.gather_for_generate()
            if optimizer is not None:
                optimizer.parameter_offload = ParameterOffload(self._user)  # ([Note: DeepSpeed's parameter_offload])
        self._random_ltd: Optional[RandomLTDRouting] = None  # random layer-token drop (docs/random_ltd.md)
        if config.random_ltd is not None:
            self._random_ltd = RandomLTDRouting(config.random_ltd, global_batch_size=batch.train_batch_size,
                                                micro_batch_size=batch.micro_batch_size, rank=self.rank)
            self.random_ltd_scheduler = self._random_ltd.scheduler
            """DeepSpeed's: the tokens random-LTD keeps now (`get_current_seq()`), and its state."""

    # -- programs --------------------------------------------------------------------------

    def _key(self, leaves: list, spec: Any) -> tuple:
        """[Note: what a program is compiled for] One program per call structure (positional and
        keyword arguments, nesting), constant arguments (bools, ints, None: they select code
        paths), tensor dtypes and ranks, which tensors require grad ([Note: inputs that require
        grad] in `fxzero/ir/signature.py`), the training flag of every submodule (a submodule in
        eval runs without dropout), and the autocast state (a program traced under autocast
        computes in its dtype), and grad mode. The same call in another mode is another program.
        Tensor sizes are not in the key: a program serves the sizes its shapes accept
        ([Note: any size, one program] in `fxzero/ir/shapes.py`, and `_runners_for`).

        [Note: forward-only programs]
        A call under `torch.no_grad()` (or inference mode) runs a program traced without the
        backward: each unit gathered, computed with and freed, nothing kept for a backward, no
        reduce-scatter, so evaluation costs forward memory only. It never becomes what `step()`
        updates with (`_stepping`). A call in eval mode with grad enabled keeps the joint
        program, so a backward can still follow it."""
        tensors, constants = [], []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                tensors.append((x.dim(), x.dtype, x.requires_grad and torch.is_grad_enabled()))
                continue
            try:
                hash(x)
            except TypeError:
                raise TypeError(f"[rank {self.rank}] input {i} is a {type(x).__name__}; pass tensors, or constants "
                                "(bool, int, float, str, None)") from None
            constants.append((i, type(x), x))
        modes = tuple(m.training for m in self._model.modules())
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
        return (str(spec), tuple(constants), tuple(tensors), modes, autocast, torch.is_grad_enabled())

    def _runners_for(self, args: tuple, kwargs: dict, leaves: list, spec: Any) -> Runners:
        """The program for this call: the most recently used one of its key whose shapes accept
        the call's sizes, else a new one.

        Which dims are symbolic: as torch.compile's automatic dynamic shapes, the first call of
        a key is traced at its sizes (a static program, exact figures, nothing symbolic to pay
        for where sizes never change); a later call that no program accepts is traced with
        symbolic sizes in every dim where it differs from a program of its key (and in the dims
        those already had symbolic), so from the second padded length on, one program serves
        every length. Dims the user marked (`torch._dynamo.mark_dynamic`) are symbolic from the
        first call. Collectives move each unit's flat buffer, whatever the sizes, so ranks that
        run different programs of one key in a step still agree (`_agree`)."""
        family = self._key(leaves, spec)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        for key in reversed(self._cache):
            if key[0] == family and self._cache[key].compiled.shapes.accepts(tensors):
                self._cache.move_to_end(key)
                return self._cache[key]
        dynamic: set[tuple[int, int]] = set()
        for key, cached in self._cache.items():
            if key[0] == family:
                dynamic |= cached.compiled.shapes.dims_differing(tensors)
        if dynamic:
            position = iter(range(len(tensors)))  # (the order of `leaves`: flatten_call's)

            def marked(x: Any) -> Any:
                if not isinstance(x, torch.Tensor):
                    return x
                # (an alias: the user's tensor stays unmarked; requiring grad as it does, [Note: inputs that require grad])
                i, alias = next(position), x.detach().requires_grad_(x.requires_grad)
                maybe_mark_dynamic(alias, sorted(d for j, d in dynamic if j == i))
                return alias

            args, kwargs = pytree.tree_map(marked, (tuple(args), dict(kwargs)))
        self._traced_or_eager = True  # (a trace runs the forward's Python)
        try:
            # Under no_grad: a forward-only program ([Note: forward-only programs]).
            compiled = self._compile(args, kwargs, not torch.is_grad_enabled())  # (on this rank alone: see _agree)
        except ValueError as e:  # a trace error naming the model's line (`fxzero.trace`): say which rank
            if callable(getattr(e, "with_rank", None)) and not str(e).startswith("[rank "):
                raise e.with_rank(self.rank) from e.__cause__
            raise
        if dynamic and compiled.shapes.specialized:
            fixed = "; ".join(f"input {i} dim {d} (fixed at {where})" for i, d, where in compiled.shapes.specialized)
            warnings.warn(f"[rank {self.rank}] the model needs some input sizes that change between calls at one "
                          f"size: {fixed}. Each size compiles a program of its own (a trace each, and "
                          "Config.program_cache_size of them kept); pad those inputs to one size, or change the "
                          "code named there to compute from the tensor's size", stacklevel=4)
        key = (family, compiled.shapes)
        self._cache[key] = self._runners_of(compiled)
        self._cache.move_to_end(key)
        if len(self._cache) > self.config.program_cache_size:
            evicted, _ = self._cache.popitem(last=False)
            warnings.warn(f"[rank {self.rank}] {len(self._cache) + 1} programs exceed Config.program_cache_size="
                          f"{self.config.program_cache_size}: evicted the least recently used (inputs "
                          f"{evicted[1].describe()}); a run that cycles through more call signatures recompiles "
                          "each time: raise the size", stacklevel=4)
        return self._cache[key]

    def _runners_of(self, compiled: CompiledProgram) -> Runners:
        """A runner per program of `compiled`, bound to this rank."""
        gradless = frozenset(compiled.signature.gradless_fqns)
        update = lambda ins, *tensors: self._update(ins, gradless, *tensors)  # noqa: E731
        schedule, programs = compiled.schedule, compiled.programs

        def runner(name: str) -> ProgramRunner:
            if self._stash is not None:
                self._stash.reserve(f"{id(schedule)}/{name}", schedule.program(name).instructions)
            made = ProgramRunner(schedule.program(name), programs[name].gm, self.comm, self._gathered,
                                 self.store, update, pool=self._pool, flags=self.control.flags,
                                 activations=self._stash)
            made.divide_before = self.config.gradient_division == "before"
            return made

        sequence = collective_sequence(schedule) + self._update_collectives(schedule)
        return Runners(compiled, runner("forward"), runner("backward"), runner("step"), sequence,
                       sequence_digest(sequence))

    def _update_collectives(self, schedule) -> tuple[str, ...]:
        """The all-reduces the updates issue themselves, one per unit updated, for an optimizer
        that needs sums over whole parameters ([Note: sums over whole parameters] in
        `fxzero/runtime/optim.py`), in the order the programs update the units."""
        sums = self.optimizer.policy.WHOLE_PARAMETER_SUMS
        if not sums:
            return ()
        return tuple(f"{p.name}: all_reduce of {i.unit} ({sums * len(self._layout[i.unit].slots)} x float32, "
                     "the update's sums over whole parameters)"
                     for p in schedule.programs for i in p.instructions if i.kind == "optim_step")

    def _agree(self, runners: Runners) -> None:
        """Every rank's program issues the same collectives ([Note: one collective sequence] in
        `fxzero/runtime/agreement.py`): one 8-byte all-gather per forward."""
        written = self._user.writes.announcements()  # ([Note: writes into the user's module])
        agree(self.comm, runners.sequence + written, digest=None if written else runners.digest,
              timeout=self.config.collective_timeout, where="the start of this forward (still in another program?)")

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

    def _bind(self, runner: ProgramRunner, program, values: dict[str, Any]) -> dict[str, Any]:
        """The program's inputs by placeholder name, from what each placeholder is (its key)."""
        env = {}
        step = program.name == "step"
        policy = self.optimizer.policy
        for name, (kind, key) in zip(runner.program.inputs, program.inputs):
            if kind == "unit" and step:  # what the optimizer updates: the (master) parameters
                env[name] = self.state.params.get(key)
            elif kind == "unit":  # what the model computes with; None: the shard is on a tier
                env[name] = self.state.compute_params(key)
            elif kind == "low":
                env[name] = self.state.low[key]
            elif kind == "buffer":
                env[name] = self.state.buffers[key]
            elif kind == "grad":
                env[name] = self.state.grads[key]
            elif kind in policy.states:  # an optimizer state that lives on the device
                env[name] = self.state.optimizer_state(key, kind, policy.initial_value(kind))
            else:
                env[name] = values[kind][key]
        return env

    # -- forward / backward ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model as it is called: positional and keyword arguments, nested tuples, lists
        and dicts of tensors, constants; outputs rebuilt as the model returns them (tuples,
        dicts, `ModelOutput`s). See [Note: what a program is compiled for]."""
        if self._failed_load is not None:
            raise RuntimeError(f"[rank {self.rank}] {self._failed_load}; this engine's states are partly replaced: "
                               "build a new engine (fxzero.compile) and load a good checkpoint")
        self.tput_timer.start()
        if self._random_ltd is not None:  # the schedule's step, and the kept count as an input (routing.py)
            args, kwargs = self._random_ltd.call(self._model, args, kwargs, self.global_steps, self.device)
        if self.config.autocast is not None:  # (DeepSpeed's "torch_autocast": the caller's autocast replaced)
            with torch.autocast(self.device.type, dtype=self.config.autocast.dtype):
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        self._user.writes.take()  # (the user's writes into the module since the engine last set it)
        leaves, spec = flatten_call(args, kwargs)
        self._follow_state()
        try:
            return self._call_program(args, kwargs, leaves, spec)
        finally:
            if self._traced_or_eager:  # (a trace's first run, or the model run as it is, may set attributes)
                self._module_state = snapshot(self._model)

    def _follow_state(self) -> None:
        """[Note: module attributes changed after compile]
        A program repeats what the traced call's Python read: a module attribute (Dropout's `p`, a
        temperature `self.tau`, a Hugging Face config's `use_cache` or `pad_token_id`, PEFT's
        `disable_adapter()` flag) is a constant of it. Changed by the user between calls, the
        programs would go on computing with the old value, without a word. So the modules' own
        attributes (`fxzero/module_state.py`) are compared before each call with what they were
        after the last one; a change, as one of the parameters' requires_grad ([Note: requires_grad
        after compile]), of their gradient hooks ([Note: gradient hooks on parameters] in
        `fxzero/trace.py`) or of what the modules run (hooks added or removed after compile:
        NEFTune's noise hook; `model.forward` replaced; a class's forward patched), sets the programs of the old state aside and takes up those of the new
        one (traced at their first call; an attribute's change is said once, naming it). So state
        that alternates (PEFT's `disable_adapter()` for a reference forward, which also freezes the
        adapters, and the policy's forward after it) traces once per state, and a value changed
        every step traces every step (pass such a value as an input, or keep it in a buffer). A
        change the forward makes itself, run eagerly ([Note: a forward that changes its module's
        state]), happens inside a call and is not one."""
        frozen_set = self._requires_grad.changed(self.rank)  # (raises for a change that cannot be exact)
        now, code = observe(self._model)
        hooks = (hooks_signature(self._user.params), code)
        before, self._module_state = self._module_state, now
        self._traced_or_eager = False
        moved = changed(before, now) if before is not None else []
        if self._state_key is None:
            self._state_key = (fingerprint(now), self._requires_grad.signature(), hooks)
        if not (frozen_set or hooks != self._state_key[2] or moved):
            return
        key = (fingerprint(now), self._requires_grad.signature(), hooks)
        self._by_state[self._state_key] = (self._cache, self._probes)
        while len(self._by_state) > _STATES_KEPT:
            self._by_state.pop(next(iter(self._by_state)))
        kept = self._by_state.pop(key, None)
        self._cache, self._probes = kept if kept is not None else (collections.OrderedDict(), {})
        self._state_key = key
        if moved and kept is None and not self._warned_state:
            self._warned_state = True
            warnings.warn(f"[rank {self.rank}] {'; '.join(moved[:3])}{' ...' if len(moved) > 3 else ''} changed since "
                          "the last call: fxzero traces the model's programs again for the new values (the traced "
                          "programs hold the values they were traced with). A value changed every step traces every "
                          "step: pass it as an input, or keep it in a buffer", stacklevel=5)

    def _call_program(self, args: tuple, kwargs: dict, leaves: list, spec: Any) -> Any:
        family = self._key(leaves, spec)
        if family in self._eager:
            self._traced_or_eager = True
            return self._eager_call(args, kwargs)
        try:
            runners = self._runners_for(args, kwargs, leaves, spec)
        except ValueError as e:
            if not getattr(e, "needs_values", False):
                raise
            self._eager.add(family)
            self._traced_or_eager = True
            if not self._warned_eager:
                self._warned_eager = True
                held = ("Every rank holds the whole parameters" if not self._user.placeholders() else
                        "At ZeRO-3 every unit is gathered for it and held whole until its backward ends (the whole "
                        "model in the compute dtype for that step, as ZeRO-2 holds it: [Note: a forward run eagerly "
                        "at ZeRO-3])")
                warnings.warn(f"{e.args[0].split(': fxzero traces')[0]}. {held}, so fxzero runs this forward "
                              f"eagerly (ZeRO-{self.config.stage}), as DeepSpeed does, and "
                              "engine.backward reduces the gradients it leaves into the shards: it trains as "
                              "the traced program would, but nothing of the forward and backward overlaps, and "
                              "Config.activations does not apply to them ([Note: gradients from outside the "
                              "program]). Trace it instead by removing the decision named", stacklevel=3)
            return self._eager_call(args, kwargs)
        self._agree(runners)
        self._last = runners
        if torch.is_grad_enabled():
            self._stepping = runners
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        outputs = RunProgram.apply(self, runners, torch.is_grad_enabled(), self._anchor, *inputs)
        return runners.compiled.signature.rebuild_outputs(outputs)

    forward = __call__

    def _eager_call(self, args: tuple, kwargs: dict) -> Any:
        """The model called as it is, on parameters that view what this rank holds ([Note:
        gradients from outside the program]); floating inputs cast to the compute dtype, as the
        traced programs cast them."""
        agree(self.comm, ("the model's forward, run eagerly (no collectives)", *self._user.writes.announcements()),
              timeout=self.config.collective_timeout,
              where="the start of this forward (run eagerly here: do the other ranks run a program?)")
        self._eager_forward = True  # (on every rank alike: the next backward carries what it reaches)
        mp = self.config.mixed_precision
        if mp is not None:
            args, kwargs = pytree.tree_map(
                lambda x: x.to(mp.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                (tuple(args), dict(kwargs)))
        self._user.hold_for_eager()  # (ZeRO-3: every sharded unit whole until the backward, [Note: a forward run ...])
        if torch.is_grad_enabled():
            return self._model(*args, **kwargs)
        try:
            return self._model(*args, **kwargs)
        finally:
            self._user.release_held()

    def _announce_outside_gradients(self, loss: torch.Tensor, params: dict[str, nn.Parameter]) -> Any:
        """Before the backward: start summing over the ranks whether this rank's backward reaches
        the module's parameters; None where every rank already knows ([Note: gradients from
        outside the program])."""
        eager, self._eager_forward = self._eager_forward, False
        if self.world_size == 1 or eager or len(self._user.placeholders()) == len(params):
            return None
        flag = torch.tensor([float(reaches(loss, params.values()))], device=self.device)
        return self.control.sum_flags(flag)

    def _carry_outside_gradients(self, params: dict[str, nn.Parameter], reached: Any) -> None:
        """Gradients the backward left on the module's own parameters (a forward run eagerly, a
        module called directly) into the gradient shards, through a `GradientProbe`'s program
        ([Note: gradients from outside the program])."""
        grads = {}
        for fqn, p in params.items():
            if p.grad is not None:
                grads[fqn], p.grad = p.grad, None
        if len(self._user.placeholders()) == len(params):
            return  # (every parameter sharded: no gradient can reach one, and every rank knows it)
        if reached is not None and not self.control.flags_summed(reached, "whether a loss reached the model's "
                                                                 "parameters outside the programs").item():
            if grads:
                raise RuntimeError(
                    f"[rank {self.rank}] engine.backward(loss): the loss reached the model's parameters "
                    f"({', '.join(list(grads)[:3])}) through a reentrant torch.utils.checkpoint region outside the "
                    "engine's forward, which hides them from the graph until its backward runs, so the ranks could "
                    "not agree to reduce those gradients. Use torch.utils.checkpoint(..., use_reentrant=False), or "
                    "compute the term inside the model's forward")
            return
        names = list(params)
        if self.world_size > 1:  # (a branch one rank's data took: zeros where the others have a gradient)
            flags = torch.tensor([fqn in grads for fqn in names], dtype=torch.float32, device=self.device)
            flags = self.control.flags_summed(self.control.sum_flags(flags),
                                              "which parameters have a gradient from outside the programs")
            names = [fqn for fqn, flag in zip(names, flags.tolist()) if flag > 0]
        else:
            names = [fqn for fqn in names if fqn in grads]
        if not names:
            return
        values = [grads[fqn] if fqn in grads else
                  torch.zeros(params[fqn].shape, dtype=params[fqn].dtype, device=self.device) for fqn in names]
        key = (tuple(names), tuple(v.dtype for v in values))
        runners = self._probes.get(key)
        if runners is None:
            compiled = self._compile(tuple(values), {}, False, module=GradientProbe(self._model, names))
            runners = self._probes[key] = self._runners_of(compiled)
        self._agree(runners)
        self._stepping = runners
        if self._last is None:
            self._last = runners
        with torch.enable_grad():
            (total,) = RunProgram.apply(self, runners, True, self._anchor, *values)
        grads.clear()
        values.clear()
        total.backward()
        self.state.settle_grads()  # (the step program of another forward may wait for none of them)

    def _run_forward(self, runners: Runners, inputs, for_backward: bool = True
                     ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]], int]:
        """The outputs, the values saved for the backward (None when no backward can follow:
        under no_grad, whose buffers kept for the backward are released here), and the bytes of
        those that are activations (not gathered parameters kept for the backward)."""
        program = runners.compiled.programs["forward"]
        results = runners.forward.run(self._bind(runners.forward, program, {"input": inputs}), self._record)
        self._ran_program()
        sig = runners.compiled.signature
        n_out, n_buf = sig.num_outputs, len(sig.mutated_buffers)
        for fqn, value in zip(sig.mutated_buffers, results[n_out : n_out + n_buf]):
            self.state.buffers[fqn] = value
        if n_buf:
            self._user.bind_buffers()
        saved = results[n_out + n_buf :]
        kept = set(runners.forward.program.kept_names)
        names = [key for kind, key in program.outputs if kind == "saved"]
        if not for_backward:
            for name, value in zip(names, saved):
                if name in kept:
                    runners.forward.release_kept(name, value)
            return results[:n_out], None, 0
        activations = storage_bytes(v for name, v in zip(names, saved)
                                    if name not in kept and isinstance(v, torch.Tensor))
        return results[:n_out], saved, activations

    def _run_backward(self, runners: Runners, saved: list[torch.Tensor], grad_outputs: list[torch.Tensor]
                      ) -> dict[int, torch.Tensor]:
        """Run the backward program; returns the gradients of the inputs that required grad, by
        their position among the tensor inputs ([Note: inputs that require grad])."""
        program = runners.compiled.programs["backward"]
        saved_names = [key for kind, key in program.inputs if kind == "saved"]
        if self.config.gradient_reduction == "sum" and self.world_size > 1:
            # The programs average over the ranks; world times each rank's contribution averages to the sum.
            grad_outputs = [g * self.world_size for g in grad_outputs]
        values = {"saved": dict(zip(saved_names, saved)), "grad_output": grad_outputs}
        self._window.backward(frozenset(runners.compiled.signature.gradless_fqns))
        env = self._bind(runners.backward, program, values)
        # From here the program's environment holds the only references to the activations,
        # so each is freed right after its last use in the backward.
        saved.clear()
        values.clear()
        runner = runners.backward
        # A backward after the first of an accumulation adds into the gradient shards held ...
        runner.accumulate_grads = bool(self.state.grads)
        # ... or, accumulating locally, into the full gradients kept, reducing only at the boundary.
        local = self.config.gradient_accumulation == "local" or self._no_sync or bool(self._unreduced)
        runner.unreduced = self._unreduced if local else None
        runner.defer_reduction = self._no_sync or (local and not self.control.boundary)
        results = runner.run(env, self._record)
        self._ran_program()
        input_grads = {i: g for (kind, i), g in zip(program.outputs, results) if kind == "input_grad"}
        if self.config.gradient_reduction == "sum" and self.world_size > 1:  # (the scaling above is the programs' own)
            input_grads = {i: g / self.world_size for i, g in input_grads.items()}
        if runner.defer_reduction:
            return input_grads  # ([Note: accumulating locally] in executor.py): no gradient shard yet
        grads = self.state.grads
        for (kind, unit), grad in zip(program.outputs, results):
            if kind != "grad":
                continue
            if unit in grads:  # accumulation (or two forwards into one loss): into the shard held
                self._accumulate(unit, grad)
            else:
                grads[unit] = grad
        return input_grads

    def _accumulate(self, unit: str, grad: Any) -> None:
        held = self.state.grads[unit]
        held = held.wait() if isinstance(held, Pending) else held
        grad = grad.wait() if isinstance(grad, Pending) else grad
        if grad.numel() == 0:  # a token: the shard was added to its tier's ([Note: accumulating on a tier])
            return
        self.state.grads[unit] = held.add_(grad)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` through the last forward: the same as `loss.backward()`.

        DeepSpeed's arguments: `scale_wrt_gas=False` when the caller has divided the loss by the
        accumulation steps itself (Hugging Face's Trainer does); `retain_graph=True` is refused:
        the backward program frees each activation after its last use.

        Returns, as DeepSpeed's does, the loss over the accumulation steps (the loss itself with
        `scale_wrt_gas=False`), detached: what a script logs as the micro-step's share."""
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            raise TypeError(
                f"[rank {self.rank}] engine.backward expects a loss tensor computed from the "
                "engine's outputs (it does not require grad: was it computed under no_grad?)"
            )
        if self.without_optimizer is not None:
            raise RuntimeError(f"[rank {self.rank}] engine.backward: {self.without_optimizer}")
        if retain_graph:
            raise ValueError(f"[rank {self.rank}] engine.backward(retain_graph=True): fxzero's backward program frees "
                             "each saved activation after its last use, so a second backward through the same "
                             "forward has nothing to read; run the forward again for each backward")
        params = self._user.params
        for p in params.values():  # (fxzero's gradients live in its shards; a parameter's own .grad is
            p.grad = None          # set only outside the programs, and carried into the shards below)
        reached = self._announce_outside_gradients(loss, params)
        # Over the accumulation steps, float16-scaled; its finiteness reduced over the ranks.
        try:
            self.control.loss_to_backward(loss, scale_wrt_gas).backward()
            self._carry_outside_gradients(params, reached)
        finally:
            self._user.release_held()  # (a forward run eagerly at ZeRO-3: its units are placeholders again)
        self._log.loss(loss)
        steps = self.control.accumulation
        return loss.detach() / steps if scale_wrt_gas and steps > 1 else loss.detach()

    # -- optimizer step --------------------------------------------------------------------

    def _update(self, ins: Instruction, gradless: frozenset[str], param: torch.Tensor, grad: torch.Tensor,
                *states: torch.Tensor) -> None:
        """An optim_step: the optimizer's update of this rank's shard of `ins.unit`, in place, with
        the states its policy declares (in that order), wherever they live."""
        layout = self._layout[ins.unit]
        if ins.buffer == "persistent":  # the unit's full buffer: this rank's slice is its shard
            lo, hi = layout.shard_range(self.rank)
            param = param[lo:hi]
        if grad.dtype != param.dtype:  # gradients reduced in the compute dtype (MixedPrecision(reduce_dtype=None))
            grad = grad.to(param.dtype)
        if self.control.multiplier != 1.0:  # float16's unscaling, the clip coefficient
            grad = grad.mul(self.control.multiplier)
        if self._window.gradless is not None:  # (torch's: what any backward of the accumulation gave a gradient)
            gradless = self._window.gradless
        key = (ins.unit, gradless)
        policy = self.optimizer.policy
        if key not in self._ranges:
            self._ranges[key] = (layout.param_shard_ranges(self.rank, self._group_of, skip=gradless)
                                 if policy.WHOLE_PARAMETER_SUMS else
                                 layout.grouped_shard_ranges(self.rank, self._group_of, skip=gradless))
        whole = None
        if policy.WHOLE_PARAMETER_SUMS:  # ([Note: sums over whole parameters] in fxzero/runtime/optim.py)
            what = f"{type(policy).__name__}'s sums over the whole parameters of unit {ins.unit!r}"
            whole = WholeSums(self._ranges[key], len(layout.slots),
                              lambda sums: self.control.sum_over_ranks(sums, what))
        step = self.state.steps.get(ins.unit, 0) + 1
        optim_step(policy, param, grad, states, step, self.optimizer.param_groups,
                   self._ranges[key] if whole is None else [], whole)
        self.state.steps[ins.unit] = step

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() updates (DeepSpeed's name): every gradient_accumulation_steps-th,
        or what `set_gradient_accumulation_boundary` said."""
        return self.control.boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the next backward and step() end an accumulation, in place of the count
        (DeepSpeed's override, which accelerate and Hugging Face's Trainer set before every
        backward and follow with step() only at a boundary). The backward's loss is still divided
        by gradient_accumulation_steps unless `backward(..., scale_wrt_gas=False)`."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"[rank {self.rank}] set_gradient_accumulation_boundary takes True or False, "
                            f"got {is_boundary!r}")
        self.control.boundary_override = is_boundary

    @torch.no_grad()
    def step(self) -> None:
        """At an accumulation boundary: AdamW on this rank's shard of every trainable unit, then
        clear the gradients and step the LR schedule; between boundaries, nothing (the gradients
        accumulate).

        With float16 loss scaling a step whose gradients overflowed on any rank is skipped on every
        rank (`skipped_steps`); a non-finite loss (bfloat16, fp32) is an error on every rank.
        """
        if self.without_optimizer is not None:
            raise RuntimeError(f"[rank {self.rank}] engine.step: {self.without_optimizer}")
        if self._no_sync:
            raise RuntimeError(f"[rank {self.rank}] step() inside engine.no_sync(): the gradients of the backwards "
                               "in it are not reduced yet; leave the block and run one more backward first")
        if self._stash is not None:  # what a forward wrote that no backward read ([Note: activations on a tier, at run time])
            self._stash.end_step()
        self._user.writes.take()
        self._user.release_held()  # (an eager forward at ZeRO-3 that no backward followed)
        if self._stepping is None:
            raise RuntimeError(f"[rank {self.rank}] step() before any forward/backward")
        boundary = self.control.boundary
        self._step_applied = False
        self.control.micro_steps += 1
        if not boundary:
            self.tput_timer.stop(global_step=False)
            return
        runner = self._stepping.step
        grads = self.state.grads
        missing = [i.unit for i in runner.program.instructions if i.kind == "optim_step" and i.unit not in grads]
        if missing:
            raise RuntimeError(
                f"[rank {self.rank}] step() found no gradient for units {missing}: call "
                "engine.backward(loss) after the forward and before step()"
            )
        self.optimizer.check_group_count()
        update = self.control.agree(self.layouts)
        self._step_applied = update
        if update:
            runner.run(self._bind(runner, self._stepping.compiled.programs["step"], {}), self._record)
            self._requires_grad.stepped(self._window.gradless or frozenset())
        self._window.reset()
        grads.clear()
        self._ran_program()  # (after the gradient shards go)
        self._user.bind()  # (the step updated in place: only a unit whose storage moved is rebound)
        self.control.stepped(self.optimizer, skipped=not update)
        self.tput_timer.stop(global_step=True)
        self._log.stepped(self)

    # -- the rest of DeepSpeed's engine surface: `EngineSurface` (runtime/engine_surface.py) --

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine lacks are the module's (DeepSpeed's engine forwards them too):
        `engine.config` is the engine's, `engine.generation_config` the model's."""
        if name.startswith("__") or "_model" not in self.__dict__:
            raise AttributeError(name)
        try:
            return getattr(self.__dict__["_model"], name)
        except AttributeError:
            raise AttributeError(f"neither the fxzero Engine nor its module {type(self.__dict__['_model']).__name__} "
                                 f"has an attribute {name!r}") from None

    def _ran_program(self) -> None:
        """After each program: a CPU rank hands the heap's freed pages back (host_memory.py), so
        its resident memory follows the bytes in use, not the heap's high-water mark."""
        if self._trim_host:
            release_freed_host_memory()

    def close(self) -> None:
        """Finish offload I/O in flight and remove this rank's NVMe files (also done at exit)."""
        self.state.settle_grads()
        if self.store is not None:
            self.store.close()
        if self._stash is not None:
            self._stash.close()


_STATES_KEPT = 4
"""How many other module states' programs an engine keeps ([Note: module attributes changed after compile])."""

DeepSpeedEngine = Engine
"""DeepSpeed's name for it: `deepspeed.runtime.engine` is this module under `fxzero run`
([Note: DeepSpeed's deeper names] in `fxzero/deepspeed_alias.py`)."""

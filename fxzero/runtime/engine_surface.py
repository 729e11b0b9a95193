"""What a DeepSpeed training script reads and calls on the engine, beside running the model.

`Engine` (`fxzero/runtime/engine.py`) runs the compiled programs: the call, the backward, the
step. This is the rest of its surface, DeepSpeed's engine's as programs use it: the step
counters and loss scale, the batch sizes and learning rates, the mode switches, `no_sync`, the
module's state dict, random layer-token drop, checkpoints and 16-bit saves, and the memory, I/O
and communication reports. A mixin of `Engine`: each reads the engine's own state.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.nn as nn

from fxzero.config.notices import warn_ineffective
from fxzero.runtime import checkpoint
from fxzero.runtime.random_ltd.helper import remove_random_ltd_state_dict
from fxzero.runtime.random_ltd.routing import RandomLTDRouting

__all__ = ["EngineSurface"]


class EngineSurface:
    """DeepSpeed's engine surface over `Engine`'s state (module doc)."""

    @property
    def loss_scale(self) -> Optional[float]:
        """The float16 loss scale the next backward multiplies the loss by (None without scaling)."""
        return self.control.scaler.scale if self.control.scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because float16 gradients overflowed (on every rank alike)."""
        return self.control.skipped_steps

    @property
    def global_steps(self) -> int:
        """Optimizer steps (accumulation boundaries) so far, skipped ones included."""
        return self.control.global_steps


    # -- what a DeepSpeed training script reads ----------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The model the engine was built from, a view of what it trains: parameters this rank
        holds whole are views of the trained values, parameters sharded at ZeRO-3 are meta-device
        placeholders, and `state_dict()` gathers the trained values ([Note: the user's module] in
        `fxzero/runtime/user_module.py`)."""
        return self._model

    @property
    def lr_scheduler(self) -> Any:
        """The LR schedule the engine steps at each optimizer step (None: none)."""
        return self.control.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        self.control.lr_scheduler = scheduler

    def _batch(self, name: str, value: Optional[int]) -> int:
        if value is None:
            raise ValueError(f"[rank {self.rank}] no batch size is configured: set Config.train_batch_size or "
                             f"Config.train_micro_batch_size_per_gpu (DeepSpeed's keys) to read {name}()")
        return value

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch("train_micro_batch_size_per_gpu", self.control.batch.micro_batch_size)

    def train_batch_size(self) -> int:
        return self._batch("train_batch_size", self.control.batch.train_batch_size)

    def gradient_accumulation_steps(self) -> int:
        return self.control.accumulation

    def get_lr(self) -> list[float]:
        """The learning rate of each param group, as the next update will use it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The norm of the whole gradient (all ranks' shards, unscaled, before clipping) at the last
        optimizer step; None before the first or when gradients live on a tier."""
        return self.control.grad_norm

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, as the DeepSpeed config named it (0, plain data parallelism, runs as 1)."""
        return self.deepspeed_stage if self.deepspeed_stage is not None else self.config.stage

    def fp16_enabled(self) -> bool:
        mp = self.config.mixed_precision
        return mp is not None and mp.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        mp = self.config.mixed_precision
        return mp is not None and mp.param_dtype == torch.bfloat16

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters (False between accumulation boundaries
        and on a step skipped for a float16 overflow)."""
        return self._step_applied

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside the block keep their gradients whole on this rank, unreduced; the first
        backward after it reduces them with its own (DeepSpeed's and DDP's `no_sync`). Costs the
        full gradients of the model in memory meanwhile; `step()` inside is an error."""
        if self._no_sync:
            raise RuntimeError(f"[rank {self.rank}] engine.no_sync() inside engine.no_sync(): nest it once")
        if self.config.offload.step_in_backward:
            raise RuntimeError(f"[rank {self.rank}] engine.no_sync() with Offload(step_in_backward=True): that "
                               "backward updates the parameters itself, so its gradients cannot wait; drop one")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def parameters(self, recurse: bool = True):
        """The module's parameters ([Note: the user's module]: placeholders where sharded)."""
        return self._model.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._model.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's state dict with the trained values (`module.state_dict()`; a collective at
        ZeRO-3). The whole training state is `save_checkpoint`'s."""
        return self._model.state_dict(*args, **kwargs)

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """DeepSpeed's name for `module.state_dict()`, optionally without frozen parameters."""
        sd = self._model.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self._model.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        if self._random_ltd is not None:  # (a RandomLayerTokenDrop wrapper built before initialize: its layer's names)
            sd = remove_random_ltd_state_dict(sd)
        return sd

    # -- random layer-token drop (DeepSpeed's data routing; docs/random_ltd.md) -----------------

    def random_ltd_enabled(self) -> bool:
        """Whether the config enables random-LTD (data_efficiency.data_routing.random_ltd, Config.random_ltd)."""
        return self._random_ltd is not None

    def random_ltd_config(self) -> dict[str, Any]:
        """DeepSpeed's random-LTD dict, with the batch sizes the engine adds."""
        return self._require_random_ltd("random_ltd_config()").config

    def random_ltd_initialize(self) -> None:
        """Route the layers converted to `RandomLayerTokenDrop` that the config names (DeepSpeed's
        call, made by `convert_to_random_ltd`); programs traced before are traced again."""
        self._require_random_ltd("random_ltd_initialize()").initialize(self._model)
        self._cache.clear()
        self._by_state.clear()  # (every state's programs: [Note: module attributes changed after compile])

    def _require_random_ltd(self, what: str) -> RandomLTDRouting:
        if self._random_ltd is None:
            raise ValueError(f"[rank {self.rank}] {what}: the config does not enable random-LTD; set "
                             "data_efficiency.data_routing.random_ltd.enabled true in the DeepSpeed config (or "
                             "Config.random_ltd)")
        return self._random_ltd

    def empty_partition_cache(self) -> None:
        """Release gathered parameter buffers held between steps (the pool's idle buffers)."""
        self._pool.clear()

    def destroy(self) -> None:
        """Release what the engine holds outside Python's reach (offload I/O, NVMe files); DeepSpeed's
        name for `close()`."""
        self.close()

    def compile(self, backend: Any = None, compile_kwargs: Optional[dict] = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's `engine.compile` (accelerate calls it when a dynamo backend is set): torch.compile
        on the module. fxzero compiles the model's forward and backward into its own programs at
        the first call, which torch.compile's kernels do not run in, so this has no effect; it says
        so once, and `is_compiled` is True after it, as DeepSpeed's."""
        warn_ineffective([f"engine.compile(backend={backend!r}) has no effect: fxzero compiles the model's forward "
                          "and backward into its own programs at the first call (`fxzero schedule` shows them), "
                          "and torch.compile's kernels do not run in them"])
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` was called (DeepSpeed's flag; fxzero's programs are compiled in any case)."""
        return getattr(self, "_is_compiled", False)

    def train(self, mode: bool = True) -> "EngineSurface":
        """Set the model's training mode (each mode runs its own compiled program)."""
        self._model.train(mode)
        return self

    def eval(self) -> "EngineSurface":
        return self.train(False)

    def zero_grad(self) -> None:
        self.state.settle_grads()
        self.state.grads.clear()
        self._unreduced.clear()
        self._window.reset()

    # -- recording, state and reports --------------------------------------------------------

    def record_timeline(self, on: bool = True) -> None:
        """Start (or stop) recording when each instruction runs."""
        self._record = [] if on else None

    def timeline(self) -> list:
        """The instructions run since recording started: `Timed(program, index, start, end)`."""
        return list(self._record or [])

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Save the whole training state under `save_dir/tag` (DeepSpeed's call; tag defaults to
        "global_step<N>"): every rank's parameter and optimizer shards, the step counters, loss
        scaler, LR schedule, RNG states, data loader position and `client_state`, in
        torch.distributed.checkpoint's format; `save_dir/latest` names it once it is complete.
        A collective: every rank calls it, at an accumulation boundary. Returns its directory.
        `exclude_frozen_parameters=True` leaves out the parameters that do not require grad (a
        fine-tuned model's frozen base: Hugging Face's Trainer asks it for a PEFT model); such a
        checkpoint loads with `load_module_strict=False`, which keeps the model's own values for
        them ([Note: a checkpoint without the frozen parameters] in `checkpoint/load.py`).
        See `fxzero/runtime/checkpoint/`."""
        self._user.writes.take()
        return checkpoint.save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, *, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, trust_client_state: bool = False
                        ) -> tuple[Optional[str], Optional[dict]]:
        """Load what `save_checkpoint` saved, on any world size and stage: `(path, client_state)`,
        or `(None, None)` with a warning when `load_dir` has no `latest` and no tag is given.
        A collective: every rank calls it. Nothing in the files runs as code: a `client_state`
        holding objects other than plain data needs `trust_client_state=True` (see
        docs/checkpoints.md)."""
        self._user.writes.take(refuse_lost=False, check_parameters=False)  # (a replaced buffer carried first)
        try:
            return checkpoint.load_checkpoint(self, load_dir, tag, load_module_strict=load_module_strict,
                                              load_optimizer_states=load_optimizer_states,
                                              load_lr_scheduler_states=load_lr_scheduler_states,
                                              load_module_only=load_module_only,
                                              trust_client_state=trust_client_state)
        finally:
            self._user.bind(force=True)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> Optional[str]:
        """The model in its compute dtype as one file on rank 0 (DeepSpeed's call): gathered one
        unit at a time; ".safetensors" streams, any other name is one torch.save of the dict. A
        collective. Returns the path on rank 0, None elsewhere. See `checkpoint/export.py`."""
        self._user.writes.take()
        return checkpoint.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's `stage3_gather_16bit_weights_on_model_save`, as the DeepSpeed config this
        engine was read from says it (False where it says nothing, DeepSpeed's default); True for a
        Config built in Python. accelerate and Hugging Face's Trainer ask it before saving: True
        saves the weights (`_zero3_consolidated_16bit_state_dict`), False a checkpoint. fxzero's
        own `save_16bit_model` gathers either way."""
        if self.config.deepspeed_source is None:
            return True
        zero = self.config.get("zero_optimization") or {}
        for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save"):  # (DeepSpeed's name, its alias, the deprecated one)
            if key in zero:
                return bool(zero[key])
        return False

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[dict[str, torch.Tensor]]:
        """The model's state dict in its compute dtype on rank 0, None on the others (DeepSpeed's
        name, which accelerate and Hugging Face's Trainer call to save a ZeRO-3 model): what
        `save_16bit_model` writes, gathered one unit at a time. A collective."""
        return checkpoint.consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and this rank's buffers, keyed like `model.state_dict()`.

        A collective: every rank must call it. Its traffic is not counted in comm_report().
        """
        self._user.writes.take()
        return self.state.full_state_dict(self._model, self.comm)

    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds now, by category (`RankState.memory_report`; `unreduced_grads`: the
        full gradients kept between boundaries by Config(gradient_accumulation="local"), counted
        in model_states too), plus the gathered
        parameter buffers alive now and at most (`gathered`, `gathered_peak`), the state shards
        fetched from a tier and not yet released (`staged`, `staged_peak`), and the activations
        forwards keep for their backwards (`activations`, `activations_peak`: the storages held,
        so fewer under `Activations(recompute="unit")`), and those written to a tier by
        `Activations(offload=...)`, not counted in `activations` (`activations_cpu`, `activations_nvme`:
        bytes on the tier now; `_peak`: the most at once; fetched back, they count in `staged`), and
        the freed unit-sized host buffers the executor keeps for reuse (`pooled`, `pooled_peak`:
        idle, counted in nothing else, yet resident: storage/pool.py), and the shared memory the
        collectives' transport maps (`transport`: every rank's segments, fxzero/runtime/comm/shm.py;
        in this process's resident set once touched, though each page exists once per host)."""
        g = self._gathered
        on_tier = {f"activations_{t}{s}": 0 for t in ("cpu", "nvme") for s in ("", "_peak")}
        if self._stash is not None:
            on_tier[f"activations_{self._stash.tier_name}"] = self._stash.current
            on_tier[f"activations_{self._stash.tier_name}_peak"] = self._stash.peak
        report = self.state.memory_report()
        unreduced = sum(t.numel() * t.element_size() for t in self._unreduced.values())
        return {**report, "unreduced_grads": unreduced, "model_states": report["model_states"] + unreduced,
                "gathered": g.current, "gathered_peak": g.peak, "staged": g.staged, "staged_peak": g.staged_peak,
                "activations": self._activations.current, "activations_peak": self._activations.peak, **on_tier,
                "pooled": self._pool.kept_bytes, "pooled_peak": self._pool.kept_peak,
                "transport": self.comm.mapped_bytes}

    def io_report(self, reset: bool = False) -> dict[str, dict]:
        """Per storage tier: bytes, seconds, calls and GB/s read and written since the last reset
        (empty when nothing is offloaded); saved activations' tier under "activations"."""
        report = self.store.report(reset) if self.store is not None else {}
        if self._stash is not None:
            report["activations"] = self._stash.report(reset)
        return report

    def comm_report(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes sent per collective kind since the last reset."""
        return self.comm.report(reset=reset)

"""`fxzero.compile`: everything a rank needs before its first step, built once, handed to the Engine.

    engine = fxzero.compile(model, config=fxzero.Config(stage=3))

In order: join the launcher's process group; make this rank's comm (shared memory, the process
group, or a world of one); resolve the cost model (calibrating this machine once per process);
plan the unit layouts; reserve room for the offloaded states; materialize this rank's parameter
storage unit by unit; bind the compiler to all of that. The Engine runs what it is handed and
compiles a new input signature's program through that function, never importing the compiler.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from fxzero import cost
from fxzero.compiler import compile_program, plan_layouts
from fxzero.config import Config, Nvme
from fxzero.config.batch import resolve_batch
from fxzero.config.batch import BatchSizes
from fxzero.config.effects import SlowSetting, ineffective_settings, slow_settings, warn_ineffective, warn_once
from fxzero.config.notices import print_once
from fxzero.leaf_modules import apply_leaf_modules
from fxzero.runtime.comm import make_comm
from fxzero.runtime.device import process_group_backend, rank_device
from fxzero.trace import DataDependentControlFlow
from fxzero.runtime.engine import Engine
from fxzero.runtime.host_memory import keep_freed_host_memory
from fxzero.runtime.lr_schedules import build_scheduler
from fxzero.runtime.materialize import broadcast_initial_values, materialize
from fxzero.runtime.optimizer import ShardedOptimizer, param_groups
from fxzero.runtime.state import RankState
from fxzero.runtime.storage.disk_probe import nvme_placements, with_measured_disks
from fxzero.runtime.storage.offload_store import OffloadStore, bytes_on_tiers, ranks_per_host
from fxzero.runtime.ties import mirror_ties, tie_groups
from fxzero.units import persistence_differences, persistent_units

__all__ = ["compile"]


def _ensure_process_group() -> None:
    """Join the launcher's process group (torchrun sets WORLD_SIZE) if the user has not."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    dist.init_process_group(process_group_backend())


@contextlib.contextmanager
def _rng_untouched():
    """The global RNG as it was, whatever compiling drew (calibration, tracing): the same seed gives
    a script the same data and dropout masks with fxzero as without it."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


def compile(
    model: nn.Module,
    config: Optional[Config] = None,
    *,
    state_dict: Optional[Mapping[str, torch.Tensor]] = None,
    model_parameters: Optional[Iterable[Any]] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> Engine:
    """Compile `model` for ZeRO training on this process's ranks.

    Args:
        model: the module; build it under `torch.device("meta")` so no rank ever allocates
            the full parameters.
        config: stage, units and optimizer: a `fxzero.Config`, or a DeepSpeed config as a dict or
            a JSON file's path (read strictly, `fxzero.config.deepspeed`); defaults to
            `fxzero.Config()` (ZeRO-3, AdamW).
        state_dict: full initial values (e.g. a checkpoint), loaded unit by unit; without it a
            meta model is initialized by its own init code, replayed one module at a time
            (`fxzero/runtime/init_replay.py`): as eager construction after
            `torch.manual_seed(config.seed)` would.
        model_parameters: the parameters, or param groups (dicts of "params" and options such as
            "weight_decay"), as a torch optimizer takes them; None: one group of all.
        device: the rank's device; None: the launcher's (`cuda:LOCAL_RANK` where CUDA is
            available, made current; else the CPU). "meta" runs a step that computes nothing:
            a dry run that finds any buffer left in host memory and any host sync
            (`fxzero/runtime/device.py`, `tools/gpu_check.py --dry-run`).
    """
    with _rng_untouched():
        return _compile(model, config, state_dict, model_parameters, device)


def _init_record(model: nn.Module) -> Any:
    """The `zero.Init` record of the model, else of a model built under `zero.Init` inside it that
    a rank holds whole (a wrapper built around it after `from_pretrained`: DeepSpeed-Chat's reward
    model around the transformer), else None."""
    own = getattr(model, "_fxzero_zero_init", None)
    if own is not None:
        return own
    held = [r for r in (getattr(m, "_fxzero_zero_init", None) for m in model.modules())
            if r is not None and r.held_by is not None]
    if len({r.held_by for r in held}) > 1:
        raise ValueError("the model holds models built under zero.Init that different ranks hold whole (each "
                         "gathered first with another modifier_rank): gather them with one modifier_rank")
    return held[0] if held else None


def _agree_on_values(comm: Any, model: nn.Module, given: bool, seeded: bool, holder: Optional[int]) -> None:
    """Every rank takes the model's values from the same source, or every rank raises (rather
    than each waiting in a different collective); and every rank's model ties the holder's
    parameters ([Note: tied weights on every rank alike] in `fxzero/runtime/ties.py`)."""
    if comm.world_size == 1:
        return
    mine = ("state_dict" if given else f"rank {holder}'s model" if holder is not None
            else "the model's own init, replayed" if seeded else "rank 0's model, broadcast")
    seen = comm.all_gather_object((mine, tie_groups(model)))
    sources = [source for source, _ in seen]
    ties = [groups for _, groups in seen]
    if len(set(sources)) == 1 and len(set(ties)) > 1:
        if holder is not None:
            mirror_ties(model, ties[holder])
        else:
            where = "; ".join(f"ranks {[r for r, x in enumerate(ties) if x == t]}: {list(t) or 'none'}"
                              for t in dict.fromkeys(ties))
            raise RuntimeError(f"[rank {comm.rank}] the ranks' models tie different parameters ({where}): build "
                               "the model alike on every rank (the same code ties the same weights)")
    if len(set(sources)) > 1:
        where = "; ".join(f"ranks {[r for r, x in enumerate(sources) if x == s]}: {s}"
                          for s in dict.fromkeys(sources))
        raise RuntimeError(
            f"[rank {comm.rank}] the ranks' models would take their values from different places ({where}). "
            "Build the model alike on every rank: all of it on the meta device or under zero.Init, or all of it "
            "with values (or pass state_dict= on every rank)")


def _compile(model, config, state_dict, model_parameters, device=None) -> Engine:
    if config is None:
        config = Config()
    if isinstance(config, (dict, str, os.PathLike)):
        config = Config.from_deepspeed(config)
    if not isinstance(config, Config):
        raise TypeError(
            f"config must be a fxzero.Config, or a DeepSpeed config (a dict or a JSON file's path), "
            f"got {type(config).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxzero.compile expects an nn.Module, got {type(model).__name__}")
    groups, group_of, ungrouped = param_groups(model, model_parameters, config.optimizer)  # (before any allocation)
    apply_leaf_modules(model, config.leaf_modules)  # (as DeepSpeed's initialize flags them: before the units)
    _ensure_process_group()
    device = rank_device() if device is None else torch.device(device)
    if config.keep_host_memory and not torch.cuda.is_available():
        keep_freed_host_memory()
    comm = make_comm(config.link_emulation, config.transport, config.collective_timeout)
    batch = resolve_batch(config.train_batch_size, config.train_micro_batch_size_per_gpu,
                          config.gradient_accumulation_steps, comm.world_size)
    if batch.gradient_accumulation_steps == 1 and config.gradient_accumulation == "local":
        warn_ineffective(['Config(gradient_accumulation="local") has no effect with one micro-step per optimizer '
                          "step: every backward is a boundary's, which reduces; set gradient_accumulation_steps"])
    if batch.gradient_accumulation_steps > 1 and config.offload.step_in_backward:
        raise ValueError(f"[rank {comm.rank}] the batch sizes imply gradient_accumulation_steps="
                         f"{batch.gradient_accumulation_steps}, and Offload(step_in_backward=True) updates in every "
                         "backward: drop step_in_backward, or make the batch sizes imply one micro-step")
    record = _init_record(model)  # built under fxzero.zero.Init ([Note: zero.Init])
    holder = record.held_by if record is not None and state_dict is None else None  # (whole on one rank since a
    # gather before initialize: [Note: gathering before initialize] in fxzero/zero.py)
    seeded = state_dict is None and record is None and any(p.is_meta for p in model.parameters())
    _agree_on_values(comm, model, state_dict is not None, seeded, holder)
    warn_ineffective(ineffective_settings(config, world_size=comm.world_size, cuda=torch.cuda.is_available(),
                                          initialized_from_seed=seeded))
    warn_once(slow_settings(config, cuda=torch.cuda.is_available()), SlowSetting)
    if state_dict is None and not seeded and record is None and comm.world_size > 1:
        broadcast_initial_values(model)  # every rank starts from rank 0's values
    cost_model = cost.resolve(config.cost_model, comm, config.link_emulation)
    if isinstance(config.cost_model, str) and config.cost_model == "measure":
        cost_model = with_measured_disks(cost_model, nvme_placements(config), comm)  # (the disk too)
    layouts = plan_layouts(model, config, comm.world_size, cost_model, frozen=ungrouped)
    whole = persistent_units(config, layouts)  # units held whole, not sharded
    warn_ineffective(persistence_differences(config, layouts))
    _report_batch(config, batch, comm.world_size)
    store: Optional[OffloadStore] = None
    spilled: frozenset[str] = frozenset()  # units whose parameter shards live on a tier
    if config.offload.tiers():
        on_disk = any(isinstance(p, Nvme) for p in (config.offload.params, config.offload.optimizer,
                                                     config.offload.grads) if p is not None)
        local = ranks_per_host(comm) if on_disk and comm.world_size > 1 else None  # (they share its disk)
        store = OffloadStore(config.offload, comm.rank, config.optimizer, local_ranks=local)
        mp = config.mixed_precision
        store.reserve(bytes_on_tiers(config.offload, layouts, whole, mp.low_dtype if mp is not None else None,
                                     config.optimizer, state_dtype=mp.optimizer_dtype if mp is not None else None))
        if store.offloaded("param"):
            spilled = frozenset(lay.name for lay in layouts if lay.name not in whole)
    params, buffers = materialize(
        model, layouts, rank=comm.rank, whole=whole, state_dict=state_dict,
        seed=record.rng_state if record is not None else config.seed, holder=holder,
        holder_rng=holder is not None and record.rng_alike,
        spill=spilled, spill_to=functools.partial(_spill, store, config.mixed_precision), device=device,
    )
    mp = config.mixed_precision
    state = RankState(layouts, whole, params, buffers, offloaded_params=spilled, rank_of_shards=comm.rank, store=store,
                      optimizer_dtype=mp.optimizer_dtype if mp is not None else None, device=device)
    if mp is not None and mp.low_dtype is not None:
        _split_masters(state, mp.low_dtype, comm.rank)
    compiler = functools.partial(_compile_for, model, config, comm.world_size, layouts, cost_model, comm.rank,
                                 device=device.type)
    engine = Engine(model, config, comm=comm, cost_model=cost_model, state=state, compiler=compiler,
                    optimizer=ShardedOptimizer(config.optimizer, groups), group_of=group_of, batch=batch)
    if config.lr_schedule is not None:  # stepped by the engine after each optimizer step
        engine.lr_scheduler = build_scheduler(config.lr_schedule, engine.optimizer)
    return engine


def _report_batch(config: Config, batch: BatchSizes, world_size: int) -> None:
    """Say once what the batch sizes the config left out were resolved to."""
    given = (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps)
    if batch.train_batch_size is not None and None in given:
        print_once([f"batch: train_batch_size {batch.train_batch_size} = train_micro_batch_size_per_gpu "
                    f"{batch.micro_batch_size} x gradient_accumulation_steps {batch.gradient_accumulation_steps} "
                    f"x world size {world_size}"])


def _spill(store: OffloadStore, mp, unit: str, shard: torch.Tensor) -> None:
    """A materialized parameter shard straight to its tier: the master, and with mixed precision
    and fp32 masters its low-precision copy beside it."""
    store.put("param", unit, shard)
    if mp is not None and mp.low_dtype is not None and shard.is_floating_point():
        store.put("low", unit, shard.to(mp.low_dtype))


def _split_masters(state: RankState, low_dtype: torch.dtype, rank: int) -> None:
    """Mixed precision: each unit's fp32 master shard and its copy in the compute dtype ([Note:
    master and low] in passes/step_program.py); a unit held whole keeps its full buffer only in
    the compute dtype, and of the fp32 values only this rank's shard."""
    for layout in state.layouts:
        if not layout.dtype.is_floating_point or layout.name in state.offloaded_params:
            continue  # (offloaded: master and copy both live on the tier, `_spill`)
        values = state.params[layout.name]
        state.low[layout.name] = values.to(low_dtype)
        if layout.name in state.whole:
            lo, hi = layout.shard_range(rank)
            state.params[layout.name] = values[lo:hi].clone()


def _compile_for(model, config, world_size, layouts, cost_model, rank, args, kwargs, forward_only=False, *,
                 device="cpu", module=None):
    """`module`: compile this module's call instead of the model's; it has the model's parameters
    under their names (`GradientProbe`, [Note: gradients from outside the program])."""
    with _rng_untouched():
        return _compile_program(model if module is None else module, config, world_size, layouts, cost_model, rank,
                                args, kwargs, forward_only, device)


def _compile_program(model, config, world_size, layouts, cost_model, rank, args, kwargs, forward_only, device):
    try:
        return compile_program(model, args, config, world_size=world_size, layouts=layouts, cost_model=cost_model,
                               kwargs=kwargs, forward_only=forward_only, device=device)
    except DataDependentControlFlow as e:
        raise DataDependentControlFlow(e.where).with_rank(rank) from e.__cause__

"""DeepSpeed's `deepspeed.utils`: whole values of sharded parameters, gradients and optimizer
states, a rank-aware logger, and the fp32 weights of a saved checkpoint.

    from fxzero.utils import safe_get_full_fp32_param, safe_get_full_grad, logger
    w = safe_get_full_fp32_param(model.lm_head.weight)     # every rank calls it: a collective
    g = safe_get_full_grad(model.lm_head.weight)           # between backward() and step()

Each `safe_get_*` gathers the one unit holding the parameter and returns a new tensor of the
parameter's shape on every rank (None where DeepSpeed gives None: no gradient yet, no state
yet); each `safe_set_*` writes a full value given on every rank into every rank's shard.

[Note: frozen parameters have no training state]
A parameter that does not require grad has no fp32 master, gradient or optimizer state under
DeepSpeed (its optimizer never holds it), and DeepSpeed's `safe_get_*` give None for it;
programs written for DeepSpeed (and its own tests) rely on that to skip frozen weights, so
fxzero's give None too. Its value is read with `GatheredParameters`, set with
`safe_set_full_fp32_param`.

`set_z3_leaf_modules(model, [MoeBlock])` (Hugging Face's accelerate, LLaMA-Factory and axolotl
call it for mixture-of-experts models at ZeRO-3) flags modules whose parameters are never split
across units: `fxzero/leaf_modules.py`.
"""

from __future__ import annotations

import logging as _logging  # (`logging` here is DeepSpeed's deepspeed.utils.logging under the alias)
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch

from fxzero.leaf_modules import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                                 set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                                 z3_leaf_module, z3_leaf_parameter)
from fxzero.runtime.checkpoint.export import _checkpoint_dir
from fxzero.runtime.checkpoint import format as fmt
from fxzero.runtime.checkpoint.reader import CheckpointReader
from fxzero.runtime.comm import Pending
from fxzero.runtime.user_module import UserModule, binding_of

__all__ = ["RepeatingLoader", "clone_tensors_for_torch_save", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint",
           "log_dist", "logger", "recursive_getattr", "recursive_setattr",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized",
           # DeepSpeed's ZeRO-3 leaf modules (fxzero/leaf_modules.py)
           "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter",
           "see_memory_usage"]


def _logger() -> _logging.Logger:
    log = _logging.getLogger("fxzero")
    if not log.handlers:
        handler = _logging.StreamHandler(sys.stdout)
        handler.setFormatter(_logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                               "%(message)s"))
        log.addHandler(handler)
        log.setLevel(_logging.INFO)
        log.propagate = False
    return log


logger = _logger()
"""The "fxzero" logger (DeepSpeed's `deepspeed.utils.logger`: INFO to stdout)."""


def log_dist(message: str, ranks: Optional[Iterable[int]] = None, level: int = _logging.INFO) -> None:
    """Log `message` on the ranks listed (None or [-1]: every rank), prefixed with the rank."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's memory log line (`deepspeed.runtime.utils.see_memory_usage`): with `force`, on
    rank 0, after a garbage collection, logs `message`, the accelerator's allocated and reserved
    memory (current and peak, whose peaks it then resets) where the ranks run on one, and the
    host's: this process's resident set (now and at peak) and the machine's memory in use. Without
    `force` it does nothing, as DeepSpeed's."""
    import gc
    import resource

    import torch.distributed as dist

    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    logger.info(message)
    gib = 1024 ** 3
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        logger.info(f"MA {torch.cuda.memory_allocated() / gib:.2f} GB         "
                    f"Max_MA {torch.cuda.max_memory_allocated() / gib:.2f} GB         "
                    f"CA {torch.cuda.memory_reserved() / gib:.2f} GB         "
                    f"Max_CA {torch.cuda.max_memory_reserved() / gib:.2f} GB ")
        torch.cuda.reset_peak_memory_stats()
    rss = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                kib = int(line.split()[1])
                rss, peak = (kib, peak) if line.startswith("VmRSS:") else (rss, kib)
    meminfo = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            meminfo[key] = int(value.split()[0])
    used = meminfo["MemTotal"] - meminfo.get("MemAvailable", meminfo["MemFree"])
    logger.info(f"CPU Virtual Memory:  used = {used / 1024 ** 2:.2f} GB, percent = "
                f"{100 * used / meminfo['MemTotal']:.1f}%; this process: RSS {rss / 1024 ** 2:.2f} GB, "
                f"peak {max(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024 ** 2:.2f} GB")


def _bound(param: torch.Tensor, what: str) -> tuple[UserModule, str]:
    found = binding_of(param)
    if found is None:
        raise TypeError(f"{what}: this tensor is not a parameter of a model an fxzero engine trains (pass one of "
                        "engine.module's parameters)")
    found[0].writes.take(check_parameters=False)  # (the user's writes into the module first: [Note: writes into the user's module])
    return found


def _slots(binding: UserModule, fqn: str) -> list:
    """(layout, slot) of each unit holding `fqn`: its unit, or a tiled parameter's tiles in row
    order ([Note: tiling] in `fxzero/passes/tile.py`)."""
    units = set(binding.units_of[fqn])
    return [(lay, s) for lay in binding.state.layouts if lay.name in units for s in lay.slots if s.fqn == fqn]


def _gather_shards(binding: UserModule, fqn: str, shard_of: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """The parameter `fqn`'s full value from every rank's shard `shard_of(layout)` of each unit
    holding it (a collective per unit)."""
    values: dict[str, torch.Tensor] = {}
    for layout, slot in _slots(binding, fqn):
        shard = shard_of(layout)
        flat = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
        binding.comm.all_gather(flat, shard.contiguous(), count=False).wait()
        slot.read_into(flat, values)
    return values[fqn]


def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full fp32 (master) value on every rank; None for a frozen parameter
    ([Note: frozen parameters have no training state]). A collective."""
    binding, fqn = _bound(param, "safe_get_full_fp32_param")
    if not param.requires_grad:
        return None
    values: dict[str, torch.Tensor] = {}
    for layout, flat in binding.gather([fqn], compute=False, what="safe_get_full_fp32_param"):
        for slot in layout.slots:
            if slot.fqn == fqn:
                slot.read_into(flat, values)
    return values[fqn]


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The parameter's full gradient, averaged over the ranks and unscaled (float16's loss scale
    divided out), as the next step() would apply it before clipping; None before a backward or
    after step(), and for a frozen parameter. A collective."""
    binding, fqn = _bound(param, "safe_get_full_grad")
    if not param.requires_grad:
        return None
    state, engine = binding.state, binding.engine
    layout, _ = _slots(binding, fqn)[0]
    _refuse_unreduced(binding, "safe_get_full_grad")
    held = state.grads.get(layout.name)
    present = binding.comm.all_gather_object(held is not None) if binding.comm.world_size > 1 else [held is not None]
    if not all(present):
        return None

    def shard_of(layout) -> torch.Tensor:
        held = state.grads[layout.name]
        if isinstance(held, Pending):
            held = state.grads[layout.name] = held.wait()
        if held.numel() == 0:  # on a tier ([Note: accumulating on a tier])
            held = state.store.get("grad", layout.name)
        if held.numel() == layout.padded_numel:  # a unit held whole keeps its gradient whole (ZeRO-1)
            lo, hi = layout.shard_range(binding.comm.rank)
            held = held[lo:hi]
        return held.float()

    grad = _gather_shards(binding, fqn, shard_of)
    scaler = engine.control.scaler if engine is not None else None
    return grad.div_(scaler.scale) if scaler is not None else grad


def _optimizer_state(param: torch.Tensor, key: str, what: str) -> tuple[UserModule, str, Any]:
    """(binding, FQN, optimizer policy) of `param`, whose optimizer keeps the state `key`."""
    binding, fqn = _bound(param, what)
    policy = binding.engine.optimizer.policy
    if key not in policy.states:
        raise KeyError(f"{what}: {type(policy).__name__} keeps the states {list(policy.states)}, not {key!r}")
    return binding, fqn, policy


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """The parameter's full optimizer state `optim_state_key` ("exp_avg", "exp_avg_sq", "sum", ...);
    None before the first step, and for a frozen parameter. A collective."""
    binding, fqn, _ = _optimizer_state(param, optim_state_key, "safe_get_full_optimizer_state")
    if not param.requires_grad:
        return None
    state = binding.state
    layout, _ = _slots(binding, fqn)[0]
    if layout.name not in state.steps:
        return None
    offloaded = state.store is not None and state.store.offloaded(optim_state_key)
    return _gather_shards(binding, fqn, lambda layout: state.store.get(optim_state_key, layout.name) if offloaded
                          else state.optimizer_states[layout.name][optim_state_key])


def _install_full(binding: UserModule, fqn: str, value: torch.Tensor, what: str) -> dict[str, torch.Tensor]:
    """Each unit holding `fqn` (one, or a tiled parameter's tiles): its full flat fp32 buffer with
    `value`'s elements in `fqn`'s place (a collective)."""
    _, slot = binding.slot[fqn]
    if tuple(value.shape) != slot.full_shape:
        raise ValueError(f"{what}: the value has shape {tuple(value.shape)}, the parameter {slot.full_shape}")
    flats = {}
    for layout, flat in binding.gather([fqn], compute=False, what=what):
        for s in layout.slots:
            if s.fqn == fqn:
                flat[s.offset : s.offset + s.numel].copy_(value.reshape(-1)[s.start : s.start + s.numel])
        flats[layout.name] = flat
    return flats


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master to `value` (the same on every rank), and its compute-dtype
    copy from it. A collective."""
    binding, fqn = _bound(param, "safe_set_full_fp32_param")
    for unit, flat in _install_full(binding, fqn, value, "safe_set_full_fp32_param").items():
        binding.state.install_unit(unit, lambda lo, hi, flat=flat: flat[lo:hi], binding.compute_dtype)
    binding.bind(force=True)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the parameter's optimizer state `optim_state_key` to `value` (the same on every rank)."""
    binding, fqn, policy = _optimizer_state(param, optim_state_key, "safe_set_full_optimizer_state")
    state = binding.state
    offloaded = state.store is not None and state.store.offloaded(optim_state_key)
    for layout, slot in _slots(binding, fqn):  # (a tiled parameter's tiles: each its rows)
        lo, hi = layout.shard_range(binding.comm.rank)
        full = value.reshape(-1)[slot.start : slot.start + slot.numel].to(state.state_dtype(layout.name))
        shard = (state.store.get(optim_state_key, layout.name) if offloaded
                 else state.optimizer_state(layout.name, optim_state_key, policy.initial_value(optim_state_key)))
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            shard[a - lo : b - lo].copy_(full[a - slot.offset : b - slot.offset])
        if offloaded:
            state.store.put(optim_state_key, layout.name, shard)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint `engine.save_checkpoint` wrote, read offline, no
    ranks needed (DeepSpeed's zero_to_fp32): parameters (a tied one under its first name) and
    persistent buffers. Holds the whole model in memory; `fxzero export` streams it to a file."""
    reader = CheckpointReader(_checkpoint_dir(checkpoint_dir, tag), cache_blobs=0)
    frozen = {slot[0] for unit in reader.manifest["units"] if not unit["trainable"] for slot in unit["slots"]}
    frozen = frozen if exclude_frozen_parameters else set()
    left_out = set(reader.manifest.get("excluded_frozen", ()))  # (saved without them: no value to read)
    if left_out - frozen:
        warnings.warn(f"{reader.path}: saved with exclude_frozen_parameters=True, the checkpoint holds no value of "
                      f"{len(left_out - frozen)} frozen parameters ({', '.join(sorted(left_out - frozen)[:3])}, ...): "
                      "the state dict leaves them out", stacklevel=2)
    return {fqn: reader.read_tensor(fmt.param_key(fqn)).clone() for fqn, _, _ in reader.manifest["tensors"]
            if fqn not in frozen and fqn not in left_out}


@torch.no_grad()
def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """Load the fp32 weights of a checkpoint `engine.save_checkpoint` wrote into `model`, and return
    it (DeepSpeed's zero_to_fp32 function of this name). Every parameter and persistent buffer
    the checkpoint holds is copied into the module's tensors, cast to their dtype; the model stays
    where it is (DeepSpeed moves it to the CPU first).

    On an engine's module the values land where its parameters point (the compute-dtype copies,
    or the full values inside `GatheredParameters`), not in the engine's fp32 masters: as under
    DeepSpeed, the engine does not train from them (resume with `engine.load_checkpoint`).

    Raises:
        RuntimeError: a parameter of `model` has no value on this rank to write into (a ZeRO-3
            placeholder), or the checkpoint and the model name different tensors.
    """
    placeholders = [name for name, p in model.named_parameters() if p.is_meta]
    if placeholders:
        raise RuntimeError(f"load_state_dict_from_zero_checkpoint: {placeholders[:3]}{' ...' * (len(placeholders) > 3)} "
                           "have no value on this rank to load into (on the meta device: an engine's ZeRO-3 placeholders, "
                           "or a model built under zero.Init before initialize); call it inside `with "
                           "deepspeed.zero.GatheredParameters(model.parameters()):` on an engine's module, or load into "
                           "a model built without zero.Init, or resume the engine with engine.load_checkpoint(...)")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    result = model.load_state_dict(state_dict, strict=False)
    # (a tied tensor is saved under its first name: its other names are loaded with it)
    loaded = {id(t) for name, t in _named_tensors(model) if name in state_dict}
    missing = [k for k in result.missing_keys if id(dict(_named_tensors(model)).get(k)) not in loaded]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"load_state_dict_from_zero_checkpoint: the checkpoint in {checkpoint_dir} does not hold "
                           f"this model's weights (missing: {missing[:5]}, unexpected: {result.unexpected_keys[:5]})")
    return model


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `model` under each of its names (tied ones under each)."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


# -- this rank's part of a parameter (DeepSpeed's safe_get_local_* / safe_set_*_grad) ----------------


def _local_pieces(binding: UserModule, fqn: str) -> list[tuple[Any, int, int]]:
    """(layout, a, b) for each unit holding `fqn`: elements [a, b) of this rank's shard of it are
    the parameter's (in the parameter's flattened order; none where the shard holds none of it)."""
    out = []
    for layout, slot in _slots(binding, fqn):
        lo, hi = layout.shard_range(binding.comm.rank)
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            out.append((layout, a - lo, b - lo))
    return out


def _local(binding: UserModule, fqn: str, shard_of: Callable[[Any], torch.Tensor]) -> Optional[torch.Tensor]:
    pieces = [shard_of(layout)[a:b] for layout, a, b in _local_pieces(binding, fqn)]
    return torch.cat(pieces).clone() if pieces else None


def _grad_shard(binding: UserModule, layout: Any) -> torch.Tensor:
    """This rank's reduced gradient shard of `layout`'s unit, waited for and fetched from a tier
    (a view where it is held, so a write lands; on a tier, a copy: `_put_grad_shard` writes it back)."""
    state = binding.state
    held = state.grads[layout.name]
    if isinstance(held, Pending):
        held = state.grads[layout.name] = held.wait()
    if held.numel() == 0:  # on a tier ([Note: accumulating on a tier])
        held = state.store.get("grad", layout.name)
    if held.numel() == layout.padded_numel:  # a unit held whole keeps its gradient whole (ZeRO-1)
        lo, hi = layout.shard_range(binding.comm.rank)
        held = held[lo:hi]
    return held


def _put_grad_shard(binding: UserModule, layout: Any, shard: torch.Tensor) -> None:
    if binding.state.grads[layout.name].numel() == 0:  # (on a tier)
        binding.state.store.put("grad", layout.name, shard)


def _refuse_unreduced(binding: UserModule, what: str) -> None:
    """An error while the backwards keep their gradients whole and unreduced on each rank (inside
    `engine.no_sync()`, or between boundaries with local accumulation): no gradient the step would
    apply exists yet, only each rank's own part of it."""
    engine = binding.engine
    if engine is None or not engine._unreduced:
        return
    where = ("inside engine.no_sync()" if engine._no_sync else
             "between accumulation boundaries with Config(gradient_accumulation='local')")
    raise RuntimeError(f"[rank {binding.comm.rank}] {what} {where}: the gradients are not reduced over the ranks yet "
                       "(each rank holds its own); call it after the backward that reduces them (the first one after "
                       "the no_sync block, or the boundary's)")


def _grads_ready(binding: UserModule, fqn: str, what: str) -> bool:
    """Whether the parameter's gradient is reduced and held (False before a backward, after step())."""
    _refuse_unreduced(binding, what)
    return all(layout.name in binding.state.grads for layout, _ in _slots(binding, fqn))


def _loss_scale(binding: UserModule) -> float:
    engine = binding.engine
    scaler = engine.control.scaler if engine is not None else None
    return scaler.scale if scaler is not None else 1.0


def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's part of the parameter's fp32 master, flattened: the parameter's elements in this
    rank's shard, in order (DeepSpeed's fragment at ZeRO-1/2; fxzero shards units, not single
    parameters, at every stage). None where this rank holds none of it, and for a frozen
    parameter. Not a collective."""
    binding, fqn = _bound(param, "safe_get_local_fp32_param")
    if not param.requires_grad:
        return None
    return _local(binding, fqn, lambda layout: binding.state.local_shard(layout.name))


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's part of the parameter's reduced gradient (averaged over the ranks, unscaled), as
    `safe_get_local_fp32_param` lays it out; None before a backward, after step(), or where this
    rank holds none of it, and for a frozen parameter. Not a collective."""
    binding, fqn = _bound(param, "safe_get_local_grad")
    if not param.requires_grad:
        return None
    if not _grads_ready(binding, fqn, "safe_get_local_grad"):
        return None
    local = _local(binding, fqn, lambda layout: _grad_shard(binding, layout))
    return None if local is None else local.float().div_(_loss_scale(binding))


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's part of the parameter's optimizer state `optim_state_key`; None before the
    first step, where this rank holds none of it, and for a frozen parameter. Not a collective."""
    binding, fqn, _ = _optimizer_state(param, optim_state_key, "safe_get_local_optimizer_state")
    if not param.requires_grad:
        return None
    state = binding.state
    if _slots(binding, fqn)[0][0].name not in state.steps:
        return None
    offloaded = state.store is not None and state.store.offloaded(optim_state_key)
    return _local(binding, fqn, lambda layout: state.store.get(optim_state_key, layout.name) if offloaded
                  else state.optimizer_states[layout.name][optim_state_key])


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's part of the parameter's fp32 master with `value` (laid out as
    `safe_get_local_fp32_param` gives it), and its compute-dtype copy with it. Call it on every
    rank, each with its own part (DeepSpeed's use: each rank sets its partition): where the
    parameter's unit is held whole on each rank (every unit at ZeRO-1/2, those under the
    persistence threshold at ZeRO-3) each rank's whole copy takes every rank's part, a collective;
    elsewhere it is not one."""
    binding, fqn = _bound(param, "safe_set_local_fp32_param")
    pieces = {layout.name: (a, b) for layout, a, b in _local_pieces(binding, fqn)}
    size = sum(b - a for a, b in pieces.values())
    if value.numel() != size:
        raise ValueError(f"safe_set_local_fp32_param: the value has {value.numel()} elements, this rank's part of the "
                         f"parameter {size} (see safe_get_local_fp32_param)")
    state, flat, at = binding.state, value.reshape(-1), 0
    for layout, _ in _slots(binding, fqn):
        shard = state.local_shard(layout.name).clone()
        if layout.name in pieces:
            a, b = pieces[layout.name]
            shard[a:b].copy_(flat[at : at + b - a])
            at += b - a
        if layout.name in state.whole:
            whole = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
            binding.comm.all_gather(whole, shard.contiguous(), count=False).wait()
            state.install_unit(layout.name, lambda lo, hi, whole=whole: whole[lo:hi], binding.compute_dtype)
        else:
            state.install_unit(layout.name, lambda lo, hi, shard=shard: shard, binding.compute_dtype)
    binding.bind(force=True)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace this rank's part of the parameter's optimizer state `optim_state_key` with `value`
    (laid out as `safe_get_local_optimizer_state` gives it). Not a collective."""
    binding, fqn, policy = _optimizer_state(param, optim_state_key, "safe_set_local_optimizer_state")
    state = binding.state
    pieces = _local_pieces(binding, fqn)
    if value.numel() != sum(b - a for _, a, b in pieces):
        raise ValueError(f"safe_set_local_optimizer_state: the value has {value.numel()} elements, this rank's part "
                         f"of the parameter {sum(b - a for _, a, b in pieces)} (see safe_get_local_optimizer_state)")
    offloaded = state.store is not None and state.store.offloaded(optim_state_key)
    flat, at = value.reshape(-1), 0
    for layout, a, b in pieces:
        shard = (state.store.get(optim_state_key, layout.name) if offloaded
                 else state.optimizer_state(layout.name, optim_state_key, policy.initial_value(optim_state_key)))
        shard[a:b].copy_(flat[at : at + b - a])
        at += b - a
        if offloaded:
            state.store.put(optim_state_key, layout.name, shard)


def _set_grad(binding: UserModule, fqn: str, part: Callable[[Any, int, int], torch.Tensor], what: str) -> None:
    if not _grads_ready(binding, fqn, what):
        raise RuntimeError(f"[rank {binding.comm.rank}] {what}: the parameter has no gradient to replace (before a "
                           "backward, or after step()); call it between engine.backward(loss) and engine.step()")
    scale = _loss_scale(binding)
    for layout, a, b in _local_pieces(binding, fqn):
        shard = _grad_shard(binding, layout)
        shard[a:b].copy_(part(layout, a, b).to(shard.dtype) * scale if scale != 1.0 else part(layout, a, b))
        _put_grad_shard(binding, layout, shard)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the parameter's reduced gradient with `value` (its full shape, the same on every
    rank), which the next step() applies (clipped and scaled as any). Call it between
    engine.backward(loss) and engine.step(), on every rank."""
    binding, fqn = _bound(param, "safe_set_full_grad")
    _, slot = binding.slot[fqn]
    if tuple(value.shape) != slot.full_shape:
        raise ValueError(f"safe_set_full_grad: the value has shape {tuple(value.shape)}, the parameter {slot.full_shape}")
    flat = value.reshape(-1)
    slots = dict((layout.name, s) for layout, s in _slots(binding, fqn))

    def part(layout: Any, a: int, b: int) -> torch.Tensor:
        lo, _ = layout.shard_range(binding.comm.rank)
        s = slots[layout.name]
        return flat[s.start + lo + a - s.offset : s.start + lo + b - s.offset]

    _set_grad(binding, fqn, part, "safe_set_full_grad")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace this rank's part of the parameter's reduced gradient with `value` (laid out as
    `safe_get_local_grad` gives it). Not a collective."""
    binding, fqn = _bound(param, "safe_set_local_grad")
    pieces = _local_pieces(binding, fqn)
    size = sum(b - a for _, a, b in pieces)
    if value.numel() != size:
        raise ValueError(f"safe_set_local_grad: the value has {value.numel()} elements, this rank's part of the "
                         f"parameter {size} (see safe_get_local_grad)")
    flat, offsets, at = value.reshape(-1), {}, 0
    for layout, a, b in pieces:
        offsets[layout.name] = at - a
        at += b - a
    _set_grad(binding, fqn, lambda layout, a, b: flat[a + offsets[layout.name] : b + offsets[layout.name]],
              "safe_set_local_grad")


def safe_update_full_grad_vectorized(param_list: Iterable[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replace the full gradient of each parameter of `param_list` that requires grad with
    `update_func(gradient, param)`, the gradient as `safe_get_full_grad` gives it (DeepSpeed's
    vectorized form of a get and a set per parameter). Call it between engine.backward(loss) and
    engine.step(), on every rank, with the same list: a collective."""
    for param in param_list:
        if not param.requires_grad:
            continue
        binding, fqn = _bound(param, "safe_update_full_grad_vectorized")
        if not _grads_ready(binding, fqn, "safe_update_full_grad_vectorized"):
            raise RuntimeError(f"[rank {binding.comm.rank}] safe_update_full_grad_vectorized: {fqn} has no gradient to "
                               "update (before a backward, or after step()); call it between engine.backward(loss) "
                               "and engine.step()")
        safe_set_full_grad(param, update_func(safe_get_full_grad(param), param))


def __getattr__(name: str) -> Any:
    """`deepspeed.utils.zero_to_fp32` and the like: under the DeepSpeed alias this module is
    `deepspeed.utils`, and the alias's modules below it are its attributes ([Note: DeepSpeed's
    deeper names] in `fxzero/deepspeed_alias.py`)."""
    module = sys.modules.get(f"deepspeed.utils.{name}")
    if module is None or sys.modules.get("deepspeed") is not sys.modules.get("fxzero"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return module


class RepeatingLoader:
    """An iterator that restarts `loader` when it ends (DeepSpeed's `RepeatingLoader`)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = "cpu") -> Any:
    """DeepSpeed's `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: `item` (a tensor, or
    lists, tuples and dicts of them) with every tensor a detached copy on `device`, so that
    `torch.save` writes each tensor's own values, not the flat buffer it views (accelerate saves a
    ZeRO-1/2 model's state dict through it). Anything else is returned as it is."""
    if isinstance(item, torch.Tensor):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


def recursive_getattr(model: torch.nn.Module, module_name: str) -> Any:
    """DeepSpeed's `deepspeed.utils.module_utils.recursive_getattr` (formerly
    `deepspeed.compression.helper`'s): the attribute at a dotted path ("decoder.layers.0.fc1")."""
    value: Any = model
    for part in module_name.split("."):
        value = getattr(value, part)
    return value


def recursive_setattr(model: torch.nn.Module, module_name: str, module: Any) -> None:
    """DeepSpeed's `recursive_setattr`: set the attribute at a dotted path (LoRA scripts replace a
    model's Linear layers by it)."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)

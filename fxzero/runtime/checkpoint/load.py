"""`engine.load_checkpoint`: each rank reads the ranges of its own shards, for whatever world size
and stage it runs now, and installs them where its states live (device, host memory, NVMe).

The model must be the one saved (its FQNs, shapes and dtypes: the manifest's fingerprint); the
world size, the stage, the unit plan, the placements and mixed precision may all differ. A unit
is read, installed and released before the next, so a rank never holds more than its shards
plus one unit's. Each rank's RNG states are restored when the world size is the one saved (a
rank of a new world has no saved generator of its own); the data loader resumes at the saved
position. Every rank reports to the others before returning, so a file that fails its check on
one rank is an error on all of them.

Nothing is unpickled as it stands ([Note: loading runs no code] in safe_load.py), and all that
is not a tensor (step counters, scaler, RNG states, param groups, client_state) is read before
anything is replaced: a refused file leaves the engine as it was.

[Note: a checkpoint without the frozen parameters]
`save_checkpoint(exclude_frozen_parameters=True)` (DeepSpeed's; Hugging Face's Trainer asks it for
a PEFT model, whose frozen base is most of the model) writes no value and no optimizer state of a
parameter that does not require grad, and lists them in the manifest ("excluded_frozen"); its
manifest still describes the whole model, so the model check is the same. Loading it needs
`load_module_strict=False` (the Trainer passes it for a PEFT model, as DeepSpeed's loads the
module's state dict non-strictly): each parameter left out keeps this engine's own value (the
base model the run was built from) and its optimizer state, one unit's full buffer gathered at a
time where a unit mixes saved and left-out parameters. With `load_module_strict=True` such a
checkpoint is an error naming the parameters it lacks. `load_module_strict=False` relaxes nothing
else: any other difference from this model is still an error, since fxzero loads a checkpoint of
this model only.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any, NamedTuple, Optional

import torch

from fxzero.runtime.checkpoint import format as fmt
from fxzero.runtime.checkpoint.files import CheckpointError
from fxzero.runtime.checkpoint.reader import CheckpointReader
from fxzero.runtime.checkpoint.safe_load import unpickled
from fxzero.runtime.checkpoint.save import state_shard
from fxzero.runtime.state import install

__all__ = ["load_checkpoint", "resolve_checkpoint"]


def resolve_checkpoint(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The checkpoint directory `tag` names (None: the one `latest` names); None if there is no
    `latest`. A tag whose directory was moved aside by a save of the same tag that never finished
    resolves to that previous directory."""
    if tag is None:
        latest = os.path.join(load_dir, fmt.LATEST)
        if not os.path.exists(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    if os.path.isdir(path):
        return path
    aside = sorted(n for n in os.listdir(load_dir) if n.startswith(f"{tag}.old-")) if os.path.isdir(load_dir) else []
    if aside:
        return os.path.join(load_dir, aside[-1])
    raise CheckpointError(f"{path}: no such checkpoint (tag {tag!r}" + (f", named by {os.path.join(load_dir, fmt.LATEST)}"
                                                                        if tag is not None else "") + ")")


def _other_master_dtype(saved: list, mine: list, params: set[str]) -> list[tuple[str, str, str]]:
    """(FQN, saved dtype, this run's) of the parameters whose masters are in another floating dtype
    than the checkpoint's, where that is all that differs (else, and when nothing differs, [])."""
    if [t[:2] for t in saved] != [t[:2] for t in mine]:
        return []
    other = [(a[0], a[2], b[2]) for a, b in zip(saved, mine) if a[2] != b[2]]
    floating = all(f in params and getattr(torch, a).is_floating_point and getattr(torch, b).is_floating_point
                   for f, a, b in other)
    return other if floating else []


def _check_model(reader: CheckpointReader, engine) -> None:
    """The checkpoint is of this model: its FQNs, shapes and dtypes, except that its masters may
    be in another floating dtype (`MixedPrecision.master_dtype`): they are cast as they load,
    exactly when widened, rounded (and said so) when narrowed."""
    mine = fmt.model_tensors(engine.module, engine.layouts)
    if fmt.fingerprint(mine) == reader.manifest["fingerprint"]:
        return
    params = {slot.fqn for layout in engine.layouts for slot in layout.slots}
    other = _other_master_dtype([tuple(t) for t in reader.manifest["tensors"]], [tuple(t) for t in mine], params)
    if other:
        fqn, was, now = other[0]
        if getattr(torch, now).itemsize < getattr(torch, was).itemsize:
            warnings.warn(f"[rank {engine.rank}] {reader.path}: the checkpoint's master parameters are {was} ({fqn!r} "
                          f"and {len(other) - 1} more) and this run's are {now} (MixedPrecision.master_dtype): they "
                          f"are rounded to {now} as they load", stacklevel=4)
        return
    saved = {t[0]: t for t in reader.manifest["tensors"]}
    here = {t[0]: t for t in mine}
    where = os.path.join(reader.path, fmt.MANIFEST)
    missing = [f for f in here if f not in saved]
    extra = [f for f in saved if f not in here]
    differ = [f for f in here if f in saved and list(saved[f]) != list(here[f])]
    detail = (f"{differ[0]!r} is {here[differ[0]][1:]} here and {saved[differ[0]][1:]} in the checkpoint" if differ
              else f"the model has {missing[:3]} which the checkpoint lacks" if missing
              else f"the checkpoint has {extra[:3]} which the model lacks" if extra else "the tensors are in another order")
    raise CheckpointError(f"[rank {engine.rank}] {where}: a checkpoint of another model "
                          f"({reader.manifest.get('model_class')}): {detail}; load a checkpoint of this model")


def _read_unit(reader: CheckpointReader, layout, key_of, lo: int, hi: int,
               dtype: Optional[torch.dtype] = None, excluded: frozenset = frozenset(),
               current: Any = None) -> torch.Tensor:
    """Elements [lo, hi) of `layout`'s flat buffer, each parameter's from tensor `key_of(fqn)`, in
    `dtype` (default the layout's: cast from the dtype saved); padding zero. A parameter in
    `excluded` (not saved) takes elements [a, b) of the engine's own buffer, `current(a, b)`."""
    out = torch.zeros(hi - lo, dtype=dtype or layout.dtype)
    for slot in layout.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b and slot.fqn in excluded:  # ([Note: a checkpoint without the frozen parameters])
            out[a - lo : b - lo] = current(a, b)
        elif a < b:
            start = slot.start - slot.offset  # (a tile's elements are at its start in the whole parameter)
            reader.read_range(key_of(slot.fqn), a + start, b + start, out[a - lo : b - lo])
    return out


@torch.no_grad()
def _load_params(engine, reader: CheckpointReader, excluded: frozenset) -> None:
    mp = engine.config.mixed_precision
    low_dtype = mp.low_dtype if mp is not None else None
    for layout in engine.layouts:
        left_out = {slot.fqn for slot in layout.slots} & excluded
        if left_out and len(left_out) == len({slot.fqn for slot in layout.slots}):
            continue  # (nothing of the unit was saved: it keeps what it holds)
        # (a unit that mixes saved and left-out parameters: its own values, whole, on every rank alike)
        full = engine.state.full_unit(layout.name, engine.comm, False) if left_out else None
        engine.state.install_unit(layout.name, lambda lo, hi, layout=layout, full=full: _read_unit(
            reader, layout, fmt.param_key, lo, hi, excluded=excluded, current=lambda a, b: full[a:b]), low_dtype)


@torch.no_grad()
def _load_optimizer(engine, reader: CheckpointReader, excluded: frozenset) -> None:
    state, policy, rank = engine.state, engine.optimizer.policy, engine.rank
    saved = reader.manifest["optimizer"], tuple(reader.manifest["states"])
    if saved != (type(policy).__name__, tuple(policy.states)):
        raise CheckpointError(
            f"[rank {rank}] {os.path.join(reader.path, fmt.MANIFEST)}: the checkpoint holds {saved[0]}'s states "
            f"{list(saved[1])} and this engine runs {type(policy).__name__} ({list(policy.states)}); use the same "
            "optimizer, or load_checkpoint(..., load_optimizer_states=False) to start its states afresh")
    warned = False
    for layout in engine.layouts:
        if not layout.trainable:
            continue
        unit = layout.name
        lo, hi = layout.shard_range(rank)
        steps = {int(reader.read_tensor(fmt.state_key(s.fqn, "step"))) for s in layout.slots
                 if reader.has(fmt.state_key(s.fqn, "step"))}
        saved_slots = [s for s in layout.slots if s.fqn not in excluded]
        if not saved_slots:
            continue  # (nothing of the unit was saved: its states are as they are)
        for kind in policy.states:
            dtype = state.state_dtype(unit)
            mine = state_shard(engine, layout, kind) if len(saved_slots) < len(layout.slots) else None
            shard = _read_unit(reader, layout, lambda fqn, kind=kind: fmt.state_key(fqn, kind), lo, hi, dtype,
                               excluded=excluded, current=lambda a, b, mine=mine: mine[a - lo : b - lo])
            saved_dtype = reader.dtype(fmt.state_key(saved_slots[0].fqn, kind))
            if saved_dtype.itemsize > dtype.itemsize and not warned:
                warned = True
                warnings.warn(f"[rank {rank}] {reader.path}: the checkpoint's optimizer states are "
                              f"{str(saved_dtype).removeprefix('torch.')} and this run's are "
                              f"{str(dtype).removeprefix('torch.')} (MixedPrecision.optimizer_dtype): they are "
                              "rounded as they load", stacklevel=4)
            if state.store is not None and state.store.offloaded(kind):
                state.store.put(kind, unit, shard)
            else:
                held = state.optimizer_states.setdefault(unit, {})
                held[kind] = install(held.get(kind), shard)
        step = max(steps) if steps else 0
        if step:
            state.steps[unit] = step
        else:
            state.steps.pop(unit, None)


class _Saved(NamedTuple):
    """What a load takes from the checkpoint besides its tensors: read, and refused if reading it
    would run code, before any of the engine's state is replaced."""

    engine: dict[str, Any]
    """engine_state.pt: step counters, loss scaler."""
    rank: dict[str, Any]
    """rank<N>_state.pt: RNG states (this rank's when the world size is the one saved), data loader."""
    same_world: bool
    param_groups: Optional[list]
    """The DCP item optim.param_groups (None: the optimizer's states are not loaded)."""
    lr_scheduler: Any
    """The scheduler's state (None: not loaded)."""
    client_state: dict


def _check_version(reader: CheckpointReader) -> None:
    version = reader.manifest.get("version", 0)
    if version < fmt.VERSION:
        raise CheckpointError(
            f"{os.path.join(reader.path, fmt.MANIFEST)}: format version {version}, whose state files are pickled Python "
            f"objects (loading them could run code from the file); this fxzero loads format {fmt.VERSION}, which holds "
            "only tensors and plain data. Resume it with the fxzero that wrote it and save again; its weights can be "
            "exported without that (`fxzero export`, which reads only tensors)")


def _read_saved(engine, reader: CheckpointReader, *, optimizer: bool, scheduler: bool, trust: bool) -> _Saved:
    path = os.path.join(reader.path, fmt.ENGINE)
    saved = reader.load_file(fmt.ENGINE)
    client_state = {}
    for name, blob in saved["client_state"]:
        entry = unpickled(blob, path, f"client_state[{name}]", trust=trust)
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise CheckpointError(f"{path}: client_state[{name}] is not a saved (key, value) entry; the file is damaged")
        client_state[entry[0]] = entry[1]
    lr_scheduler = None
    if scheduler and engine.control.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        lr_scheduler = unpickled(saved["lr_scheduler"], path, "the LR scheduler's state", trust=trust,
                                 other_way=" (or skip it: load_lr_scheduler_states=False)")
    groups = None
    if optimizer:
        groups = reader.read_bytes_item(fmt.PARAM_GROUPS)
        mine = len(engine.optimizer.param_groups)
        if not isinstance(groups, list) or len(groups) != mine or not all(isinstance(g, dict) for g in groups):
            held = f"{len(groups)} param groups" if isinstance(groups, list) else f"a {type(groups).__name__}"
            raise CheckpointError(
                f"[rank {engine.rank}] {reader.path}: item {fmt.PARAM_GROUPS!r} holds {held} and this engine's "
                f"optimizer has {mine}; build the optimizer with the groups it was saved with, or "
                "load_checkpoint(..., load_optimizer_states=False) to start its states afresh")
    same_world = reader.manifest["world_size"] == engine.world_size
    rank_state = reader.load_file(fmt.rank_file(engine.rank if same_world else 0))
    return _Saved(saved, rank_state, same_world, groups, lr_scheduler, client_state)


def _load_engine_state(engine, saved: _Saved) -> None:
    control = engine.control
    state = saved.engine
    control.global_steps = state["global_steps"]
    # A checkpoint is saved at a boundary, so the next micro-step starts an accumulation. The count
    # saved is of step() calls, a multiple of the accumulation where the engine counted, the number of
    # updates where the caller set each boundary (accelerate, Trainer): rounded down to one, lest a
    # loop that lets the engine count update after fewer micro-batches than an accumulation.
    control.micro_steps = state["micro_steps"] - state["micro_steps"] % control.accumulation
    control.skipped_steps = state["skipped_steps"]
    control.grad_norm = state["grad_norm"]
    if control.scaler is not None and state["scaler"] is not None:
        control.scaler.load_state_dict(state["scaler"])
    if saved.param_groups is not None:
        for group, values in zip(engine.optimizer.param_groups, saved.param_groups):
            group.update({k: v for k, v in values.items() if k != "params"})
    if saved.lr_scheduler is not None:
        control.lr_scheduler.load_state_dict(saved.lr_scheduler)
    if engine.random_ltd_enabled() and state.get("random_ltd") is not None:  # (as DeepSpeed: whenever both have it)
        engine.random_ltd_scheduler.load_state_dict(state["random_ltd"])


def _load_rank_state(engine, saved: _Saved) -> None:
    if saved.same_world:
        rng = saved.rank["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "numpy" in rng:
            import numpy as np
            name, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    loader = getattr(engine, "training_dataloader", None)
    if loader is not None and saved.rank["dataloader"] is not None:
        loader.load_state_dict(saved.rank["dataloader"])


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, *, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, trust_client_state: bool = False,
                    ) -> tuple[Optional[str], Optional[dict]]:
    """See `Engine.load_checkpoint`. `trust_client_state`: unpickle the user's own objects saved in
    `client_state` (and an LR scheduler's state that is not plain data), which runs code from the
    checkpoint: only for a checkpoint from a source you trust ([Note: loading runs no code] in
    safe_load.py). Plain data loads without it."""
    rank = engine.rank
    error: Optional[str] = None
    failure: Optional[BaseException] = None
    path: Optional[str] = None
    client_state: Optional[dict] = None
    replacing = False
    try:
        path = resolve_checkpoint(load_dir, tag)
    except Exception as e:
        failure = e
        error = str(e) if str(e).startswith("[rank") else f"[rank {rank}] {type(e).__name__}: {e}"
    # Every rank loads the same checkpoint, or none does: ranks that resolved different ones (a tag
    # per rank, a `latest` rewritten between their reads) would train on mismatched states.
    found = engine.comm.all_gather_object(None if error else (os.path.basename(path) if path else ""))
    if error is None and len({n for n in found if n is not None}) > 1:
        said = ", ".join(f"rank {r} {n or 'none (no latest file)'!r}" for r, n in enumerate(found) if n is not None)
        error = (f"[rank {rank}] load_checkpoint: the ranks found different checkpoints to load ({said}); pass the same "
                 "load_dir and tag on every rank; nothing was loaded")
        failure = CheckpointError(error)
    try:
        if path is not None and error is None:
            reader = CheckpointReader(path)  # (every file's size and the small files' checksums checked)
            _check_version(reader)
            _check_model(reader, engine)
            excluded = frozenset(reader.manifest.get("excluded_frozen", ()))
            if excluded and load_module_strict:
                names = sorted(excluded)
                raise CheckpointError(
                    f"[rank {rank}] {path}: saved with save_checkpoint(exclude_frozen_parameters=True), it holds no "
                    f"value of the {len(names)} frozen parameters ({', '.join(names[:3])}{', ...' * (len(names) > 3)}); "
                    "load it with load_checkpoint(..., load_module_strict=False), which keeps this model's own "
                    "values for them")
            saved = None if load_module_only else _read_saved(
                engine, reader, optimizer=load_optimizer_states, scheduler=load_lr_scheduler_states,
                trust=trust_client_state)
            engine._failed_load = f"load_checkpoint({path!r}) failed part-way"
            replacing = True
            engine.zero_grad()
            _load_params(engine, reader, excluded)
            client_state = {}
            if saved is not None:
                if load_optimizer_states:
                    _load_optimizer(engine, reader, excluded)
                _load_engine_state(engine, saved)
                _load_rank_state(engine, saved)
                client_state = saved.client_state
            persistent = set(engine.module.state_dict(keep_vars=True))
            for fqn in engine.state.buffers:
                if fqn in persistent and reader.has(fmt.param_key(fqn)):
                    engine.state.buffers[fqn] = reader.read_tensor(fmt.param_key(fqn)).clone()
            engine._failed_load = None
    except Exception as e:
        failure = e
        error = str(e) if str(e).startswith("[rank") else f"[rank {rank}] {type(e).__name__}: {e}"
    # Every rank reports: a failure on one is an error on all, and leaves every engine refusing to
    # run once any rank has begun replacing its states (the ranks' states would not match).
    reports = engine.comm.all_gather_object((error, replacing))
    failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
    if failed and any(started for _, started in reports):
        engine._failed_load = f"load_checkpoint({path!r}) failed on rank {failed[0][0]}: {failed[0][1]}"
    if failure is not None and not isinstance(failure, CheckpointError):
        raise failure
    for r, e in failed:
        raise CheckpointError(e if r == rank else f"[rank {rank}] rank {r} could not load the checkpoint: {e}")
    if path is None:
        warnings.warn(f"[rank {rank}] load_checkpoint: no {os.path.join(load_dir, fmt.LATEST)} file, so no checkpoint "
                      "was loaded (returns (None, None)); pass tag= to load a particular one", stacklevel=3)
        return None, None
    return path, client_state

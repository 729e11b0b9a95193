"""`engine.load_checkpoint`: each rank reads the ranges of its own shards, for whatever world size
and stage it runs now, and installs them where its states live (device, host memory, NVMe).

The model must be the one saved (its FQNs, shapes and dtypes: the manifest's fingerprint); the
world size, the stage, the unit plan, the placements and mixed precision may all differ. A unit
is read, installed and released before the next, so a rank never holds more than its shards
plus one unit's. Each rank's RNG states are restored when the world size is the one saved (a
rank of a new world has no saved generator of its own); the data loader resumes at the saved
position. Every rank reports to the others before returning, so a file that fails its check on
one rank is an error on all of them.
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any, Optional

import torch

from fxzero.runtime.checkpoint import format as fmt
from fxzero.runtime.checkpoint.files import CheckpointError
from fxzero.runtime.checkpoint.reader import CheckpointReader
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


def _check_model(reader: CheckpointReader, engine) -> None:
    mine = fmt.model_tensors(engine.module, engine.layouts)
    if fmt.fingerprint(mine) == reader.manifest["fingerprint"]:
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


def _read_unit(reader: CheckpointReader, layout, key_of, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `layout`'s flat buffer, each parameter's from tensor `key_of(fqn)`;
    padding zero."""
    out = torch.zeros(hi - lo, dtype=layout.dtype)
    for slot in layout.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            reader.read_range(key_of(slot.fqn), a - slot.offset, b - slot.offset, out[a - lo : b - lo])
    return out


@torch.no_grad()
def _load_params(engine, reader: CheckpointReader) -> None:
    mp = engine.config.mixed_precision
    low_dtype = mp.param_dtype if mp is not None else None
    for layout in engine.layouts:
        engine.state.install_unit(layout.name, lambda lo, hi, layout=layout: _read_unit(
            reader, layout, fmt.param_key, lo, hi), low_dtype)


@torch.no_grad()
def _load_optimizer(engine, reader: CheckpointReader) -> None:
    state, policy, rank = engine.state, engine.optimizer.policy, engine.rank
    saved = reader.manifest["optimizer"], tuple(reader.manifest["states"])
    if saved != (type(policy).__name__, tuple(policy.states)):
        raise CheckpointError(
            f"[rank {rank}] {os.path.join(reader.path, fmt.MANIFEST)}: the checkpoint holds {saved[0]}'s states "
            f"{list(saved[1])} and this engine runs {type(policy).__name__} ({list(policy.states)}); use the same "
            "optimizer, or load_checkpoint(..., load_optimizer_states=False) to start its states afresh")
    for layout in engine.layouts:
        if not layout.trainable:
            continue
        unit = layout.name
        lo, hi = layout.shard_range(rank)
        steps = {int(reader.read_tensor(fmt.state_key(s.fqn, "step"))) for s in layout.slots
                 if reader.has(fmt.state_key(s.fqn, "step"))}
        for kind in policy.states:
            shard = _read_unit(reader, layout, lambda fqn, kind=kind: fmt.state_key(fqn, kind), lo, hi)
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


def _load_engine_state(engine, saved: dict[str, Any], *, optimizer: bool, scheduler: bool) -> None:
    control = engine.control
    control.global_steps = saved["global_steps"]
    control.micro_steps = saved["micro_steps"]
    control.skipped_steps = saved["skipped_steps"]
    control.grad_norm = saved["grad_norm"]
    if control.scaler is not None and saved["scaler"] is not None:
        for name, value in saved["scaler"].items():
            setattr(control.scaler, name, value)
    if optimizer:
        for group, values in zip(engine.optimizer.param_groups, saved["param_groups"]):
            group.update(values)
    if scheduler and control.lr_scheduler is not None and saved["lr_scheduler"] is not None:
        control.lr_scheduler.load_state_dict(saved["lr_scheduler"])


def _load_rank_state(engine, reader: CheckpointReader) -> None:
    same_world = reader.manifest["world_size"] == engine.world_size
    name = fmt.rank_file(engine.rank if same_world else 0)
    saved = reader.load_file(name)
    if same_world:
        rng = saved["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "numpy" in rng:
            import numpy as np
            np.random.set_state(rng["numpy"])
    loader = getattr(engine, "training_dataloader", None)
    if loader is not None and saved["dataloader"] is not None:
        loader.load_state_dict(saved["dataloader"])


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, *, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[Optional[str], Optional[dict]]:
    """See `Engine.load_checkpoint`."""
    rank = engine.rank
    if not load_module_strict:
        raise ValueError(f"[rank {rank}] load_checkpoint(load_module_strict=False): fxzero loads every tensor of the "
                         "model or none (the checkpoint must be of this model); drop the argument")
    error: Optional[str] = None
    failure: Optional[BaseException] = None
    path: Optional[str] = None
    client_state: Optional[dict] = None
    try:
        path = resolve_checkpoint(load_dir, tag)
        if path is not None:
            reader = CheckpointReader(path)  # (every file's size and the small files' checksums checked)
            _check_model(reader, engine)
            engine._failed_load = f"load_checkpoint({path!r}) failed part-way"
            engine.zero_grad()
            _load_params(engine, reader)
            client_state = {}
            if not load_module_only:
                if load_optimizer_states:
                    _load_optimizer(engine, reader)
                saved = reader.load_file(fmt.ENGINE)
                _load_engine_state(engine, saved, optimizer=load_optimizer_states, scheduler=load_lr_scheduler_states)
                _load_rank_state(engine, reader)
                client_state = saved["client_state"]
            persistent = set(engine.module.state_dict(keep_vars=True))
            for fqn in engine.state.buffers:
                if fqn in persistent and reader.has(fmt.param_key(fqn)):
                    engine.state.buffers[fqn] = reader.read_tensor(fmt.param_key(fqn)).clone()
            engine._failed_load = None
    except Exception as e:
        failure = e
        error = str(e) if str(e).startswith("[rank") else f"[rank {rank}] {type(e).__name__}: {e}"
    errors = engine.comm.all_gather_object(error)  # (every rank reports: a failure on one is an error on all)
    if failure is not None and not isinstance(failure, CheckpointError):
        raise failure
    for r, e in enumerate(errors):
        if e is not None:
            if path is not None:  # some rank may have replaced part of its states
                engine._failed_load = f"load_checkpoint({path!r}) failed on rank {r}: {e}"
            raise CheckpointError(e if r == rank else f"[rank {rank}] rank {r} could not load the checkpoint: {e}")
    if path is None:
        warnings.warn(f"[rank {rank}] load_checkpoint: no {os.path.join(load_dir, fmt.LATEST)} file, so no checkpoint "
                      "was loaded (returns (None, None)); pass tag= to load a particular one", stacklevel=3)
        return None, None
    return path, client_state

"""`engine.save_checkpoint`: every rank writes its shards, rank 0 the index and the manifest,
committed by renames ([Note: a checkpoint is committed by renames] in files.py).

In order, with one object all-gather between phases (so a rank that fails tells the others,
and a rank that died ends them within Config.collective_timeout, never a hang):

1. each rank checks the disk has room for the whole checkpoint; rank 0 names the temporary
   directory `<tag>.tmp-<nonce>` and removes those a killed save left behind;
2. each rank writes its chunks (`__<rank>_0.distcp`) and its own state (`rank<rank>_state.pt`),
   unit by unit: a unit's shards on a tier are read one at a time, never all of them at once;
3. rank 0 writes `.metadata`, `engine_state.pt` and `fxzero.json`, renames the directory to
   `<tag>` (a previous checkpoint of the same tag is moved aside first, then removed), and
   replaces `latest`.

Every file but `.metadata` (DCP's) holds only tensors and plain data, checked as it is written,
so it loads with `torch.load(weights_only=True)`; the user's own objects in `client_state` are
each pickled apart ([Note: loading runs no code] in safe_load.py).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import uuid
import warnings
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from fxzero.runtime.checkpoint import format as fmt
from fxzero.runtime.checkpoint.chunks import box_range, flat_boxes
from fxzero.runtime.checkpoint.files import CheckpointError, ChecksumWriter, fsync_dir, replace_file, space_error
from fxzero.runtime.checkpoint.safe_load import check_plain, pickled

__all__ = ["save_checkpoint"]

_TMP = ".tmp-"
_OLD = ".old-"


def _agree(comm, obj: Any, phase: str, tag: str) -> list:
    """Every rank's `obj`; a rank that never arrives is an error naming the phase."""
    try:
        return comm.all_gather_object(obj)
    except Exception as e:
        raise CheckpointError(f"[rank {comm.rank}] saving checkpoint {tag!r}: the other ranks did not reach {phase} "
                              f"within Config.collective_timeout (a rank died or failed there); nothing was "
                              f"committed, `latest` still names the previous checkpoint. {e}") from e


def _raise_first(statuses: list, rank: int, failure: Optional[BaseException] = None) -> None:
    """Raise the first rank's error on every rank (this rank's own unexpected exception as itself)."""
    if failure is not None and not isinstance(failure, (CheckpointError, OSError)):
        raise failure
    for r, status in enumerate(statuses):
        if status.get("error"):
            raise CheckpointError(status["error"] if r == rank else f"[rank {rank}] rank {r} failed: {status['error']}")


class _Chunks:
    """One rank's data file: tensors cut into boxes, each a torch.save blob, and where each went."""

    def __init__(self, path: str, relpath: str) -> None:
        self.writer = ChecksumWriter(path)
        self.relpath = relpath
        self.written: list[tuple] = []  # (key, offsets, sizes, offset, length, checksum)

    def tensor(self, key: str, shape: tuple, flat: torch.Tensor, start: int) -> None:
        """Elements [start, start + flat.numel()) of the tensor `key` of `shape`."""
        for offsets, sizes in flat_boxes(shape, start, start + flat.numel()):
            lo, hi = box_range(shape, offsets, sizes)
            piece = flat[lo - start : hi - start].clone().view(sizes)  # (a clone: torch.save writes whole storages)
            self._blob(key, offsets, sizes, _saved(piece))

    def bytes(self, key: str, obj: Any) -> None:
        self._blob(key, None, None, _saved(obj))

    def _blob(self, key, offsets, sizes, blob) -> None:
        offset, length, checksum = self.writer.append(blob)
        self.written.append((key, offsets, sizes, offset, length, checksum))


def _saved(obj: Any) -> memoryview:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


def _needed_bytes(engine) -> int:
    """About what the checkpoint takes on disk: every rank's shards of parameters and states."""
    states = len(engine.optimizer.policy.states)
    mine = sum(lay.shard_numel * lay.itemsize * (1 + (states if lay.trainable else 0)) for lay in engine.layouts)
    return mine * engine.world_size + sum(b.numel() * b.element_size() for b in engine.state.buffers.values())


def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
    """See `Engine.save_checkpoint`. Returns the checkpoint's directory."""
    rank, comm = engine.rank, engine.comm
    # ([Note: a checkpoint without the frozen parameters] in load.py)
    excluded = frozenset(fqn for fqn, p in engine.module.named_parameters()
                         if not p.requires_grad) if exclude_frozen_parameters else frozenset()
    control = engine.control
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"[rank {rank}] save_checkpoint(client_state=...) takes a dict (returned by load_checkpoint), "
                        f"got a {type(client_state).__name__}")
    # (gradients not yet applied are held until the boundary's step(); micro_steps counts step() calls, which
    # is not the accumulation's position when the caller sets the boundary: accelerate calls step() at them only)
    if engine.state.grads or engine._unreduced:
        counted = control.micro_steps % control.accumulation
        where = (f"micro-step {counted} of an accumulation of {control.accumulation}"
                 if control.boundary_override is None and counted else "a backward not yet followed by the boundary's step()")
        raise CheckpointError(
            f"[rank {rank}] save_checkpoint with gradients not yet applied ({where}) would lose "
            "them: a checkpoint holds no gradients, so save after the engine.step() that updates")
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if os.sep in tag or tag in ("", ".", "..") or tag == fmt.LATEST or _TMP in tag or _OLD in tag:
        raise CheckpointError(f"[rank {rank}] checkpoint tag {tag!r}: a tag names one directory in save_dir "
                              f"(no '/', not {fmt.LATEST!r}, not containing {_TMP!r} or {_OLD!r})")
    engine.state.settle_grads()
    if engine.store is not None:
        engine.store.drain()

    # 1. one tag (each rank's shard goes into the one checkpoint), room, the temporary directory's name
    tags = _agree(comm, tag, "the start of the save", tag)
    if len(set(tags)) > 1:
        differ = ", ".join(f"rank {r} {t!r}" for r, t in enumerate(tags))
        raise CheckpointError(f"[rank {rank}] save_checkpoint: the ranks passed different tags ({differ}); every rank "
                              "saves its shard into the one checkpoint, so pass the same tag on every rank (or none: "
                              f"global_step<N>); nothing was written (DeepSpeed's checkpoint.tag_validation)")
    status: dict[str, Any] = {}
    try:
        os.makedirs(save_dir, exist_ok=True)
        need, free = _needed_bytes(engine), shutil.disk_usage(save_dir).free
        if free < need:
            raise CheckpointError(f"[rank {rank}] not enough room in {save_dir} for checkpoint {tag!r}: about {need} "
                                  f"bytes needed, {free} free; free space or save elsewhere (nothing was written)")
        if rank == 0:
            _remove_leftovers(save_dir)
            status["tmp"] = os.path.join(save_dir, f"{tag}{_TMP}{uuid.uuid4().hex[:8]}")
            os.makedirs(status["tmp"])
    except Exception as e:
        status["error"] = str(e) if isinstance(e, CheckpointError) else f"[rank {rank}] {save_dir}: {e}"
    statuses = _agree(comm, status, "the start of the save", tag)
    _raise_first(statuses, rank)
    tmp = statuses[0]["tmp"]

    # 2. this rank's files
    status, failure = {}, None
    chunks = None
    try:
        chunks = _write_rank(engine, tmp, excluded)
        status = {"file": chunks.relpath, "size": chunks.writer.size, "checksum": chunks.writer.checksum,
                  "written": chunks.written, "rank_file": _write_rank_state(engine, tmp)}
    except Exception as e:
        if chunks is not None:
            chunks.writer.abort()
        status, failure = {"error": _write_error(e, rank, save_dir, tag)}, e
    statuses = _agree(comm, status, "the end of writing their shards", tag)
    if any(s.get("error") for s in statuses):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_first(statuses, rank, failure)

    # 3. rank 0 commits
    status, failure = {}, None
    final = os.path.join(save_dir, tag)
    if rank == 0:
        try:
            _commit(engine, tmp, final, tag, statuses, client_state, save_latest, excluded)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            status, failure = {"error": _write_error(e, rank, save_dir, tag)}, e
    _raise_first(_agree(comm, status, "the commit", tag), rank, failure)
    return final


def _write_error(e: BaseException, rank: int, save_dir: str, tag: str) -> str:
    if isinstance(e, CheckpointError):
        return str(e)
    if space_error(e):
        return (f"[rank {rank}] the disk holding {save_dir} filled while writing checkpoint {tag!r} ({e}); nothing "
                "was committed: `latest` still names the previous checkpoint, which is intact. Free space and save "
                "again")
    return f"[rank {rank}] writing checkpoint {tag!r} in {save_dir} failed ({type(e).__name__}: {e}); nothing was " \
           "committed: `latest` still names the previous checkpoint"


def _remove_leftovers(save_dir: str) -> None:
    """Temporary directories of saves that never committed (a rank killed while saving), and
    checkpoints moved aside for a tag saved again whose new directory is in place."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if not os.path.isdir(path):
            continue
        if _TMP in name:
            shutil.rmtree(path, ignore_errors=True)
            warnings.warn(f"removed {path}: an uncommitted checkpoint (a save was interrupted)", stacklevel=4)
        elif _OLD in name and os.path.isdir(os.path.join(save_dir, name.partition(_OLD)[0])):
            shutil.rmtree(path, ignore_errors=True)


# -- what each rank writes -----------------------------------------------------------------------

def _master_shard(engine, layout) -> torch.Tensor:
    """This rank's master shard of `layout`, in the masters' dtype (read from its tier when it
    lives on one)."""
    state = engine.state
    if layout.name in state.offloaded_params:
        return state.store.get("param", layout.name)
    values = state.params[layout.name]
    if state.master_is_whole(layout.name):
        lo, hi = layout.shard_range(engine.rank)
        return values[lo:hi]
    return values


def state_shard(engine, layout, kind: str) -> torch.Tensor:
    """This rank's shard of optimizer state `kind` (its initial value before the first update)."""
    state, policy = engine.state, engine.optimizer.policy
    dtype = state.state_dtype(layout.name)
    if state.store is not None and state.store.offloaded(kind):
        return state.store.fetch(kind, layout.name, layout.shard_numel, dtype).wait()
    held = state.optimizer_states.get(layout.name, {}).get(kind)
    return held if held is not None else torch.full((layout.shard_numel,), policy.initial_value(kind), dtype=dtype)


def _per_slot(layout, rank: int, shard: torch.Tensor, write: Callable[[str, tuple, torch.Tensor, int], None],
              excluded: frozenset = frozenset()) -> None:
    lo, hi = layout.shard_range(rank)
    for slot in layout.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b and slot.fqn not in excluded:
            # (a tile's elements are at its start in the whole parameter: [Note: tiling] in passes/tile.py)
            write(slot.fqn, slot.full_shape, shard[a - lo : b - lo], a - slot.offset + slot.start)


@torch.no_grad()
def _write_rank(engine, tmp: str, excluded: frozenset = frozenset()) -> _Chunks:
    rank, policy = engine.rank, engine.optimizer.policy
    relpath = fmt.data_file(rank)
    chunks = _Chunks(os.path.join(tmp, relpath), relpath)
    for layout in engine.layouts:  # one unit's shards in memory at a time
        if all(slot.fqn in excluded for slot in layout.slots):
            continue  # (nothing of it is saved: not even read from its tier)
        _per_slot(layout, rank, _master_shard(engine, layout),
                  lambda fqn, shape, flat, start: chunks.tensor(fmt.param_key(fqn), shape, flat, start), excluded)
        if not layout.trainable:
            continue
        for kind in policy.states:
            _per_slot(layout, rank, state_shard(engine, layout, kind),
                      lambda fqn, shape, flat, start, kind=kind: chunks.tensor(fmt.state_key(fqn, kind), shape, flat, start),
                      excluded)
    if rank == 0:
        persistent = set(engine.module.state_dict(keep_vars=True))
        for fqn, value in engine.state.buffers.items():
            if fqn in persistent:
                chunks.tensor(fmt.param_key(fqn), tuple(value.shape), value.reshape(-1), 0)
        for layout in engine.layouts:
            if layout.trainable:
                step = torch.tensor(float(engine.state.steps.get(layout.name, 0)))
                for slot in layout.slots:
                    if slot.start == 0 and slot.fqn not in excluded:  # (once for a tiled parameter)
                        chunks.tensor(fmt.state_key(slot.fqn, "step"), (), step.reshape(1), 0)
        groups = _param_groups(engine)
        try:
            check_plain(groups, "the optimizer's param_groups")
        except CheckpointError as e:
            raise CheckpointError(f"[rank {rank}] {e}; keep only such values in a param group") from None
        chunks.bytes(fmt.PARAM_GROUPS, groups)
    chunks.writer.close()
    return chunks


def _param_groups(engine) -> list[dict]:
    """The optimizer's groups as torch's FQN-keyed optimizer state dicts list them."""
    members: dict[int, list[str]] = {}
    for layout in engine.layouts:
        for slot in layout.slots:
            if layout.trainable and slot.start == 0:  # (once for a tiled parameter)
                members.setdefault(engine._group_of.get(slot.fqn, 0), []).append(slot.fqn)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": members.get(i, [])}
            for i, g in enumerate(engine.optimizer.param_groups)]


def _rng_states() -> dict[str, Any]:
    """Every generator's state as tensors and plain data: torch's and CUDA's are byte tensors,
    Python's a tuple of ints; NumPy's (legacy) tuple holds an array of its keys, saved as a list."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return out
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    out["numpy"] = (str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))
    return out


def _write_rank_state(engine, tmp: str) -> dict[str, Any]:
    loader = getattr(engine, "training_dataloader", None)
    state = {"rng": _rng_states(), "dataloader": loader.state_dict() if loader is not None else None}
    check_plain(state, fmt.rank_file(engine.rank))
    relpath = fmt.rank_file(engine.rank)
    writer = ChecksumWriter(os.path.join(tmp, relpath))
    writer.append(_saved(state))
    writer.close()
    return {"file": relpath, "size": writer.size, "checksum": writer.checksum}


# -- what rank 0 commits -------------------------------------------------------------------------

def _metadata(engine, statuses: list, path: str) -> Metadata:
    shapes: dict[str, tuple[tuple, torch.dtype, str]] = {}  # key -> (shape, dtype, fqn)
    for layout in engine.layouts:
        for slot in layout.slots:
            shapes[fmt.param_key(slot.fqn)] = (slot.full_shape, layout.dtype, slot.fqn)
            if layout.trainable:
                for kind in engine.optimizer.policy.states:
                    shapes[fmt.state_key(slot.fqn, kind)] = (slot.full_shape, engine.state.state_dtype(layout.name),
                                                             slot.fqn)
                shapes[fmt.state_key(slot.fqn, "step")] = ((), torch.float32, slot.fqn)
    for fqn, value in engine.state.buffers.items():
        shapes[fmt.param_key(fqn)] = (tuple(value.shape), value.dtype, fqn)
    boxes: dict[str, list[ChunkStorageMetadata]] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for status in statuses:
        for key, offsets, sizes, offset, length, _ in status["written"]:
            info = _StorageInfo(status["file"], offset, length)
            if offsets is None:
                storage[MetadataIndex(key)] = info
                continue
            boxes.setdefault(key, []).append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(key, torch.Size(offsets))] = info
    tensors: dict[str, Any] = {
        key: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), boxes[key])
        for key, (shape, dtype, _) in shapes.items() if key in boxes
    }
    tensors[fmt.PARAM_GROUPS] = BytesStorageMetadata()
    planner = {key: fmt.planner_path(key, fqn) for key, (_, _, fqn) in shapes.items() if key in boxes}
    planner[fmt.PARAM_GROUPS] = fmt.planner_path(fmt.PARAM_GROUPS, "")
    return Metadata(tensors, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=path, save_id=uuid.uuid4().hex), version=CURRENT_DCP_VERSION)


def _engine_state(engine, client_state: Optional[dict]) -> dict[str, Any]:
    """The step counters and the loss scaler as plain data; the LR scheduler's state and each
    `client_state` entry, which may hold the user's own objects, each pickled apart (a uint8
    tensor; `safe_load.unpickled` reads them). The param groups are the DCP item `optim.param_groups`."""
    control = engine.control
    scaler = control.scaler
    scheduler = control.lr_scheduler
    state = {
        "global_steps": control.global_steps, "micro_steps": control.micro_steps,
        "skipped_steps": control.skipped_steps, "grad_norm": control.grad_norm,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "lr_scheduler": _pickled(scheduler.state_dict(), "the LR scheduler's state") if scheduler is not None else None,
        "random_ltd": engine.random_ltd_scheduler.state_dict() if engine.random_ltd_enabled() else None,
        "client_state": [[repr(key), _pickled((key, value), f"client_state[{key!r}]")]
                         for key, value in (client_state or {}).items()],
    }
    check_plain(state, fmt.ENGINE)
    return state


def _pickled(obj: Any, what: str):
    try:
        return pickled(obj)
    except Exception as e:
        raise CheckpointError(f"[rank 0] {what} cannot be saved: torch.save of it fails ({type(e).__name__}: {e})") from e


def _commit(engine, tmp: str, final: str, tag: str, statuses: list, client_state, save_latest: bool,
            excluded: frozenset = frozenset()) -> None:
    files: dict[str, dict] = {}
    chunk_sums: dict[str, str] = {}
    for status in statuses:
        files[status["file"]] = {"bytes": status["size"], "xxh3": status["checksum"]}
        rank_file = status["rank_file"]
        files[rank_file["file"]] = {"bytes": rank_file["size"], "xxh3": rank_file["checksum"]}
        for *_, offset, _, checksum in status["written"]:
            chunk_sums[f"{status['file']}@{offset}"] = checksum
    for name, blob in ((fmt.ENGINE, _saved(_engine_state(engine, client_state))),
                       (fmt.METADATA, pickle.dumps(_metadata(engine, statuses, final)))):
        writer = ChecksumWriter(os.path.join(tmp, name))
        writer.append(blob)
        writer.close()
        files[name] = {"bytes": writer.size, "xxh3": writer.checksum}
    config, mp = engine.config, engine.config.mixed_precision
    tensors = fmt.model_tensors(engine.module, engine.layouts)
    manifest = {
        "format": fmt.FORMAT, "version": fmt.VERSION, "tag": tag, "torch": torch.__version__,
        "world_size": engine.world_size, "stage": config.stage,
        "optimizer": type(engine.optimizer.policy).__name__, "states": list(engine.optimizer.policy.states),
        "mixed_precision": str(mp.param_dtype).removeprefix("torch.") if mp is not None else None,
        "global_steps": engine.global_steps,
        "model_class": f"{type(engine.module).__module__}.{type(engine.module).__qualname__}",
        "hf_config": fmt.hf_config(engine.module),
        "fingerprint": fmt.fingerprint(tensors), "tensors": tensors,
        "excluded_frozen": sorted(excluded),
        "units": [layout.to_json() for layout in engine.layouts],
        "files": files, "chunks": chunk_sums,
    }
    replace_file(os.path.join(tmp, fmt.MANIFEST), json.dumps(manifest, indent=1, default=str).encode())
    fsync_dir(tmp)
    save_dir = os.path.dirname(final)
    old = None
    if os.path.exists(final):  # the same tag again: the previous one moves aside until the new one is in
        old = f"{final}{_OLD}{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    if save_latest:
        replace_file(os.path.join(save_dir, fmt.LATEST), tag.encode())
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

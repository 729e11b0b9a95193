"""Exporting a model for inference: one consolidated state dict with the model's own FQNs.

Two ways, as DeepSpeed has them:

- `export_checkpoint(path, out_dir)` (and `fxzero export CKPT OUT`), offline from a saved
  checkpoint, no ranks: `out_dir/model.safetensors` with the fp32 masters (or cast to `dtype`),
  and `out_dir/config.json` when the model is a Hugging Face one, so
  `transformers.<Class>.from_pretrained(out_dir)` loads it. DeepSpeed's `zero_to_fp32.py`.
- `save_16bit_model(engine, save_dir)`, from a live engine, a collective: the parameters in
  the engine's compute dtype, gathered unit by unit, written by rank 0. DeepSpeed's
  `engine.save_16bit_model`.

Both write the state dict a model's `state_dict()` gives, less its aliases: a tied parameter
once, under its first name (safetensors refuses two names for one tensor; Hugging Face re-ties
on load, `safetensors.torch.load_model` fills the alias), then the persistent buffers.

Memory: a safetensors file is streamed ([Note: why we write safetensors ourselves] in
`safetensors_stream.py`): the header first, from the manifest or the unit layouts, then each
tensor as it is read or gathered, so an export holds about one tensor (one unit, for
`save_16bit_model`). A `.bin` file is one `torch.save` of the whole dict, as DeepSpeed writes
it, so rank 0 then holds the whole model in memory.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import torch

from fxzero.runtime.checkpoint import format as fmt
from fxzero.runtime.checkpoint.files import CheckpointError, replace_file
from fxzero.runtime.checkpoint.load import resolve_checkpoint
from fxzero.runtime.checkpoint.reader import CheckpointReader
from fxzero.runtime.checkpoint.safetensors_stream import Entry, SafetensorsWriter

__all__ = ["DTYPES", "HF_CONFIG", "SAFETENSORS", "consolidated_16bit_state_dict", "export_checkpoint",
           "save_16bit_model"]

SAFETENSORS = "model.safetensors"
HF_CONFIG = "config.json"
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""What `fxzero export --dtype` names."""

_HF_METADATA = {"format": "pt"}  # transformers checks a safetensors file says it holds torch tensors


def _cast_to(saved: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a tensor is exported in: `dtype` for floating tensors, else as saved."""
    return dtype if dtype is not None and saved.is_floating_point else saved


def _checkpoint_dir(path: str, tag: Optional[str]) -> str:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory (give a checkpoint directory, or the save_dir holding one)")
    if tag is None and os.path.exists(os.path.join(path, fmt.MANIFEST)):
        return path
    resolved = resolve_checkpoint(path, tag)
    if resolved is None:
        raise CheckpointError(f"{path}: not a checkpoint (no {fmt.MANIFEST}) and no {fmt.LATEST!r} file names one; "
                              "give a checkpoint directory, or its save_dir with a tag")
    return resolved


def _hf_config(manifest: dict, dtype: Optional[torch.dtype]) -> Optional[dict]:
    """The manifest's HF config, as `save_pretrained` would write it for this export."""
    config = manifest.get("hf_config")
    if config is None:
        return None
    config = dict(config)
    if not config.get("architectures"):  # save_pretrained records the class; AutoModel reads it
        config["architectures"] = [manifest["model_class"].rsplit(".", 1)[-1]]
    if dtype is not None:
        for key in ("dtype", "torch_dtype"):  # (transformers 5 names it dtype, 4 torch_dtype)
            if key in config:
                config[key] = str(dtype).removeprefix("torch.")
    return config


@torch.no_grad()
def export_checkpoint(path: str, out_dir: str, *, tag: Optional[str] = None,
                      dtype: Optional[torch.dtype] = None) -> dict[str, Any]:
    """Write a checkpoint's model as `out_dir/model.safetensors` (and `config.json` for an HF model).

    Reads one tensor at a time, so it needs about one tensor's memory (a few times its bytes),
    never the model's. No process group is needed.

    Args:
        path: a checkpoint directory (holding fxzero.json), or a save_dir whose `latest` (or
            `tag`) names one.
        out_dir: where to write; created if missing. Files already there are replaced.
        tag: the checkpoint in save_dir `path` (default: the one `latest` names).
        dtype: cast floating tensors to it (e.g. torch.bfloat16); default: as saved (fp32).

    Returns:
        {"checkpoint", "files": {path: bytes}, "tensors", "bytes" (of model.safetensors),
        "dtype" (the cast, or "as saved"), "seconds"}.

    Raises:
        CheckpointError: the checkpoint is missing, incomplete or damaged; the message names the
            file (nothing is left under the export's name then).
    """
    start = time.monotonic()
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"export dtype {dtype}: cast only to a floating dtype ({sorted(DTYPES)})")
    ckpt = _checkpoint_dir(path, tag)
    reader = CheckpointReader(ckpt, cache_blobs=0)  # each chunk is read once: nothing to cache
    excluded = reader.manifest.get("excluded_frozen", [])
    if excluded:  # ([Note: a checkpoint without the frozen parameters] in load.py)
        raise CheckpointError(f"{os.path.join(ckpt, fmt.MANIFEST)}: saved with exclude_frozen_parameters=True, it "
                              f"holds no value of the {len(excluded)} frozen parameters ({', '.join(excluded[:3])}"
                              f"{', ...' * (len(excluded) > 3)}), so it is not a whole model to export; export a "
                              "checkpoint saved without it, or save the model from the engine (save_16bit_model)")
    entries = []
    for fqn, shape, saved in reader.manifest["tensors"]:
        key = fmt.param_key(fqn)
        if reader.shape(key) != tuple(shape) or reader.dtype(key) != fmt.dtype_of(saved):
            held = f"{reader.dtype(key)} {list(reader.shape(key))}" if reader.has(key) else "missing"
            raise CheckpointError(f"{os.path.join(ckpt, fmt.METADATA)}: {key!r} is {held}, the manifest says "
                                  f"{saved} {shape}; the checkpoint is damaged")
        entries.append(Entry(fqn, _cast_to(fmt.dtype_of(saved), dtype), tuple(shape)))

    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, SAFETENSORS)
    with SafetensorsWriter(target, entries, _HF_METADATA) as writer:
        for entry in entries:  # [Note: why we write safetensors ourselves]
            writer.write(entry.name, reader.read_tensor(fmt.param_key(entry.name)).to(entry.dtype))
            # (the tensor read is dropped here, before the next is read)
    files = {target: writer.size}
    config = _hf_config(reader.manifest, dtype)
    if config is not None:
        config_path = os.path.join(out_dir, HF_CONFIG)
        replace_file(config_path, json.dumps(config, indent=2, sort_keys=True).encode() + b"\n")
        files[config_path] = os.path.getsize(config_path)
    return {"checkpoint": ckpt, "files": files, "tensors": len(entries), "bytes": writer.size,
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "as saved",
            "seconds": time.monotonic() - start}


# -- from a live engine ---------------------------------------------------------------------------

def _gathered(engine, layout, dtype: torch.dtype) -> torch.Tensor:
    """`layout`'s full flat buffer in `dtype` (a collective: every rank gathers it)."""
    state = engine.state
    if state.master_is_whole(layout.name):
        return state.params[layout.name].to(dtype)
    if layout.name in state.offloaded_params:
        shard = state.store.get("param", layout.name)
    else:
        shard = state.params[layout.name]
    flat = torch.empty(layout.padded_numel, dtype=dtype)
    engine.comm.all_gather(flat, shard.to(dtype), count=False).wait()  # (cast first: half the bytes in 16 bits)
    return flat


class _Collect:
    """The in-memory sink: the whole dict, in the model's order."""

    def __init__(self, order: list[str]) -> None:
        self._order, self._values = order, {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._values[name] = tensor.clone()  # (a clone: a view would keep its unit's whole buffer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self._values[name] for name in self._order}

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self._values.clear()


class _TorchSave(_Collect):
    """The `.bin` sink: the whole dict, then one torch.save (DeepSpeed's format)."""

    def __init__(self, path: str, order: list[str]) -> None:
        super().__init__(order)
        self.path = path

    def close(self) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, self.path)


@torch.no_grad()
def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> Optional[str]:
    """See `Engine.save_16bit_model`: the model in its compute dtype, as one file on rank 0.

    A collective: every rank calls it. Each unit's flat buffer is all-gathered in the engine's
    compute dtype (`Config.mixed_precision.param_dtype` under mixed precision, else the dtype
    the parameters are stored in), one unit at a time, and rank 0 writes its parameters; then
    the model's persistent buffers, in their own dtype. A tied parameter is written once.

    `save_filename` ending in ".safetensors" streams a safetensors file (rank 0 holds one
    unit); any other name is one `torch.save` of the dict, as DeepSpeed writes it, which holds
    the whole model in rank 0's memory first.

    Args:
        engine: the engine to save.
        save_dir: the directory to write into (created if missing).
        save_filename: the file's name.
        exclude_frozen_parameters: leave out parameters with requires_grad=False.

    Returns:
        The file's path on rank 0, None on the other ranks.
    """
    path = os.path.join(save_dir, save_filename)

    def open_sink(entries: list[Entry], order: list[str]):
        os.makedirs(save_dir, exist_ok=True)
        return SafetensorsWriter(path, entries, _HF_METADATA) if save_filename.endswith(".safetensors") \
            else _TorchSave(path, order)

    _gather_16bit(engine, open_sink, exclude_frozen_parameters, f"save_16bit_model: rank 0 could not write {path}")
    return path if engine.rank == 0 else None


@torch.no_grad()
def consolidated_16bit_state_dict(engine, exclude_frozen_parameters: bool = False
                                  ) -> Optional[dict[str, torch.Tensor]]:
    """What `save_16bit_model` writes, as a dict on rank 0 (None on the other ranks): DeepSpeed's
    `engine._zero3_consolidated_16bit_state_dict()`, which accelerate and Hugging Face's Trainer
    save. A collective; rank 0 holds the whole model in its compute dtype."""
    sink = _gather_16bit(engine, lambda entries, order: _Collect(order), exclude_frozen_parameters,
                         "the consolidated state dict: rank 0 could not hold it")
    return sink.state_dict() if sink is not None else None


def _gather_16bit(engine, open_sink, exclude_frozen_parameters: bool, what: str):
    """Every unit gathered in the compute dtype, one at a time, its parameters written by rank 0
    into `open_sink(entries, order)`'s sink, then the persistent buffers. Returns the closed sink
    on rank 0, None elsewhere; a failure on rank 0 is raised on every rank."""
    rank, state, module = engine.rank, engine.state, engine.module
    mp = engine.config.mixed_precision
    layouts = [lay for lay in engine.layouts if lay.trainable or not exclude_frozen_parameters]
    compute = {lay.name: mp.param_dtype if mp is not None else lay.dtype for lay in layouts}
    persistent = set(module.state_dict(keep_vars=True))
    buffers = {fqn: b for fqn, b in state.buffers.items() if fqn in persistent}
    declared = {slot.fqn: Entry(slot.fqn, compute[lay.name], tuple(slot.full_shape)) for lay in layouts
                for slot in lay.slots}
    declared.update({fqn: Entry(fqn, b.dtype, tuple(b.shape)) for fqn, b in buffers.items()})
    order = [fqn for fqn, _, _ in fmt.model_tensors(module, engine.layouts) if fqn in declared]  # the model's order

    failure: Optional[BaseException] = None
    sink = None
    if rank == 0:
        try:
            sink = open_sink([declared[f] for f in order], order)
        except Exception as e:
            failure = e
    tiled: dict[str, torch.Tensor] = {}  # a tiled parameter assembled from its tiles, written when whole
    for layout in layouts:  # every rank gathers every unit, even after rank 0 failed: no rank waits alone
        flat = _gathered(engine, layout, compute[layout.name])
        if sink is not None and failure is None:
            try:
                for slot in layout.slots:
                    if slot.param_shape is None:
                        sink.write(slot.fqn, flat[slot.offset : slot.offset + slot.numel].view(slot.shape))
                    elif slot.start + slot.numel == slot.read_into(flat, tiled).numel():  # (its last tile)
                        sink.write(slot.fqn, tiled.pop(slot.fqn))
            except Exception as e:
                failure = e
        del flat
    if sink is not None and failure is None:
        try:
            for fqn, value in buffers.items():
                sink.write(fqn, value)
            sink.close()
        except Exception as e:
            failure = e
    if sink is not None and failure is not None:
        sink.abort()
    errors = engine.comm.all_gather_object(f"{type(failure).__name__}: {failure}" if failure else None)
    if failure is not None:
        raise failure
    if errors[0] is not None:
        raise RuntimeError(f"[rank {rank}] {what} ({errors[0]})")
    return sink

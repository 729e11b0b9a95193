"""What a checkpoint directory holds, and the names inside it.

[Note: the checkpoint format]
A checkpoint is a directory `<save_dir>/<tag>/` in the format of torch.distributed.checkpoint
(DCP), so torch's own tools read it (`dcp_to_torch_save`, `dcp.load`), plus fxzero's manifest:

    .metadata            DCP's index (a pickled `Metadata`): every tensor's shape, dtype and
                         chunks, and where each chunk's bytes are
    __<rank>_0.distcp    rank <rank>'s chunks, each a `torch.save` blob as DCP writes them
    rank<rank>_state.pt  rank <rank>'s RNG states and data loader position
    engine_state.pt      the step counters, loss scaler, LR scheduler, client_state
    fxzero.json          the manifest: world size, stage, optimizer, the model's fingerprint and
                         tensor list, the unit layouts, and a checksum of every file and chunk

The state dict it holds is the one torch's `get_state_dict` gives a DDP or FSDP model, with the
model's own FQNs (a tied parameter once, under its first name):

    model.<fqn>                  master parameters (fp32, or MixedPrecision.master_dtype's), and
                                 the model's persistent buffers
    optim.state.<fqn>.<state>    the optimizer's per-element states (exp_avg, exp_avg_sq; sum), in
                                 their dtype (MixedPrecision.optimizer_dtype's)
    optim.state.<fqn>.step       the parameter's step count (a 0-d float32, as torch.optim's)
    optim.param_groups           the groups' hyperparameters, "params" listing FQNs

Each rank writes the part of each tensor in its shard: a flat range of the parameter, which is
up to a few boxes (`chunks.py`), so a checkpoint saved on N ranks loads on any M by reading the
ranges each new shard needs, and at any stage (a unit held whole reads all of its range).
Every file loads without running code from it ([Note: loading runs no code] in `safe_load.py`).
The low-precision copies of mixed precision are not saved: they are the masters rounded
(`_split_masters` in `fxzero/api.py`; the step program rounds the same way), so they are
recomputed on load, exactly. A checkpoint loads into a run whose masters or states are in
another floating dtype, cast as it loads (rounded, with a warning, when narrowed).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn as nn


def xxh3():
    """An incremental XXH3-64, the checksum every checkpoint file and chunk carries."""
    try:
        import xxhash
    except ImportError as e:  # (imported here: fxzero itself runs without it, e.g. on a GPU machine's Python)
        raise ImportError("fxzero's checkpoints carry XXH3 checksums, computed with the xxhash package: "
                          "pip install xxhash") from e
    return xxhash.xxh3_64()


def xxh3_hexdigest(data) -> str:
    digest = xxh3()
    digest.update(data)
    return digest.hexdigest()

__all__ = ["ENGINE", "FORMAT", "LATEST", "MANIFEST", "METADATA", "PARAM_GROUPS", "VERSION", "data_file",
           "fingerprint", "model_tensors", "param_key", "planner_path", "rank_file", "state_key"]

FORMAT = "fxzero-checkpoint"
VERSION = 2
"""2: the state files hold only tensors and plain data (1 pickled Python objects there)."""
MANIFEST = "fxzero.json"
METADATA = ".metadata"
ENGINE = "engine_state.pt"
LATEST = "latest"
PARAM_GROUPS = "optim.param_groups"


def data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def rank_file(rank: int) -> str:
    return f"rank{rank}_state.pt"


def param_key(fqn: str) -> str:
    return f"model.{fqn}"


def state_key(fqn: str, state: str) -> str:
    return f"optim.state.{fqn}.{state}"


def planner_path(key: str, fqn: str) -> tuple[str, ...]:
    """Where DCP's unflattening puts `key` (`Metadata.planner_data`): FQNs hold dots themselves."""
    if key.startswith("model."):
        return ("model", fqn)
    if key == PARAM_GROUPS:
        return ("optim", "param_groups")
    state = key.removeprefix(f"optim.state.{fqn}.")
    return ("optim", "state", fqn, state)


def model_tensors(model: nn.Module, layouts) -> list[tuple[str, list[int], str]]:
    """(FQN, shape, dtype) of the model's parameters (each once, in the dtype of its unit's
    layout: the model as built, whatever dtype its module holds while training) and persistent
    buffers."""
    keys = set(model.state_dict(keep_vars=True))
    dtype = {slot.fqn: layout.dtype for layout in layouts for slot in layout.slots}
    out = [(f, list(p.shape), str(dtype.get(f, p.dtype)).removeprefix("torch."))
           for f, p in model.named_parameters()]
    out += [(f, list(b.shape), str(b.dtype).removeprefix("torch.")) for f, b in model.named_buffers() if f in keys]
    return out


def fingerprint(tensors: list) -> str:
    """XXH3-64 of the model's tensor list: two models with the same FQNs, shapes and dtypes match."""
    return xxh3_hexdigest(json.dumps([list(t) for t in tensors]).encode())


def hf_config(model: nn.Module) -> Any:
    """An HF model's config as a dict (written beside an export as config.json), else None."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict) and hasattr(model, "save_pretrained"):
        return to_dict()
    return None


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)

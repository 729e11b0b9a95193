"""A DeepSpeed config (dict or JSON file) read as the fields of a `fxzero.Config`.

`Config.from_deepspeed(ds)` is `Config(**config_fields(ds))`; this module does not import
`Config`, so the two do not import each other.
"""

from __future__ import annotations

import json
import os
from typing import Any, Union

from fxzero.config.placement import Cpu, Device, Nvme, Offload, Placement
from fxzero.config.policies import AdamW, Prefetch

__all__ = ["config_fields"]


def _placement_from_deepspeed(section: dict[str, Any], key: str) -> Placement:
    device = str(section.get("device", "none")).lower()
    if device in ("none", ""):
        return Device()
    if device == "cpu":
        return Cpu(pin_memory=bool(section.get("pin_memory", True)))
    if device == "nvme":
        if not section.get("nvme_path"):
            raise ValueError(f'zero_optimization.{key}: device "nvme" needs "nvme_path" (a directory on the disk)')
        return Nvme(path=section["nvme_path"], threads=int(section.get("buffer_count", 4)))
    raise ValueError(f'zero_optimization.{key}.device must be "none", "cpu" or "nvme", got {device!r}')


def config_fields(ds: Union[dict[str, Any], str, os.PathLike]) -> dict[str, Any]:
    """The `Config` fields a DeepSpeed config dict or JSON file sets (the keys fxzero understands)."""
    if not isinstance(ds, dict):
        with open(ds) as f:
            ds = json.load(f)
    stage = int(ds.get("zero_optimization", {}).get("stage", 3))
    opt = ds.get("optimizer", {})
    if opt and opt.get("type", "AdamW").lower() not in ("adam", "adamw"):
        raise ValueError(
            f"optimizer type {opt.get('type')!r} is not supported; fxzero runs AdamW "
            "(set \"optimizer\": {\"type\": \"AdamW\", ...})"
        )
    params = opt.get("params", {})
    adamw = AdamW(
        lr=float(params.get("lr", 1e-3)),
        betas=tuple(params.get("betas", (0.9, 0.999))),
        eps=float(params.get("eps", 1e-8)),
        weight_decay=float(params.get("weight_decay", 1e-2)),
    )
    zero = ds.get("zero_optimization", {})
    threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if stage == 3 else 0
    # A reuse distance of 0 releases every parameter after use: gather each unit twice.
    prefetch = Prefetch(keep_for_backward=None if int(zero.get("stage3_max_reuse_distance", 1)) > 0 else False)
    offload = Offload(
        params=_placement_from_deepspeed(zero.get("offload_param", {}), "offload_param"),
        optimizer=_placement_from_deepspeed(zero.get("offload_optimizer", {}), "offload_optimizer"),
    )
    return dict(stage=stage, optimizer=adamw, persist_threshold=threshold, offload=offload, prefetch=prefetch)

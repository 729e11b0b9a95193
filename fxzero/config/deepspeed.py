"""A DeepSpeed config (dict or JSON file) read as the fields of a `fxzero.Config`.

`Config.from_deepspeed(ds)` is `Config(**config_fields(ds))`; this module does not import
`Config`, so the two do not import each other.
"""

from __future__ import annotations

import json
import os
from typing import Any, Union

from fxzero.config.placement import Cpu, Device, Nvme, Offload, Placement
import torch

from fxzero.config.policies import AdamW, Prefetch
from fxzero.config.precision import LossScale, MixedPrecision

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


_COMM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": None, "float16": None, "bf16": None,
                "bfloat16": None}


def _mixed_precision_from_deepspeed(ds: dict[str, Any]) -> "MixedPrecision | None":
    """"bf16" (or "bfloat16") / "fp16" sections -> MixedPrecision; both enabled is an error.

    Gradients are reduced in fp32 unless "communication_data_type" names the low-precision type.
    """
    bf16 = dict(ds.get("bf16") or ds.get("bfloat16") or {})
    fp16 = dict(ds.get("fp16") or {})
    on_bf16, on_fp16 = bool(bf16.get("enabled", False)), bool(fp16.get("enabled", False))
    if on_bf16 and on_fp16:
        raise ValueError('"bf16" and "fp16" are both enabled; enable one of them (bf16 needs no loss scaling)')
    if not (on_bf16 or on_fp16):
        return None
    comm = str(ds.get("communication_data_type", "fp32")).lower()
    if comm not in _COMM_DTYPES:
        raise ValueError(f'"communication_data_type" must be one of {sorted(_COMM_DTYPES)}, got {comm!r}')
    reduce_dtype = _COMM_DTYPES[comm]
    if on_bf16:
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    static = float(fp16.get("loss_scale", 0))
    scale = LossScale(
        initial_scale_power=int(fp16.get("initial_scale_power", 16)),
        window=int(fp16.get("loss_scale_window", 1000)),
        hysteresis=int(fp16.get("hysteresis", 2)),
        min_scale=float(fp16.get("min_loss_scale", 1)),
        static=static if static > 0 else None,
    )
    return MixedPrecision(param_dtype=torch.float16, reduce_dtype=reduce_dtype, loss_scale=scale)


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
    return dict(stage=stage, optimizer=adamw, persist_threshold=threshold, offload=offload, prefetch=prefetch,
                mixed_precision=_mixed_precision_from_deepspeed(ds))

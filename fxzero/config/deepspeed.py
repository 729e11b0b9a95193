"""A DeepSpeed config (dict or JSON file) read strictly, as the fields of a `fxzero.Config`.

Every key is looked up in the key table (`fxzero/config/deepspeed_keys.py`): a key that sets
what fxzero does is read into its field; one that changes nothing in fxzero is named in one
warning with the reason; one fxzero does not have, set to a value that would change training,
is an error; a key DeepSpeed does not have either is an error naming the nearest one. A missing
key takes DeepSpeed's default (so `stage3_param_persistence_threshold` is 100000 unless given).

`Config.from_deepspeed(ds)` is `Config(**read_deepspeed(ds).fields)`; this module does not import
`Config`, so the two do not import each other.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, NamedTuple, Union

import torch

from fxzero.config.deepspeed_keys import KEYS, NO_EFFECT, OPTIMIZER_PARAMS, SECTION, UNSUPPORTED, Key
from fxzero.config.placement import Cpu, Device, Nvme, Offload, Placement
from fxzero.config.policies import Adagrad, Adam, AdamW, OptimizerPolicy, Prefetch
from fxzero.config.precision import LossScale, MixedPrecision
from fxzero.config.schedules import schedule_from_deepspeed

__all__ = ["DeepSpeedReading", "read_deepspeed"]

_ALIASES = {"bfloat16": "bf16"}
_DEFAULT_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold
_COMM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": None, "float16": None, "bf16": None,
                "bfloat16": None}


class DeepSpeedReading(NamedTuple):
    fields: dict[str, Any]
    """`Config` keyword arguments."""
    ineffective: list[str]
    """One message per key that changes nothing in fxzero, for the one-time warning."""
    resolved: list[str]
    """One line per "auto" value resolved here, to print once."""


class _Reader:
    def __init__(self) -> None:
        self.ineffective: list[str] = []
        self.resolved: list[str] = []

    def walk(self, section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """The section with every key checked against the table, "auto" resolved; sub-sections
        walked likewise (except the optimizer's and scheduler's params, read by their type)."""
        out = {}
        for raw, value in section.items():
            name = _ALIASES.get(raw, raw) if not prefix else raw
            path = prefix + name
            key = KEYS.get(path)
            if key is None:
                raise ValueError(f"DeepSpeed config: unknown key {prefix + raw!r}{_nearest(prefix, raw)}")
            if isinstance(value, str) and value == "auto" and not key.honours(value):
                value = self._auto(path, key)
            if key.kind == SECTION and path != "optimizer.params":
                if not isinstance(value, dict):
                    raise ValueError(f"DeepSpeed config: {path!r} must be an object, got {value!r}")
                value = self.walk(value, path + ".")
            elif key.kind == NO_EFFECT:
                self.ineffective.append(f"DeepSpeed config key {path!r} has no effect in fxzero: {key.why}")
            elif key.kind == UNSUPPORTED and not key.honours(value):
                raise ValueError(f"DeepSpeed config: {path}={json.dumps(value)} is not supported by fxzero: "
                                 f"{key.why}; remove the key")
            out[name] = value
        return out

    def _auto(self, path: str, key: Key) -> Any:
        if not key.has_auto:
            raise ValueError(
                f'DeepSpeed config: {path} is "auto": a trainer (such as Hugging Face\'s) fills that in before '
                "DeepSpeed reads it, and fxzero has no trainer to supply it; give a value")
        if key.auto is None:
            self.resolved.append(f'{path}: "auto" -> implied by the other batch sizes and the world size')
        else:
            self.resolved.append(f'{path}: "auto" -> {key.auto} (DeepSpeed\'s default)')
        return key.auto


def _nearest(prefix: str, raw: str) -> str:
    siblings = [k[len(prefix):] for k in KEYS if k.startswith(prefix) and "." not in k[len(prefix):]]
    near = difflib.get_close_matches(raw, siblings, n=1, cutoff=0.6)
    where = f"in {prefix[:-1]!r}" if prefix else "at the top level"
    return f"; did you mean {near[0]!r}?" if near else f" {where} (see docs/deepspeed_config.md for every key)"


def _placement(section: dict[str, Any], key: str) -> Placement:
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


def _offload(zero: dict[str, Any]) -> Offload:
    param, opt = dict(zero.get("offload_param") or {}), dict(zero.get("offload_optimizer") or {})
    pin = zero.get("cpu_offload_use_pin_memory")
    for deprecated, section in (("cpu_offload_param", param), ("cpu_offload", opt)):
        if zero.get(deprecated):
            if section.get("device", "none") not in ("none", "cpu"):
                raise ValueError(f"zero_optimization.{deprecated} is true and says cpu, but its section says "
                                 f"{section['device']!r}: keep one of them")
            section["device"] = "cpu"
            if pin is not None:
                section.setdefault("pin_memory", bool(pin))
    return Offload(params=_placement(param, "offload_param"), optimizer=_placement(opt, "offload_optimizer"))


def _optimizer(section: dict[str, Any]) -> OptimizerPolicy:
    kind = str(section.get("type", "AdamW"))
    name = "adam" if kind.lower() in ("adam", "adamw") else kind.lower()
    table = OPTIMIZER_PARAMS.get(name)
    if table is None:
        raise ValueError(f"DeepSpeed config: optimizer type {kind!r} is not supported; fxzero runs \"AdamW\" and "
                         "\"Adam\" (with \"adam_w_mode\": false for L2 weight decay), and \"Adagrad\"")
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"DeepSpeed config: optimizer.params must be an object, got {params!r}")
    for param, value in params.items():
        key = table.get(param)
        if key is None:
            near = difflib.get_close_matches(param, list(table), n=1)
            hint = (f"; did you mean {near[0]!r}?" if near else f"; {kind} takes {', '.join(table)}")
            if param == "max_grad_norm":
                hint = '; clip with the top-level "gradient_clipping" key'
            raise ValueError(f"DeepSpeed config: optimizer.params has no {param!r} for {kind}{hint}")
        if value == "auto":
            raise ValueError(f'DeepSpeed config: optimizer.params.{param} is "auto": a trainer (such as Hugging '
                             "Face's) fills that in before DeepSpeed reads it, and fxzero has no trainer to supply "
                             "it; give a value")
        if key.kind == NO_EFFECT:
            continue  # (named by the caller's warning below)
        if key.kind == UNSUPPORTED and not key.honours(value):
            raise ValueError(f"DeepSpeed config: optimizer.params.{param}={json.dumps(value)} is not supported by "
                             f"fxzero: {key.why}; remove it")
    if name == "adagrad":  # torch.optim.Adagrad, as DeepSpeed builds it (DeepSpeedCPUAdagrad when offloaded)
        return Adagrad(**{k: float(params[k]) for k in table if k in params})
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (its FusedAdam's default).
    decoupled = kind.lower() == "adamw" or bool(params.get("adam_w_mode", True))
    cls = AdamW if decoupled else Adam
    hyper = {k: params[k] for k in ("lr", "eps", "weight_decay") if k in params}
    if "betas" in params:
        hyper["betas"] = tuple(params["betas"])
    return cls(**{k: float(v) if k != "betas" else v for k, v in hyper.items()})


def _mixed_precision(ds: dict[str, Any]) -> "MixedPrecision | None":
    """"bf16" / "fp16" sections -> MixedPrecision; both enabled is an error. Gradients are
    reduced in fp32 unless "communication_data_type" names the low-precision type."""
    bf16, fp16 = dict(ds.get("bf16") or {}), dict(ds.get("fp16") or {})
    on_bf16, on_fp16 = bool(bf16.get("enabled", False)), bool(fp16.get("enabled", False))
    if on_bf16 and on_fp16:
        raise ValueError('DeepSpeed config: "bf16" and "fp16" are both enabled; enable one of them (bf16 needs '
                         "no loss scaling)")
    comm = str(ds.get("communication_data_type", "fp32")).lower()
    if comm not in _COMM_DTYPES:
        raise ValueError(f'"communication_data_type" must be one of {sorted(_COMM_DTYPES)}, got {comm!r}')
    if not (on_bf16 or on_fp16):
        return None
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


def _int_or_none(ds: dict[str, Any], key: str) -> "int | None":
    value = ds.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"DeepSpeed config: {key} must be an integer, got {value!r}")
    return int(value)


def read_deepspeed(ds: Union[dict[str, Any], str, os.PathLike]) -> DeepSpeedReading:
    """The `Config` fields a DeepSpeed config dict or JSON file sets, read strictly (module doc)."""
    if not isinstance(ds, dict):
        with open(ds) as f:
            ds = json.load(f)
        if not isinstance(ds, dict):
            raise ValueError(f"a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    reader = _Reader()
    ds = reader.walk(ds)
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 3))
    if stage not in (1, 2, 3):
        raise ValueError(f"DeepSpeed config: zero_optimization.stage={stage}: fxzero runs ZeRO stages 1, 2 and 3 "
                         "(stage 1 trains exactly as plain data parallelism, with the optimizer states sharded)")
    for name, key in OPTIMIZER_PARAMS["adam"].items():
        if key.kind == NO_EFFECT and name in ((ds.get("optimizer") or {}).get("params") or {}):
            reader.ineffective.append(f"DeepSpeed config key 'optimizer.params.{name}' has no effect in fxzero: "
                                      f"{key.why}")
    threshold = int(zero.get("stage3_param_persistence_threshold", _DEFAULT_PERSISTENCE)) if stage == 3 else 0
    # A reuse distance of 0 releases every parameter after use: gather each unit twice.
    prefetch = Prefetch(keep_for_backward=None if int(zero.get("stage3_max_reuse_distance", 1)) > 0 else False)
    clip = ds.get("gradient_clipping")
    fields = dict(
        stage=stage, optimizer=_optimizer(ds.get("optimizer") or {}), persist_threshold=threshold,
        offload=_offload(zero), prefetch=prefetch, mixed_precision=_mixed_precision(ds),
        train_batch_size=_int_or_none(ds, "train_batch_size"),
        train_micro_batch_size_per_gpu=_int_or_none(ds, "train_micro_batch_size_per_gpu"),
        gradient_accumulation_steps=_int_or_none(ds, "gradient_accumulation_steps"),
        gradient_clipping=float(clip) if clip else None,  # DeepSpeed: 0 is no clipping
        steps_per_print=_int_or_none({"steps_per_print": 10, **ds}, "steps_per_print"),  # DeepSpeed's default
        lr_schedule=schedule_from_deepspeed(ds["scheduler"]) if ds.get("scheduler") else None,
        dataloader_drop_last=bool(ds.get("dataloader_drop_last", False)),
    )
    return DeepSpeedReading(fields, reader.ineffective, reader.resolved)

"""A DeepSpeed config (dict or JSON file) read strictly, as the fields of a `fxzero.Config`.

Every key is looked up in the key table (`fxzero/config/deepspeed_keys.py`): a key that sets
what fxzero does is read into its field; one that changes nothing in fxzero is named in one
warning with the reason; one fxzero does not have, set to a value that would change training,
is an error naming the feature; a key DeepSpeed does not have either is an error naming the
nearest one (at the top level, where DeepSpeed ignores keys it does not know, only a misspelling,
within two edits of a DeepSpeed key, is an error; any other is warned about and ignored). Every value is read through `deepspeed_defaults.value`, so a
missing key is DeepSpeed 0.19.8's default, one table for all of them: stage 0, clipping at 1.0,
no log line, gradients reduced in the compute dtype, the optimizer class's own defaults.

Where fxzero gives what a key asks by other means, the reading says how, once (`notes`): stage
0 runs as ZeRO stage 1 (the same update), prescaled or predivided gradients are averaged after
the sum (the same average).

`Config.from_deepspeed(ds)` is `Config(**read_deepspeed(ds).fields)`; this module does not import
`Config`, so the two do not import each other.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import math
import os
from typing import Any, NamedTuple, Union

import torch

from fxzero.config.activations import Activations
from fxzero.config.deepspeed_defaults import DEFAULTS, FIELD_NAMES, OPTIMIZER_DEFAULTS, deepspeed_optimizer, value
from fxzero.config.deepspeed_keys import (
    AUTO_IMPLIED, ELEMENTWISE_TORCH, KEYS, NO_EFFECT, OPTIMIZER_PARAMS, SECTION, UNSUPPORTED, Key)
from fxzero.config.placement import Cpu, Device, Nvme, Offload, Placement
from fxzero.config.policies import Adagrad, Adam, AdamW, Lamb, LeafModules, Lion, OptimizerPolicy, Prefetch
from fxzero.config.precision import Autocast, LossScale, MixedPrecision
from fxzero.config.random_ltd import random_ltd_from_deepspeed
from fxzero.config.schedules import schedule_from_deepspeed

__all__ = ["DeepSpeedReading", "read_deepspeed"]

_ALIASES = {"bfloat16": "bf16"}
_COMM_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
                "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_NO_TRAINER = ("a trainer (such as Hugging Face's) fills that in before DeepSpeed reads it, and fxzero has no "
               "trainer to supply it; give a value")


class DeepSpeedReading(NamedTuple):
    fields: dict[str, Any]
    """`Config` keyword arguments."""
    ineffective: list[str]
    """One message per key that changes nothing in fxzero, for the one-time warning."""
    resolved: list[str]
    """One line per "auto" value resolved here, to print once."""
    notes: list[str]
    """How fxzero gives what a key asks by other means (stage 0, prescale_gradients), to print once."""


_SECTIONS = frozenset(path for path, key in KEYS.items() if key.kind == SECTION and "." not in path)
"""DeepSpeed's top-level sections (objects): "zero_optimization", "bf16", ..."""


class _Reader:
    def __init__(self) -> None:
        self.ineffective: list[str] = []
        self.resolved: list[str] = []
        self.notes: list[str] = []
        self.unresolved: list[str] = []
        """"auto" values fxzero cannot fill: raised after the walk, so that a feature fxzero does
        not have, named by the walk, is the error a config with both gets."""

    def walk(self, section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """The section with every key checked against the table, "auto" resolved; sub-sections
        walked likewise (except the optimizer's and scheduler's params, read by their type)."""
        out: dict[str, Any] = {}
        for raw, value in section.items():
            if not prefix and "." in raw and raw.split(".")[0] in _SECTIONS:
                # (TRL's prepare_deepspeed writes "zero_optimization.reduce_bucket_size" so: DeepSpeed
                # reads its sections as nested objects only, so such a key changes nothing there)
                self.ineffective.append(
                    f"DeepSpeed config key {raw!r} is a dotted name at the top level: DeepSpeed reads "
                    f"{raw.split('.')[0]!r} as a nested object only and ignores this key, and so does fxzero; "
                    f"to set it, nest it: {{{raw.split('.')[0]!r}: {{{'.'.join(raw.split('.')[1:])!r}: ...}}}}")
                continue
            if isinstance(value, enum.Enum):  # (DeepSpeed's OffloadDeviceEnum.cpu, ZeroStageEnum.weights: str and int
                value = value.value           # enums a program puts in its config dict; str() of one is its name)
            name = _ALIASES.get(raw, raw) if not prefix else raw
            path = FIELD_NAMES.get(prefix + name, prefix + name)  # DeepSpeed's field name for a "stage3_" key
            name = path[len(prefix):]
            if name in out:
                raise ValueError(f"DeepSpeed config: {path!r} is given twice (as {raw!r} too); keep one")
            key = KEYS.get(path)
            if key is None:
                near = _nearest(prefix, raw)
                if not prefix and not _misspelled(raw, near):
                    # DeepSpeed ignores a top-level key it does not read (LLaMA-Factory's configs carry
                    # "comms_config" and "monitor_config", which DeepSpeed never reads)
                    self.ineffective.append(f"DeepSpeed config key {raw!r} is not a DeepSpeed key: DeepSpeed "
                                            f"ignores it, and so does fxzero{_nearest_said(near)}")
                    continue
                raise ValueError(f"DeepSpeed config: unknown key {prefix + raw!r}"
                                 f"{_did_you_mean(near) if near else _elsewhere(prefix)}")
            if isinstance(value, str) and value == "auto" and not key.honours(value):
                value = self._auto(path, key)
                if value is _UNRESOLVED:
                    continue
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
            self.unresolved.append(f'DeepSpeed config: {path} is "auto": {_NO_TRAINER}')
            return _UNRESOLVED
        if key.auto == AUTO_IMPLIED:
            self.resolved.append(f'{path}: "auto" -> implied by the other batch sizes and the world size')
            return None
        if path not in DEFAULTS:  # a key with no effect, and no default: its warning names it
            return "auto"
        resolved = DEFAULTS[path]
        self.resolved.append(f'{path}: "auto" -> {json.dumps(resolved)} (DeepSpeed\'s default)')
        return resolved

    def raise_unresolved(self) -> None:
        if self.unresolved:
            raise ValueError(self.unresolved[0])


_UNRESOLVED = object()


def _nearest(prefix: str, raw: str) -> "str | None":
    """The key of the section at `prefix` nearest to `raw`, if any is near."""
    siblings = [k[len(prefix):] for k in KEYS if k.startswith(prefix) and "." not in k[len(prefix):]]
    near = difflib.get_close_matches(raw, siblings, n=1, cutoff=0.6)
    return near[0] if near else None


def _did_you_mean(near: str) -> str:
    return f"; did you mean {near!r}?"


def _nearest_said(near: "str | None") -> str:
    return f" (the nearest DeepSpeed key is {near!r})" if near else ""


_TYPO_EDITS = 2
"""A top-level key within this many single-character edits of a DeepSpeed key is taken for a
misspelling of it (an error: DeepSpeed would ignore it and train without the setting); one further
away is a key of someone else's (warned about and ignored, as DeepSpeed ignores it)."""


def _misspelled(raw: str, near: "str | None") -> bool:
    return near is not None and _edits(raw, near) <= _TYPO_EDITS


def _edits(a: str, b: str) -> int:
    """Levenshtein distance: single-character insertions, deletions and substitutions."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _elsewhere(prefix: str) -> str:
    return f" in {prefix[:-1]!r} (see docs/deepspeed_config.md for every key)"


def _placement(get: Any, section: dict[str, Any], key: str) -> Placement:
    """The tier of zero_optimization.`key` (`section`: its keys, after the deprecated ones)."""
    path = f"zero_optimization.{key}"
    pick = lambda name: section.get(name, get(f"{path}.{name}"))  # noqa: E731
    device = str(pick("device")).lower()
    if device in ("none", ""):
        return Device()
    if device == "cpu":
        return Cpu(pin_memory=bool(pick("pin_memory")))
    if device == "nvme":
        if not pick("nvme_path"):
            raise ValueError(f'zero_optimization.{key}: device "nvme" needs "nvme_path" (a directory on the disk)')
        return Nvme(path=str(pick("nvme_path")), threads=int(pick("buffer_count")))
    raise ValueError(f'zero_optimization.{key}.device must be "none", "cpu" or "nvme", got {device!r}')


def _offload(get: Any) -> Offload:
    param = dict(get("zero_optimization.offload_param") or {})
    opt = dict(get("zero_optimization.offload_optimizer") or {})
    pin = get("zero_optimization.cpu_offload_use_pin_memory")
    for deprecated, section in (("cpu_offload_param", param), ("cpu_offload", opt)):
        if get(f"zero_optimization.{deprecated}"):
            if section.get("device", "none") not in ("none", "cpu"):
                raise ValueError(f"zero_optimization.{deprecated} is true and says cpu, but its section says "
                                 f"{section['device']!r}: keep one of them")
            section["device"] = "cpu"
            if pin is not None:
                section.setdefault("pin_memory", bool(pin))
    return Offload(params=_placement(get, param, "offload_param"),
                   optimizer=_placement(get, opt, "offload_optimizer"))


def _optimizer(section: dict[str, Any], offloaded: bool) -> OptimizerPolicy:
    """The policy an "optimizer" section names, its missing params at the defaults of the class
    DeepSpeed builds for it (`deepspeed_optimizer`: FusedAdam's weight decay is 0, torch.optim.AdamW's
    0.01 with "torch_adam")."""
    kind = str(section.get("type", "AdamW"))
    name = "adam" if kind.lower() in ("adam", "adamw") else kind if kind in TORCH_TYPES else kind.lower()
    table = OPTIMIZER_PARAMS.get(name)
    if table is None:
        why = _REFUSED_TYPES.get(kind.lower(), "it is not one DeepSpeed or torch.optim has")
        raise ValueError(f"DeepSpeed config: optimizer type {kind!r} is not supported ({why}); fxzero runs "
                         "\"Adam\"/\"AdamW\" (\"adam_w_mode\": false for L2 weight decay), \"Adagrad\", \"Lion\", "
                         f"\"Lamb\" and torch.optim's element-wise {', '.join(repr(t) for t in sorted(TORCH_TYPES))}")
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
    defaults = OPTIMIZER_DEFAULTS[deepspeed_optimizer(kind, params, offloaded)]
    given = lambda k: params.get(k, defaults.get(k))  # noqa: E731  (None: not a param of that class)
    if name == "adagrad":  # torch.optim.Adagrad, as DeepSpeed builds it (DeepSpeedCPUAdagrad when offloaded)
        return Adagrad(**{k: float(given(k)) for k in table if given(k) is not None})
    if name in ("lion", "lamb") or name in TORCH_TYPES:  # FusedLion / DeepSpeedCPULion, FusedLamb, or torch.optim's
        policy = {"lion": Lion, "lamb": Lamb}.get(name) or TORCH_TYPES[name]
        fields = {f.name for f in dataclasses.fields(policy)}  # (not FusedLamb's amsgrad, false or refused above)
        return policy(**{k: _as_field(given(k)) for k in table if k in fields and given(k) is not None})
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (its FusedAdam's default).
    decoupled = kind.lower() == "adamw" or bool(params.get("adam_w_mode", True))
    cls = AdamW if decoupled else Adam
    return cls(lr=float(given("lr")), betas=tuple(float(b) for b in given("betas")), eps=float(given("eps")),
               weight_decay=float(given("weight_decay")), amsgrad=bool(given("amsgrad") or False),
               bias_correction=bool(params.get("bias_correction", True)))


TORCH_TYPES = {policy.TORCH: policy for policy in ELEMENTWISE_TORCH}
"""torch.optim class name -> its policy, for "optimizer" sections naming one."""

_REFUSED_TYPES = {
    "onebitadam": "1-bit Adam's compressed communication is not in fxzero (nor in DeepSpeed 0.19.8); use \"Adam\"",
    "zerooneadam": "0/1 Adam's compressed communication is not in fxzero (nor in DeepSpeed 0.19.8); use \"Adam\"",
    "onebitlamb": "1-bit LAMB is not in fxzero (nor in DeepSpeed 0.19.8); use \"Lamb\"",
    "muon": "Muon orthogonalizes each weight matrix whole, which a flat shard cannot; use \"AdamW\"",
}
"""Optimizer types fxzero refuses, with the reason each needs what fxzero does not have."""


def _as_field(value: Any) -> Any:
    """A param as a policy field takes it: lists as tuples (betas, etas), numbers as they are."""
    return tuple(value) if isinstance(value, list) else value


def _reduce_dtype(get: Any, compute: "torch.dtype", notes: list[str]) -> "torch.dtype | None":
    """The dtype gradients are reduced in under mixed precision: `communication_data_type`'s, or
    the compute dtype where it is missing (DeepSpeed's default), except with prescaled or
    predivided float16 gradients, which fxzero averages after an fp32 sum (module doc). Gradient
    shards offloaded with the optimizer states are kept in fp32 whatever the reduction's dtype,
    as DeepSpeed's offloaded gradient partitions are (`passes/offload_grads.py`)."""
    comm = get("communication_data_type")
    if comm is not None:
        if str(comm).lower() not in _COMM_DTYPES:
            raise ValueError(f'"communication_data_type" must be one of {sorted(_COMM_DTYPES)} (or null), got {comm!r}')
        comm = _COMM_DTYPES[str(comm).lower()]
        if comm not in (torch.float32, compute):
            raise ValueError(f'DeepSpeed config: "communication_data_type" {get("communication_data_type")!r} with '
                             f"{str(compute)[6:]} compute: fxzero reduces gradients in fp32 or in the compute dtype; "
                             'give "fp32", or drop the key (the compute dtype)')
    scaled = get("prescale_gradients") or get("gradient_predivide_factor") != 1
    if compute is torch.float16 and scaled:
        if comm is torch.float16:
            raise ValueError('DeepSpeed config: prescale_gradients / gradient_predivide_factor with float16 gradients '
                             'reduced in float16 ("communication_data_type": "fp16"): fxzero divides after the sum, '
                             "which could overflow float16 where DeepSpeed's divided sum would not; drop "
                             '"communication_data_type" (fxzero then reduces in fp32) or the prescaling')
        if comm is None:
            notes.append("prescale_gradients / gradient_predivide_factor with fp16: fxzero reduces the float16 "
                         "gradients in fp32 and averages after the sum, so the sum cannot overflow where "
                         "DeepSpeed's divided float16 sum would not (the same average, without its float16 rounding)")
            return torch.float32
    return None if comm in (None, compute) else comm


def _mixed_precision(get: Any, notes: list[str]) -> "MixedPrecision | None":
    """"bf16" / "fp16" sections -> MixedPrecision; both enabled is an error."""
    on_bf16, on_fp16 = bool(get("bf16.enabled")), bool(get("fp16.enabled"))
    if on_bf16 and on_fp16:
        raise ValueError('DeepSpeed config: "bf16" and "fp16" are both enabled; enable one of them (bf16 needs '
                         "no loss scaling)")
    if not (on_bf16 or on_fp16):
        comm = get("communication_data_type")
        if comm is not None and _COMM_DTYPES.get(str(comm).lower()) not in (torch.float32,):
            raise ValueError(f'DeepSpeed config: "communication_data_type" {comm!r} without a "bf16" or "fp16" '
                             "section enabled: fxzero reduces fp32 gradients in fp32; enable the section, or drop "
                             "the key")
        return None
    if on_bf16:
        return MixedPrecision(param_dtype=torch.bfloat16,
                              reduce_dtype=_reduce_dtype(get, torch.bfloat16, notes))
    static = float(get("fp16.loss_scale"))
    scale = LossScale(
        initial_scale_power=int(get("fp16.initial_scale_power")),
        window=int(get("fp16.loss_scale_window")),
        hysteresis=int(get("fp16.hysteresis")),
        min_scale=float(get("fp16.min_loss_scale")),
        static=static if static > 0 else None,
    )
    return MixedPrecision(param_dtype=torch.float16, reduce_dtype=_reduce_dtype(get, torch.float16, notes),
                          loss_scale=scale)


def _low_precision_masters(get: Any, mp: "MixedPrecision | None", offload: Offload,
                           notes: list[str]) -> "MixedPrecision | None":
    """"bf16.bf16_master_weights_and_grads" / "bf16.bf16_optimizer_states" -> the masters' and the
    optimizer states' dtypes ([Note: low-precision masters] in `fxzero/config/precision.py`), with
    DeepSpeed 0.19.8's own conditions (`DeepSpeedConfig._do_error_check`,
    `ZeROOptimizer._configure_master_weights`): ZeRO stage 1-3, and the states only with the
    masters. DeepSpeed runs bf16 masters with fp32 states only with the optimizer offloaded to the
    cpu (DeepSpeedCPUAdam); fxzero runs them on any tier, said once."""
    masters, states = bool(get("bf16.bf16_master_weights_and_grads")), bool(get("bf16.bf16_optimizer_states"))
    if not (masters or states):
        return mp
    if states and not masters:
        raise ValueError("DeepSpeed config: bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads "
                         "(as DeepSpeed: bfloat16 states with fp32 masters are not a DeepSpeed mode); set both")
    if mp is None or mp.param_dtype is not torch.bfloat16:
        raise ValueError("DeepSpeed config: bf16.bf16_master_weights_and_grads needs bfloat16 training: set "
                         '"bf16": {"enabled": true} (the masters are the bfloat16 parameters)')
    if get("zero_optimization.stage") == 0:
        raise ValueError("DeepSpeed config: bf16.bf16_master_weights_and_grads is for ZeRO stages 1, 2 and 3 (DeepSpeed "
                         'refuses it at stage 0); set "zero_optimization": {"stage": 1} or higher')
    if not states and not offload.offloaded("optimizer"):
        notes.append("bf16.bf16_master_weights_and_grads without bf16_optimizer_states: bfloat16 masters with fp32 "
                     "optimizer states on the device (DeepSpeed runs this only with offload_optimizer on the cpu, "
                     "DeepSpeedCPUAdam with fp32_optimizer_states); the update widens each parameter to fp32 as "
                     "DeepSpeedCPUAdam does")
    if mp.reduce_dtype is torch.float32:
        notes.append('bf16.bf16_master_weights_and_grads with "communication_data_type": "fp32": gradients are '
                     "reduced and held in fp32 (4 bytes each) until the update rounds them to bfloat16; DeepSpeed "
                     "rounds them into its bfloat16 gradient partition as they are reduced")
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=mp.reduce_dtype, master_dtype=torch.bfloat16,
                          optimizer_dtype=torch.bfloat16 if states else torch.float32)


def _activation_checkpointing(section: Any, notes: list[str]) -> Activations:
    """"activation_checkpointing" -> `Activations(recompute="unit")`. DeepSpeed's section configures
    `deepspeed.checkpointing`, which only the model's own calls of its `checkpoint` use (an
    unmodified model checkpoints nothing, DeepSpeed#5704); fxzero recomputes every unit's forward
    with no model edits, as the section's user asks ([Note: recomputing a unit]).
    "cpu_checkpointing" -> `offload=fxzero.Cpu()`: what each unit keeps waits in host memory."""
    notes.append('"activation_checkpointing": every unit\'s forward is recomputed in the backward '
                 '(Activations(recompute="unit")), the model unmodified; its inputs are kept, and the generator '
                 "state of each dropout's draw")
    # (DeepSpeed's default False: ACT_CHKPT_CPU_CHECKPOINTING_DEFAULT, runtime/activation_checkpointing/config.py;
    # its section's keys are read by deepspeed.checkpointing, outside the runtime's defaults table)
    if (section or {}).get("cpu_checkpointing", False):
        notes.append('"activation_checkpointing.cpu_checkpointing": what each unit keeps waits in host memory '
                     "(Activations(offload=fxzero.Cpu()))")
        return Activations(recompute="unit", offload=Cpu())
    return Activations(recompute="unit")


def _autocast(ds: dict[str, Any], get: Any, mp: "MixedPrecision | None", notes: list[str]) -> "Autocast | None":
    """"torch_autocast" -> `Autocast`: DeepSpeed's engine runs its forward under
    torch.autocast(<accelerator>, dtype) (`runtime/torch_autocast.py`, `autocast_if_enabled`)."""
    if not get("torch_autocast.enabled"):
        return None
    named = (ds.get("torch_autocast") or {}).get("dtype")
    if named is None:
        raise ValueError('DeepSpeed config: "torch_autocast" is enabled with no "dtype": DeepSpeed then autocasts to '
                         'the device\'s default (float16 on CUDA, bfloat16 on a CPU); name it, e.g. "dtype": '
                         '"torch.bfloat16"')
    dtype = {**{f"torch.{k}": v for k, v in _COMM_DTYPES.items()}, **_COMM_DTYPES, "half": torch.float16,
             "torch.half": torch.float16}.get(str(named).lower())
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f'DeepSpeed config: torch_autocast.dtype {named!r}: autocast runs in "torch.bfloat16" or '
                         '"torch.float16"; name one of them')
    if dtype is torch.float16 and (mp is None or mp.param_dtype is not torch.float16):
        raise ValueError('DeepSpeed config: torch_autocast to float16 without "fp16" enabled: DeepSpeed then scales '
                         "the loss with torch's GradScaler, and fxzero scales it only under its float16 mixed "
                         'precision; enable "fp16", or autocast to "torch.bfloat16"')
    if mp is not None and dtype is not mp.param_dtype:
        raise ValueError(f'DeepSpeed config: torch_autocast.dtype {named!r} and the enabled '
                         f'"{"bf16" if mp.param_dtype is torch.bfloat16 else "fp16"}" section differ; autocast to '
                         "the dtype the model computes in")
    if mp is None:
        notes.append("torch_autocast with an fp32 model: autocast casts in the program, and fxzero gathers and "
                     "reduces the fp32 parameters and gradients in fp32; DeepSpeed moves those of its "
                     "lower_precision_safe_modules (Linear, Conv by default) in the autocast dtype (half the bytes, "
                     "gradients summed in it)")
    return Autocast(dtype=dtype)


_LEAF_KEYS = ("classes", "names", "name_suffixes")


_HYBRID_ENGINE = {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
                  "pin_parameters": True, "tp_gather_partition_size": 8, "enable_cuda_graph": False}
"""DeepSpeed 0.19.8's hybrid_engine section (`HybridEngineConfig` in runtime/config.py): its keys and
their defaults."""


def _hybrid_engine(section: Any, stage: int, ineffective: list[str]) -> bool:
    """`hybrid_engine`, read whole: whether the model's generate gathers the ZeRO-3 model once
    (`Config.gather_for_generate`). What sizes or tunes DeepSpeed's inference kernels has no effect
    (named once); tensor-parallel generation is an error."""
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: hybrid_engine must be an object, got {section!r}")
    unknown = sorted(set(section) - set(_HYBRID_ENGINE))
    if unknown:
        raise ValueError(f"DeepSpeed config: hybrid_engine has no key {unknown[0]!r} (DeepSpeed's are "
                         f"{', '.join(_HYBRID_ENGINE)})")
    if not isinstance(section.get("enabled", False), bool):
        raise ValueError(f"DeepSpeed config: hybrid_engine.enabled must be true or false, got {section['enabled']!r}")
    if not section.get("enabled", False):
        return False
    if section.get("inference_tp_size", 1) != 1:
        raise ValueError(f"DeepSpeed config: hybrid_engine.inference_tp_size={section['inference_tp_size']!r} is "
                         "not supported by fxzero: it generates without tensor parallelism; set it to 1, or drop it")
    tuned = [key for key in ("max_out_tokens", "release_inference_cache", "pin_parameters",
                             "tp_gather_partition_size", "enable_cuda_graph")
             if key in section and section[key] != _HYBRID_ENGINE[key]]
    if tuned:
        keys = ", ".join(f"'hybrid_engine.{k}'" for k in tuned)
        ineffective.append(f"DeepSpeed config key{'s' if len(tuned) > 1 else ''} {keys} "
                           f"{'have' if len(tuned) > 1 else 'has'} no effect in fxzero: "
                           "they size or tune DeepSpeed's inference kernels, and fxzero generates with the model's "
                           "own forward")
    if stage != 3:
        ineffective.append(f"DeepSpeed config key 'hybrid_engine.enabled' has no effect in fxzero at ZeRO-{stage}: "
                           "every rank holds the whole model, and generate runs on it as it is")
        return False
    return True


def _leaf_modules(section: Any) -> "LeafModules | None":
    """zero_optimization.leaf_module as a LeafModules (None: not given, Config's default, which is
    DeepSpeed's); each field takes a name or a list of names, as DeepSpeed's does."""
    if section is None or section == {}:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: zero_optimization.leaf_module must be an object with {list(_LEAF_KEYS)}, "
                         f"got {section!r}")
    for key, given in section.items():
        if key not in _LEAF_KEYS:
            near = difflib.get_close_matches(key, _LEAF_KEYS, n=1)
            raise ValueError(f"DeepSpeed config: unknown key 'zero_optimization.leaf_module.{key}'"
                             f"{_did_you_mean(near[0]) if near else f'; it takes {list(_LEAF_KEYS)}'}")
        names = [given] if isinstance(given, str) else given
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"DeepSpeed config: zero_optimization.leaf_module.{key} must be a name or a list of "
                             f"names, got {given!r}")
    return LeafModules(**{key: tuple([v] if isinstance(v, str) else v) for key, v in section.items()})


def _int_or_none(get: Any, key: str) -> "int | None":
    v = get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"DeepSpeed config: {key} must be an integer, got {v!r}")
    return int(v)


def _stage(get: Any, given: bool, notes: list[str]) -> int:
    """ZeRO stage 1, 2 or 3; DeepSpeed's stage 0 (its default) runs as stage 1, said once."""
    stage = get("zero_optimization.stage")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 0:
        where = "" if given else " (DeepSpeed's default: the config has no zero_optimization.stage)"
        notes.append(f"zero_optimization.stage 0, plain data parallelism{where}, runs as ZeRO stage 1: the same "
                     "averaged gradients and the same update, with each rank keeping its shard of the optimizer "
                     "states instead of all of them")
        return 1
    return int(stage)


def _gradient_scaling(get: Any, notes: list[str]) -> None:
    prescale, factor = get("prescale_gradients"), get("gradient_predivide_factor")
    if not isinstance(prescale, bool):
        raise ValueError(f"DeepSpeed config: prescale_gradients must be true or false, got {prescale!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"DeepSpeed config: gradient_predivide_factor must be a number > 0, got {factor!r}")
    if prescale or factor != 1:
        what = "prescale_gradients true" if prescale else f"gradient_predivide_factor {factor}"
        notes.append(f"{what}: DeepSpeed divides the gradients before summing them over ranks, fxzero divides the "
                     "sum by the world size: the same average (in fp32, dividing by a power-of-two world before or "
                     "after the sum rounds alike)")


def _reduction(get: Any) -> str:
    op = get("gradient_allreduce_op")
    if op not in ("mean", "sum"):
        raise ValueError(f"DeepSpeed config: gradient_allreduce_op must be \"mean\" or \"sum\", got {op!r}")
    return op


def _division(get: Any) -> str:
    """Where DeepSpeed divides the gradient sum by the world size: before the reduction at ZeRO-1/2
    with `reduce_scatter` (stage_1_and_2's average_tensor divides its bucket first) and at ZeRO-3
    (reduce_scatter_coalesced divides its buffer first); after it at stage 0 (the engine's
    all-reduce, postscale_gradients) and at 1/2 without reduce_scatter (an all-reduce, postscaled)."""
    stage, reduce_scatter = get("zero_optimization.stage"), get("zero_optimization.reduce_scatter")
    return "before" if stage == 3 or stage in (1, 2) and reduce_scatter else "after"


def _given_stage(ds: dict[str, Any]) -> bool:
    return "stage" in (ds.get("zero_optimization") or {})


def read_deepspeed(ds: Union[dict[str, Any], str, os.PathLike]) -> DeepSpeedReading:
    """The `Config` fields a DeepSpeed config dict or JSON file sets, read strictly (module doc)."""
    if not isinstance(ds, dict):
        with open(ds) as f:
            ds = json.load(f)
        if not isinstance(ds, dict):
            raise ValueError(f"a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    reader = _Reader()
    ds = reader.walk(ds)
    reader.raise_unresolved()
    get = functools.partial(value, ds)
    notes = reader.notes
    stage = _stage(get, _given_stage(ds), notes)
    _gradient_scaling(get, notes)
    optimizer_section = ds.get("optimizer")
    for name, key in OPTIMIZER_PARAMS["adam"].items():
        if key.kind == NO_EFFECT and name in ((optimizer_section or {}).get("params") or {}):
            reader.ineffective.append(f"DeepSpeed config key 'optimizer.params.{name}' has no effect in fxzero: "
                                      f"{key.why}")
    if optimizer_section is not None and "type" not in optimizer_section:
        if optimizer_section.get("params"):
            raise ValueError('DeepSpeed config: "optimizer" has "params" but no "type": DeepSpeed then builds no '
                             'optimizer from it and ignores them; name the type ("AdamW", "Adam", "Adagrad"), or '
                             "drop the section and pass an optimizer to initialize")
        optimizer_section = None  # (as DeepSpeed: no type, no optimizer from the config)
    threshold = int(get("zero_optimization.stage3_param_persistence_threshold")) if stage == 3 else 0
    # A reuse distance of 0 releases every parameter after use: gather each unit twice.
    prefetch = Prefetch(keep_for_backward=None if int(get("zero_optimization.stage3_max_reuse_distance")) > 0
                        else False)
    offload = _offload(get)
    if offload.offloaded("param") and stage != 3:
        said = f"is {get('zero_optimization.stage')}"
        said += "" if _given_stage(ds) else " (DeepSpeed's default: not given)"
        raise ValueError(f"DeepSpeed config: zero_optimization.offload_param (device {offload.params.tier!r}) needs "
                         f"stage=3, and zero_optimization.stage {said}: below stage 3 every rank holds the whole "
                         'parameters (DeepSpeed ignores offload_param there); set "stage": 3, or drop offload_param')
    clip = get("gradient_clipping")
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ValueError(f"DeepSpeed config: gradient_clipping must be a number >= 0 (0: no clipping), got {clip!r}")
    fields = dict(
        stage=stage, persist_threshold=threshold, offload=offload, prefetch=prefetch,
        mixed_precision=_low_precision_masters(get, _mixed_precision(get, notes), offload, notes),
        train_batch_size=_int_or_none(get, "train_batch_size"),
        train_micro_batch_size_per_gpu=_int_or_none(get, "train_micro_batch_size_per_gpu"),
        gradient_accumulation_steps=_int_or_none(get, "gradient_accumulation_steps"),
        gradient_clipping=float(clip) if clip else None,  # DeepSpeed: 0 is no clipping
        gradient_reduction=_reduction(get),
        gradient_division=_division(get),
        steps_per_print=None if get("steps_per_print") == math.inf else _int_or_none(get, "steps_per_print"),
        lr_schedule=schedule_from_deepspeed(ds["scheduler"]) if ds.get("scheduler") else None,
        dataloader_drop_last=bool(get("dataloader_drop_last")),
    )
    fields["autocast"] = _autocast(ds, get, fields["mixed_precision"], notes)
    if ds.get("activation_checkpointing") is not None:
        fields["activations"] = _activation_checkpointing(ds.get("activation_checkpointing"), notes)
    random_ltd = random_ltd_from_deepspeed(ds.get("data_efficiency"), reader.ineffective, notes)
    if random_ltd is not None:
        fields["random_ltd"] = random_ltd
    if _hybrid_engine(ds.get("hybrid_engine"), stage, reader.ineffective):
        fields["gather_for_generate"] = True
    leaf = _leaf_modules(get("zero_optimization.leaf_module"))
    if leaf is not None:
        fields["leaf_modules"] = leaf
    if optimizer_section is not None:  # (without one DeepSpeed builds none: Config's default, or the client's)
        fields["optimizer"] = _optimizer(optimizer_section, offload.offloaded("optimizer"))
    return DeepSpeedReading(fields, reader.ineffective, reader.resolved, notes)

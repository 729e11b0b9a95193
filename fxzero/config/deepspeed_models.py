"""DeepSpeed's config model classes and enums, as programs import them from `deepspeed.runtime.zero`.

    from deepspeed.runtime.zero.config import ZeroStageEnum, DeepSpeedZeroConfig
    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum])   # (TRL and HF Trainer scripts)
    DeepSpeedZeroConfig(**{"stage3_prefetch_bucket_size": 12345}).prefetch_bucket_size   # 12345

DeepSpeed describes each config section by a pydantic model; programs read a section through it
(`DeepSpeedZeroConfig(**ds["zero_optimization"]).offload_optimizer`) and pass its enums around
(`OffloadDeviceEnum.cpu` as a config value, `ZeroStageEnum` to torch's safe globals for loading
DeepSpeed checkpoints). Here each model is a read-only view of one section built from fxzero's
tables of DeepSpeed 0.19.8's keys and defaults (`fxzero/config/deepspeed_defaults.py`): every
field under DeepSpeed's name with DeepSpeed's default, a "stage3_" key read under its field name
(`FIELD_NAMES`), the deprecated keys carried to the fields that replaced them as DeepSpeed carries
them, `overlap_comm` true at stage 3 only. A key DeepSpeed's model does not have is an error
naming the nearest one (pydantic's extra="forbid" under DeepSpeed). What the section makes fxzero
do is the config reader's business (`fxzero/config/deepspeed.py`): these classes describe, they do
not configure an engine.
"""

from __future__ import annotations

import copy
import difflib
import enum
import pathlib
from typing import Any, ClassVar

from fxzero.config.deepspeed_defaults import DEFAULTS, FIELD_NAMES
from fxzero.config.policies import DEFAULT_LEAF_CLASSES

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroConfig", "DeepSpeedZeroLeafModuleConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum", "OffloadStateTypeEnum", "ZeroStageEnum"]


class ZeroStageEnum(int, enum.Enum):
    """The ZeRO stages by name (`zero_optimization.stage`); equal to their numbers."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, enum.Enum):
    """Where `offload_param` and `offload_optimizer` place their states; equal to the config's strings."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """The kinds of engine state DeepSpeed's `engine.offload_states(include=...)` names."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(DEFAULT_LEAF_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class _Section:
    """A read-only view of one DeepSpeed config section: its fields are the keys `DEFAULTS` lists
    directly under `_PATH`, each given value or DeepSpeed's default."""

    _PATH: ClassVar[str]
    _NESTED: ClassVar[dict[str, type]] = {}
    """Fields that are sections themselves, by the model class that reads them."""

    def __init__(self, **given: Any) -> None:
        aliases = {key.rpartition(".")[2]: field.rpartition(".")[2] for field, key in FIELD_NAMES.items()
                   if field.rpartition(".")[0] == self._PATH}  # ("stage3_prefetch_bucket_size": "prefetch_bucket_size")
        fields = {aliases.get(key, key): copy.deepcopy(default) for key, default in self._defaults().items()}
        seen: dict[str, str] = {}
        for key, value in given.items():
            name = aliases.get(key, key)
            if name not in fields:
                near = difflib.get_close_matches(name, sorted(fields), n=1)
                raise ValueError(f"{type(self).__name__}: unknown field {key!r} of DeepSpeed's {self._PATH!r}"
                                 + (f"; did you mean {near[0]!r}?" if near else f"; it has {sorted(fields)}"))
            if name in seen:
                raise ValueError(f"{type(self).__name__}: {name!r} is given twice (as {seen[name]!r} and {key!r}); "
                                 "keep one")
            seen[name] = key
            fields[name] = value
        self._carry(fields)
        for name, model in self._NESTED.items():
            value = fields.get(name)
            if value is not None and not isinstance(value, model):
                if not isinstance(value, dict):
                    raise ValueError(f"{type(self).__name__}: {name!r} must be an object, got {value!r}")
                fields[name] = model(**value)
        self._check(fields, {aliases.get(key, key): default for key, default in self._defaults().items()})
        self.__dict__.update(fields)

    @classmethod
    def _defaults(cls) -> dict[str, Any]:
        """DeepSpeed's default of each key directly under the section, by key."""
        return {path.rpartition(".")[2]: default for path, default in DEFAULTS.items()
                if path.rpartition(".")[0] == cls._PATH}

    def _carry(self, fields: dict[str, Any]) -> None:
        """Carry deprecated keys to the fields that replaced them, derive what DeepSpeed derives."""

    def _check(self, fields: dict[str, Any], defaults: dict[str, Any]) -> None:
        """Check the values DeepSpeed's model bounds: a count is an integer >= 0, a switch a bool."""
        for name, default in defaults.items():
            value = fields[name]
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{type(self).__name__}: {name} must be true or false, got {value!r}")
            elif isinstance(default, int) and default >= 0:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
                    raise ValueError(f"{type(self).__name__}: {name} must be an integer >= 0, got {value!r}")
                fields[name] = value if isinstance(value, int) else int(value)  # (5e7 is 50000000)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only: build a new one with the changed field")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return id(self)

    def model_dump(self) -> dict[str, Any]:
        """Every field by name, sections as dicts (pydantic's `model_dump`)."""
        return {k: v.model_dump() if isinstance(v, _Section) else v for k, v in vars(self).items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _device(fields: dict[str, Any], owner: str) -> None:
    device = fields.get("device")
    try:
        fields["device"] = OffloadDeviceEnum(str(device.value if isinstance(device, enum.Enum) else device).lower())
    except ValueError:
        raise ValueError(f'{owner}: device must be "none", "cpu" or "nvme", got {device!r}') from None
    if fields.get("nvme_path") is not None:
        fields["nvme_path"] = pathlib.Path(fields["nvme_path"])


class DeepSpeedZeroOffloadParamConfig(_Section):
    """`zero_optimization.offload_param`: where ZeRO-3 keeps the parameter shards."""

    _PATH = "zero_optimization.offload_param"

    def _carry(self, fields: dict[str, Any]) -> None:
        _device(fields, type(self).__name__)


class DeepSpeedZeroOffloadOptimizerConfig(_Section):
    """`zero_optimization.offload_optimizer`: where the optimizer states live; `pipeline` is
    whether either of `pipeline_read` and `pipeline_write` is set, as DeepSpeed derives it."""

    _PATH = "zero_optimization.offload_optimizer"

    def _carry(self, fields: dict[str, Any]) -> None:
        _device(fields, type(self).__name__)

    def _check(self, fields: dict[str, Any], defaults: dict[str, Any]) -> None:
        super()._check(fields, defaults)
        for name in ("ratio", "cpuadam_cores_perc"):
            if isinstance(fields[name], bool) or not isinstance(fields[name], (int, float)) or not 0 <= fields[name] <= 1:
                raise ValueError(f"{type(self).__name__}: {name} must be a number in [0, 1], got {fields[name]!r}")
        fields["pipeline"] = bool(fields["pipeline_read"] or fields["pipeline_write"])


class DeepSpeedZeroLeafModuleConfig(_Section):
    """`zero_optimization.leaf_module`: modules whose parameters are gathered as one piece (see
    `fxzero/leaf_modules.py`); each field a list of names (one name is a list of one), duplicates
    dropped."""

    _PATH = "zero_optimization.leaf_module"

    def __init__(self, **given: Any) -> None:
        fields: dict[str, Any] = {"classes": list(DEFAULT_LEAF_MODULE_CLASSES), "names": list(DEFAULT_LEAF_MODULE_NAMES),
                                  "name_suffixes": list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES)}
        for key, value in given.items():
            if key not in fields:
                near = difflib.get_close_matches(key, list(fields), n=1)
                raise ValueError(f"{type(self).__name__}: unknown field {key!r}"
                                 + (f"; did you mean {near[0]!r}?" if near else f"; it has {list(fields)}"))
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{type(self).__name__}: {key} must be a name or a list of names, got {value!r}")
            fields[key] = list(dict.fromkeys(str(v) for v in value))
        self.__dict__.update(fields)


class DeepSpeedZeroConfig(_Section):
    """`zero_optimization`: every field of DeepSpeed 0.19.8's model, given or defaulted.

    The deprecated keys go where DeepSpeed sends them: `cpu_offload` true is an
    `offload_optimizer` on the cpu, `cpu_offload_param` true an `offload_param` on the cpu,
    `stage3_gather_fp16_weights_on_model_save` is `gather_16bit_weights_on_model_save`;
    `overlap_comm` not given is true at stage 3 and false below it."""

    _PATH = "zero_optimization"
    _NESTED = {"offload_param": DeepSpeedZeroOffloadParamConfig,
               "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
               "leaf_module": DeepSpeedZeroLeafModuleConfig}

    def _carry(self, fields: dict[str, Any]) -> None:
        stage = fields["stage"]
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"{type(self).__name__}: stage must be 0, 1, 2 or 3, got {stage!r}")
        fields["stage"] = ZeroStageEnum(int(stage))
        if fields["overlap_comm"] is None:
            fields["overlap_comm"] = fields["stage"] == ZeroStageEnum.weights
        for deprecated, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if fields.get(deprecated) and fields.get(new) is None:
                fields[new] = {"device": OffloadDeviceEnum.cpu}
        if fields.get("stage3_gather_fp16_weights_on_model_save"):
            fields["gather_16bit_weights_on_model_save"] = True
        if fields.get("leaf_module") is None or fields["leaf_module"] == {}:
            fields["leaf_module"] = DeepSpeedZeroLeafModuleConfig()

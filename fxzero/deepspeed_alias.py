"""`import deepspeed` resolves to fxzero: DeepSpeed programs run unchanged (`fxzero run`).

    fxzero.deepspeed_alias.install()      # from here on, deepspeed.X is fxzero.X in this process
    import deepspeed                      # fxzero itself
    from deepspeed.accelerator import get_accelerator     # fxzero.accelerator.get_accelerator

A finder first on `sys.meta_path` answers every `deepspeed` and `deepspeed.X` import with the
module `fxzero` and `fxzero.X` (`PROVIDED`): the same module objects, never a second copy under
the other name. A DeepSpeed module fxzero does not have is an ImportError naming it and what
fxzero has.

[Note: DeepSpeed's deeper names]
Programs also import single names from deep inside DeepSpeed
(`from deepspeed.runtime.engine import DeepSpeedEngine`). `NAMES` lists each such module and,
for each of its names, the fxzero object that is that thing here: `DeepSpeedEngine` is fxzero's
`Engine` class itself, `load_state_dict_from_zero_checkpoint` loads an fxzero checkpoint. Since
`deepspeed` is fxzero, `deepspeed.runtime.engine` is `fxzero.runtime.engine` however it is
reached (`import deepspeed.runtime.engine as e` goes through the attribute
`deepspeed.runtime`): where fxzero has a module of that path (`PROVIDED`), it defines the
DeepSpeed name itself (`DeepSpeedEngine = Engine`). Every other listed module is a namespace of
references (`_Names`: no code of its own, each attribute the fxzero object, imported on first
use; a name it does not list is an ImportError), put into `sys.modules` when the alias is
installed and made an attribute of its parent (`fxzero.runtime.zero`, `fxzero.git_version_info`,
`fxzero.utils.zero_to_fp32`: names fxzero's own modules do not use), so that every way of
importing it works.

`fxzero run` installs it in every process it starts, and puts a `deepspeed` package on
PYTHONPATH that installs it too, so processes a script spawns itself (a test harness's workers)
resolve `deepspeed` the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional

__all__ = ["NAMES", "PROVIDED", "install", "installed"]

PROVIDED = ("accelerator", "checkpointing", "comm", "zero", "utils", "moe", "moe.utils", "moe.layer", "pipe",
            "runtime", "runtime.engine", "runtime.lr_schedules")
"""DeepSpeed's modules fxzero provides (as fxzero.<name>), beside the package itself."""

NAMES: dict[str, dict[str, str]] = {
    "runtime.engine": {"DeepSpeedEngine": "fxzero.runtime.engine:Engine"},
    # (fxzero's engine has one optimizer object, whatever the stage and dtype: the one holding the
    # fp32 master shards that DeepSpeed's BF16_Optimizer holds for bf16 training)
    "runtime.bf16_optimizer": {"BF16_Optimizer": "fxzero.runtime.optimizer:ShardedOptimizer"},
    "runtime.zero.partition_parameters": {"ZeroParamStatus": "fxzero.zero:ZeroParamStatus",
                                          "Init": "fxzero.zero:Init",
                                          "GatheredParameters": "fxzero.zero:GatheredParameters",
                                          "register_external_parameter": "fxzero.zero:register_external_parameter",
                                          # (patched by Hugging Face's from_pretrained around zero.Init)
                                          "zero_wrapper_for_fp_tensor_constructor":
                                              "fxzero.zero:zero_wrapper_for_fp_tensor_constructor"},
    "runtime.zero.utils": {"ZeRORuntimeException": "fxzero.zero:ZeRORuntimeException"},
    "runtime.zero": {"unwrap_model_for_generation": "fxzero.zero:unwrap_model_for_generation"},
    # DeepSpeed's config models and enums, read from fxzero's tables of its keys and defaults
    # (TRL's and HF Trainer users' scripts pass ZeroStageEnum and LossScaler to torch's safe globals)
    "runtime.zero.config": {name: f"fxzero.config.deepspeed_models:{name}" for name in (
        "ZeroStageEnum", "DeepSpeedZeroConfig", "DeepSpeedZeroOffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig", "OffloadDeviceEnum")},
    "runtime.zero.offload_config": {name: f"fxzero.config.deepspeed_models:{name}" for name in (
        "OffloadDeviceEnum", "OffloadStateTypeEnum", "DeepSpeedZeroOffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig")},
    "runtime.zero.leaf_module_config": {name: f"fxzero.config.deepspeed_models:{name}" for name in (
        "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
        "DeepSpeedZeroLeafModuleConfig")},
    # (fxzero's one loss scaler class, static or dynamic by its policy)
    "runtime.fp16.loss_scaler": {"LossScaler": "fxzero.runtime.loss_scale:LossScaler",
                                 "DynamicLossScaler": "fxzero.runtime.loss_scale:LossScaler"},
    # DeepSpeed's op builders: which ops run here (runtime/deepspeed_ops.py)
    "ops": {"__compatible_ops__": "fxzero.runtime.deepspeed_ops:COMPATIBLE_OPS"},
    "ops.op_builder": {name: f"fxzero.runtime.deepspeed_ops:{name}" for name in (
        "OpBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "FusedLionBuilder",
        "AsyncIOBuilder")},
    "ops.aio": {"AsyncIOBuilder": "fxzero.runtime.deepspeed_ops:AsyncIOBuilder"},
    "runtime.swap_tensor": {"MIN_SWAPPABLE_BYTES": "fxzero.runtime.deepspeed_ops:MIN_SWAPPABLE_BYTES"},
    "utils.zero_to_fp32": {
        "get_fp32_state_dict_from_zero_checkpoint": "fxzero.utils:get_fp32_state_dict_from_zero_checkpoint",
        "load_state_dict_from_zero_checkpoint": "fxzero.utils:load_state_dict_from_zero_checkpoint"},
    "git_version_info": {"version": "fxzero:__version__", "torch_info": "fxzero.accelerator:TORCH_INFO"},
    "checkpoint.utils": {"clone_tensors_for_torch_save": "fxzero.utils:clone_tensors_for_torch_save"},
    # (Megatron-DeepSpeed's and DeepSpeedExamples' scripts log with these)
    "utils.logging": {"logger": "fxzero.utils:logger", "log_dist": "fxzero.utils:log_dist"},
    "runtime.utils": {"see_memory_usage": "fxzero.utils:see_memory_usage"},
    # (LoRA scripts swap a model's layers with these; DeepSpeed moved them from compression.helper)
    "utils.module_utils": {"recursive_getattr": "fxzero.utils:recursive_getattr",
                           "recursive_setattr": "fxzero.utils:recursive_setattr"},
    "compression.helper": {"recursive_getattr": "fxzero.utils:recursive_getattr",
                           "recursive_setattr": "fxzero.utils:recursive_setattr"},
    # DeepSpeed's optimizer classes: their options read into fxzero's policies (runtime/deepspeed_optimizers.py)
    "ops.adam": {"DeepSpeedCPUAdam": "fxzero.runtime.deepspeed_optimizers:DeepSpeedCPUAdam",
                 "FusedAdam": "fxzero.runtime.deepspeed_optimizers:FusedAdam"},
    "ops.adagrad": {"DeepSpeedCPUAdagrad": "fxzero.runtime.deepspeed_optimizers:DeepSpeedCPUAdagrad"},
    "ops.lion": {"DeepSpeedCPULion": "fxzero.runtime.deepspeed_optimizers:DeepSpeedCPULion",
                 "FusedLion": "fxzero.runtime.deepspeed_optimizers:FusedLion"},
    # random layer-token drop (docs/random_ltd.md): the layers route in fxzero's programs
    "runtime.data_pipeline.data_routing.helper": {
        "convert_to_random_ltd": "fxzero.runtime.random_ltd.helper:convert_to_random_ltd",
        "save_without_random_ltd": "fxzero.runtime.random_ltd.helper:save_without_random_ltd",
        "remove_random_ltd_state_dict": "fxzero.runtime.random_ltd.helper:remove_random_ltd_state_dict",
        "RandomLayerTokenDrop": "fxzero.runtime.random_ltd.layer:RandomLayerTokenDrop"},
    "runtime.data_pipeline.data_routing.basic_layer": {
        "RandomLayerTokenDrop": "fxzero.runtime.random_ltd.layer:RandomLayerTokenDrop"},
    "runtime.data_pipeline.data_routing.scheduler": {
        "BaseScheduler": "fxzero.runtime.random_ltd.scheduler:BaseScheduler",
        "RandomLTDScheduler": "fxzero.runtime.random_ltd.scheduler:RandomLTDScheduler"},
}
"""DeepSpeed's deeper modules: each name -> "fxzero.module:attribute", the object that is that
name under fxzero ([Note: DeepSpeed's deeper names]). A package above them that fxzero does not
have (`deepspeed.runtime.zero`) lists its children."""


class _Loader(importlib.abc.Loader):
    """Hands the import system an fxzero module already imported, under the deepspeed name."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # (the import system set the alias's spec; the module keeps its own)


class _Names(ModuleType):
    """A DeepSpeed module whose names are fxzero objects (`NAMES`), each imported on first use."""

    def __init__(self, name: str, table: dict[str, str], children: list[str]) -> None:
        super().__init__(name, f"DeepSpeed's {name} under fxzero: {', '.join(sorted(table) + children)} (each an "
                               "fxzero object; see fxzero/deepspeed_alias.py)")
        self.__path__: list[str] = []  # (a package: its listed children are in sys.modules)
        self.__file__ = __file__  # (where its names are listed: Python's ImportError for a name it lacks says so)
        self.__dict__["_table"] = table

    def __getattr__(self, attr: str) -> object:
        target = self.__dict__["_table"].get(attr)
        if target is None:
            raise AttributeError(f"module {self.__name__!r} under fxzero has no attribute {attr!r}: it provides "
                                 f"{sorted(self.__dict__['_table']) or 'only its submodules'}")
        module, _, name = target.partition(":")
        value = getattr(importlib.import_module(module), name)
        setattr(self, attr, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.__dict__["_table"]))


def _names_modules() -> dict[str, ModuleType]:
    """A `_Names` module for every module in NAMES and every package above one that PROVIDED
    does not give (by DeepSpeed path), each a child attribute of its `_Names` parent."""
    paths = {path for path in NAMES if path not in PROVIDED}
    for path in list(paths):
        parts = path.split(".")
        paths.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) not in PROVIDED)
    children = {p: sorted(c.rpartition(".")[2] for c in paths if c.rpartition(".")[0] == p) for p in paths}
    modules = {p: _Names(f"deepspeed.{p}", NAMES.get(p, {}), children[p]) for p in sorted(paths)}
    for path, module in modules.items():
        parent, _, child = path.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)
    return modules


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        rest = fullname[len("deepspeed"):]
        if rest and rest[1:] not in PROVIDED:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: under fxzero, `deepspeed` is fxzero, which provides "
                f"deepspeed.{', deepspeed.'.join(dict.fromkeys(PROVIDED + tuple(NAMES)))} and the package's own names (initialize, "
                f"init_distributed, add_config_arguments); {fullname} is a DeepSpeed internal fxzero does not "
                "have", name=fullname)
        module = importlib.import_module("fxzero" + rest)
        return importlib.machinery.ModuleSpec(fullname, _Loader(module), is_package=hasattr(module, "__path__"))


_FINDER = _Finder()


def install() -> None:
    """Make `deepspeed` and `deepspeed.X` resolve to fxzero in this process (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    here = sys.modules.get("deepspeed")
    if here is not None and not getattr(here, "__name__", "").startswith("fxzero"):
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]  # (the shim package, or a real DeepSpeed imported before: ours now)
    import fxzero
    import fxzero.runtime  # (a package with nothing to run: its DeepSpeed children are attributes of it)

    sys.modules["deepspeed"] = fxzero
    for path, module in _names_modules().items():  # ([Note: DeepSpeed's deeper names]: never via the finder)
        module = sys.modules.setdefault(f"deepspeed.{path}", module)
        parent, _, child = path.rpartition(".")
        real = sys.modules.get(f"fxzero.{parent}" if parent else "fxzero")  # (fxzero.utils answers by __getattr__)
        if parent not in PROVIDED and parent or real is None:
            continue
        assert vars(real).get(child, module) is module, f"fxzero.{path} is fxzero's own: list it in PROVIDED"
        setattr(real, child, module)


def installed() -> bool:
    return _FINDER in sys.meta_path

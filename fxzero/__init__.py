"""fxzero: ZeRO-3 as a compiler on torch.fx.

    engine = fxzero.compile(model, config=fxzero.Config(stage=3))
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()

The public names below load on first use, so importing one part of the package (the config,
the IR, the CLI) does not import the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ASGD": "fxzero.config",
    "Activations": "fxzero.config",
    "Adadelta": "fxzero.config",
    "Adagrad": "fxzero.config",
    "Adam": "fxzero.config",
    "AdamW": "fxzero.config",
    "Adamax": "fxzero.config",
    "Autocast": "fxzero.config",
    "Bucket": "fxzero.config",
    "CompiledProgram": "fxzero.schedule.compiled",
    "DeepSpeedEngine": "fxzero.runtime.engine",  # (DeepSpeed's top-level name for its engine: fxzero's Engine)
    "Config": "fxzero.config",
    "Cpu": "fxzero.config",
    "Device": "fxzero.config",
    "Engine": "fxzero.runtime.engine",
    "LeafModules": "fxzero.config",
    "LinkEmulation": "fxzero.config",
    "Lamb": "fxzero.config",
    "Lion": "fxzero.config",
    "LossScale": "fxzero.config",
    "MixedPrecision": "fxzero.config",
    "NAdam": "fxzero.config",
    "Nvme": "fxzero.config",
    "Offload": "fxzero.config",
    "Prefetch": "fxzero.config",
    "RAdam": "fxzero.config",
    "RMSprop": "fxzero.config",
    "RandomLTD": "fxzero.config",
    "Rprop": "fxzero.config",
    "SGD": "fxzero.config",
    "Tiling": "fxzero.config",
    "UnitsPolicy": "fxzero.config",
    "LRRangeTest": "fxzero.config.schedules",
    "OneCycle": "fxzero.config.schedules",
    "WarmupCosineLR": "fxzero.config.schedules",
    "WarmupDecayLR": "fxzero.config.schedules",
    "WarmupLR": "fxzero.config.schedules",
    "add_config_arguments": "fxzero.deepspeed_api",
    "compile": "fxzero.api",
    "init_distributed": "fxzero.deepspeed_api",
    "initialize": "fxzero.deepspeed_api",
    "compile_program": "fxzero.compiler",
    # (DeepSpeed's top-level names for these: `from deepspeed import get_accelerator`)
    "get_accelerator": "fxzero.accelerator",
    "log_dist": "fxzero.utils",
    "logger": "fxzero.utils",
}
"""Public name -> the module that defines it."""

_SUBMODULES = ("accelerator", "checkpointing", "comm", "moe", "utils", "zero")
"""DeepSpeed's namespaces fxzero provides (`deepspeed.zero.Init` -> `fxzero.zero.Init`), loaded as
attributes on first use."""

__all__ = sorted(_EXPORTS)


_INFERENCE = ("DeepSpeed-Inference (kernel injection, tensor-parallel serving) is not in fxzero, a training "
              "compiler; to evaluate or generate with a sharded model, fxzero.initialize(model=model, config=...) "
              "without an optimizer and call the engine (or the model, under torch.no_grad())")
_NOT_IN_FXZERO = {
    "init_inference": _INFERENCE, "InferenceEngine": _INFERENCE, "DeepSpeedInferenceConfig": _INFERENCE,
    "default_inference_config": _INFERENCE, "replace_transformer_layer": _INFERENCE,
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not in fxzero: keep the model's "
                                 "own layers (fxzero traces them)",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels are not in fxzero: keep the model's "
                                  "own layers (fxzero traces them)",
    "DeepSpeedHybridEngine": "DeepSpeed's hybrid engine class (training and inference kernels in one) is not in "
                             "fxzero: deepspeed.initialize with the config's hybrid_engine.enabled (DeepSpeed-Chat's "
                             "--enable_hybrid_engine) gives fxzero's engine, whose model's generate gathers the "
                             "ZeRO-3 model once (Config.gather_for_generate)",
    "PipelineEngine": "fxzero has no pipeline parallelism (it is data parallel over every rank)",
    "DualPipeVEngine": "fxzero has no pipeline parallelism (it is data parallel over every rank)",
    "DualPipeVModule": "fxzero has no pipeline parallelism (it is data parallel over every rank)",
    "tp_model_init": "fxzero has no tensor parallelism (it shards parameters over every rank, ZeRO)",
    "set_autotp_mode": "fxzero has no tensor parallelism (it shards parameters over every rank, ZeRO)",
}
"""DeepSpeed's top-level names for what fxzero does not do, each with why and what to do instead:
`import deepspeed` is fxzero under `fxzero run`, and a bare AttributeError would name neither."""


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"fxzero.{name}")
    module = _EXPORTS.get(name)
    if module is None and name in _NOT_IN_FXZERO:
        raise AttributeError(f"module 'fxzero' (DeepSpeed's names under fxzero run) has no attribute {name!r}: "
                             f"{_NOT_IN_FXZERO[name]}")
    if module is None:
        raise AttributeError(f"module 'fxzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

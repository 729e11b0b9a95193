"""fxzero: ZeRO-3 as a compiler on torch.fx.

    engine = fxzero.compile(model, config=fxzero.Config(stage=3))
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn

from fxzero.ir import ops as _ops  # noqa: F401  (registers the fxzero:: operators)
from fxzero.compiler import CompiledProgram, compile_program
from fxzero.config import AdamW, Bucket, Config, Cpu, Device, LinkEmulation, Nvme, Offload, Prefetch, UnitsPolicy
from fxzero.runtime.engine import Engine

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "Bucket",
    "CompiledProgram",
    "Config",
    "Cpu",
    "Device",
    "Engine",
    "LinkEmulation",
    "Nvme",
    "Offload",
    "Prefetch",
    "UnitsPolicy",
    "compile",
    "compile_program",
]


def compile(
    model: nn.Module,
    config: Optional[Config] = None,
    *,
    state_dict: Optional[Mapping[str, torch.Tensor]] = None,
) -> Engine:
    """Compile `model` for ZeRO training on this process's ranks.

    Args:
        model: the module; build it under `torch.device("meta")` so no rank ever allocates
            the full parameters.
        config: stage, units and optimizer; defaults to `fxzero.Config()` (ZeRO-3, AdamW).
        state_dict: full initial values (e.g. a checkpoint), loaded unit by unit; without it a
            meta model is initialized by its modules' own `reset_parameters()`.
    """
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(
            f"config must be a fxzero.Config, got {type(config).__name__}; for a DeepSpeed "
            "dict use fxzero.Config.from_deepspeed(ds_config)"
        )
    return Engine(model, config, state_dict=state_dict)

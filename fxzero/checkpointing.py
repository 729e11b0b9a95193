"""DeepSpeed's `deepspeed.checkpointing`: activation checkpointing a model asks for itself.

A model that calls `deepspeed.checkpointing.checkpoint(block, hidden, mask)` (Megatron-style code,
DeepSpeed's examples) runs unchanged under `fxzero run`: inside a program fxzero compiles, the
call is a recompute region ([Note: recompute regions] in `fxzero/trace.py`), its interior
recomputed in the backward and its inputs kept, bit for bit with the call not checkpointed; run
eagerly (outside an engine), it is `torch.utils.checkpoint.checkpoint` (non-reentrant, which
recomputes with the RNG state restored, as DeepSpeed's).

`configure` takes DeepSpeed's arguments. Their effects are DeepSpeed's buffers (partitioning
checkpoints over model-parallel ranks, moving them to host memory, one contiguous buffer,
synchronizing at boundaries); fxzero has none of those, so each given is warned once as having
no effect, and a model-parallel unit (`mpu_`) is refused: fxzero has no model parallelism. The
`"activation_checkpointing"` section of a DeepSpeed config needs no call at all: it turns on
`Activations(recompute="unit")` for every unit of an unmodified model (`fxzero/config/deepspeed.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.utils.checkpoint

from fxzero.config.notices import warn_ineffective

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

_configured = False

_NO_EFFECT = {
    "partition_activations": "splits checkpoints over model-parallel ranks, which fxzero does not have",
    "contiguous_checkpointing": "copies checkpoints into one buffer; fxzero keeps the program's own tensors",
    "num_checkpoints": "sizes that buffer",
    "checkpoint_in_cpu": "moves checkpoints to host memory (activation offload is not in fxzero yet)",
    "synchronize": "synchronizes the device at each checkpoint; fxzero adds no host sync",
    "profile": "times the checkpointed forwards for DeepSpeed's log",
}


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, its activations recomputed in the backward instead of kept."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant variant: the same here."""


def configure(mpu_: Any, deepspeed_config: Optional[Any] = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's `checkpointing.configure`: accepted, each option given warned once as having no
    effect in fxzero (the module's docstring says why); `mpu_` (model parallelism) refused."""
    global _configured
    if mpu_ is not None:
        raise ValueError("deepspeed.checkpointing.configure(mpu_=...): a model-parallel unit partitions "
                         "checkpoints over model-parallel ranks, and fxzero has no model parallelism; pass None")
    given = dict(partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
                 num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
                 profile=profile)
    warn_ineffective([f"deepspeed.checkpointing.configure({name}=...) has no effect in fxzero: {_NO_EFFECT[name]}"
                      for name, value in given.items() if value])
    _configured = True


def is_configured() -> bool:
    """Whether `configure` was called (DeepSpeed's scripts check before configuring)."""
    return _configured


def reset() -> None:
    """DeepSpeed frees its checkpoint buffers here; fxzero keeps none between steps."""

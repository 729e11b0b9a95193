"""`deepspeed.moe.layer.MoE`: not in fxzero (no expert parallelism)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["MoE"]


class MoE(nn.Module):
    """DeepSpeed's mixture-of-experts layer: fxzero has no expert parallelism."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("deepspeed.moe.layer.MoE: fxzero has no mixture of experts (expert parallelism); "
                                  "train the dense model (for DeepSpeedExamples' cifar: without --moe)")

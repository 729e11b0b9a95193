"""`deepspeed.moe.utils` for dense models: no parameter is an expert's."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """False: fxzero builds no expert parameters (DeepSpeed marks them with `allreduce=False`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = 178956971) -> Any:
    """The param groups as given: with no expert parameters there is nothing to split out.

    Raises:
        NotImplementedError: a parameter marked as an expert's (by DeepSpeed's MoE layer)."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for group in groups:
        params = group["params"] if isinstance(group, dict) else [group]
        if any(is_moe_param(p) for p in params if isinstance(p, torch.Tensor)):
            raise NotImplementedError("mixture-of-experts parameters: fxzero has no expert parallelism")
    return tuple(groups) if isinstance(param_groups, tuple) else groups

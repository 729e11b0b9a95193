"""DeepSpeed's optimizer classes as a script builds them (`deepspeed.ops.adam.DeepSpeedCPUAdam`,
`FusedAdam`, `deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`, `deepspeed.ops.lion.DeepSpeedCPULion`,
`FusedLion`): objects fxzero reads, not runs.

A DeepSpeed script builds one of these and hands it to `initialize`; accelerate builds a
DeepSpeedCPUAdam from Hugging Face Trainer's optimizer when the config offloads the optimizer
states (a DeepSpeedCPULion for bitsandbytes' 32-bit Lion). Under fxzero each is a torch optimizer holding the param groups and the options given,
with DeepSpeed's defaults; `fxzero.initialize` reads them into the policy whose update runs on the
shards (`policy_class`: Adam or AdamW by `adamw_mode`, Adagrad), as it reads a torch optimizer.
The arithmetic is fxzero's (torch's formulas, as for the config's "Adam" type), not DeepSpeed's
C++ or CUDA kernels, which round differently in the last bits. Calling `step()` on the object
itself is an error naming `engine.step()`.
"""

from __future__ import annotations

from typing import Any

import torch

from fxzero.config.optimizers import Adagrad, Adam, AdamW, Lion, OptimizerPolicy

__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "DeepSpeedCPULion", "DeepSpeedOptimizerObject", "FusedAdam",
           "FusedLion"]


_TORCH_ONLY = ("decoupled_weight_decay", "foreach", "fused", "maximize", "capturable", "differentiable")
"""Options a torch optimizer's param groups carry that DeepSpeed's kernels never read: dropped from
groups handed over from one (accelerate passes a torch AdamW's `param_groups`, each with them)."""


class DeepSpeedOptimizerObject(torch.optim.Optimizer):
    """What the three share: options and param groups, no update of their own."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group({k: v for k, v in param_group.items() if k not in _TORCH_ONLY})

    def policy_class(self) -> type[OptimizerPolicy]:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        raise RuntimeError(f"{type(self).__name__}.step(): under fxzero this object holds the options and param "
                           "groups fxzero.initialize reads; the engine runs the update on its shards: call "
                           "engine.step()")


class DeepSpeedCPUAdam(DeepSpeedOptimizerObject):
    """DeepSpeed's `DeepSpeedCPUAdam` (its defaults): AdamW, or Adam with `adamw_mode=False`."""

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                            bias_correction=bias_correction))
        self.adamw_mode = adamw_mode

    def policy_class(self) -> type[OptimizerPolicy]:
        return AdamW if self.adamw_mode else Adam


class FusedAdam(DeepSpeedOptimizerObject):
    """DeepSpeed's `FusedAdam` (its defaults): AdamW, or Adam with `adam_w_mode=False`."""

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as DeepSpeed's); use "
                               "torch.optim.AdamW(amsgrad=True)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.adam_w_mode = adam_w_mode

    def policy_class(self) -> type[OptimizerPolicy]:
        return AdamW if self.adam_w_mode else Adam


class DeepSpeedCPUAdagrad(DeepSpeedOptimizerObject):
    """DeepSpeed's `DeepSpeedCPUAdagrad` (its defaults): Adagrad."""

    def __init__(self, model_params: Any, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant; leave it False")
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    def policy_class(self) -> type[OptimizerPolicy]:
        return Adagrad


class DeepSpeedCPULion(DeepSpeedOptimizerObject):
    """DeepSpeed's `DeepSpeedCPULion` (its defaults): Lion (`fxzero.Lion`: an element whose
    interpolation is exactly 0 is not moved, where DeepSpeed's kernel moves it by lr)."""

    def __init__(self, model_params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def policy_class(self) -> type[OptimizerPolicy]:
        return Lion


class FusedLion(DeepSpeedCPULion):
    """DeepSpeed's `FusedLion` (its defaults): Lion, as `DeepSpeedCPULion`."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)

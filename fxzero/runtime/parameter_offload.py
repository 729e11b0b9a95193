"""What programs reach for in DeepSpeed's ZeRO-3 optimizer: its `parameter_offload`.

[Note: DeepSpeed's parameter_offload]
DeepSpeed's ZeRO-3 optimizer keeps, as `optimizer.parameter_offload`, the object that installs
its gather hooks on every module (a `DeepSpeedZeRoOffload`). Programs reach into it: TRL's
online trainers (GRPO, RLOO, GKD, online DPO) generate inside `GatheredParameters(model.parameters())`
and, for speed, first remove DeepSpeed's hooks (`remove_hooks`: each parameter's
`ds_active_sub_modules.clear()`, each of `forward_hooks` and `backward_hooks` removed, both lists
emptied, reading `module.ds_external_parameters()` on the way), then put them back
(`add_hooks`: `param_coordinator._invalidate_trace()` unless `is_invalid_trace()`, then
`_register_deepspeed_module(module)`).

fxzero's hooks of that kind are those of direct calls at ZeRO-3 ([Note: calling a ZeRO-3 model
directly] in `fxzero/runtime/user_module.py`); the engine's own calls need none (each program
gathers what it uses). So `ParameterOffload` is a view of them: `forward_hooks` are their
handles, `backward_hooks` is empty (a direct call with gradients enabled is refused, so there
is nothing to gather in a backward), and `_register_deepspeed_module` registers them again.
Removed, a direct call of a sharded module computes from its meta placeholders, so its outputs
are meta tensors with no values (a DeepSpeed module without its hooks computes on empty
tensors); inside the gathered block every parameter is whole, which is how TRL calls it. `param_coordinator` keeps no trace to invalidate.
Every module of a ZeRO-3 model gets DeepSpeed's `ds_external_parameters()`: none, since the
trace sees every use of a parameter (`fxzero.zero.register_external_parameter` has nothing to
do).
"""

from __future__ import annotations

import types
from typing import Any, Iterator

import torch.nn as nn

__all__ = ["ParameterOffload", "give_external_parameters"]


class _ParamCoordinator:
    """DeepSpeed's `PartitionedParameterCoordinator`, as far as programs use it: fxzero's
    programs are static, so there is no recorded trace to invalidate."""

    def is_invalid_trace(self) -> bool:
        return True

    def _invalidate_trace(self) -> None:
        return None


class ParameterOffload:
    """`engine.optimizer.parameter_offload` at ZeRO-3 ([Note: DeepSpeed's parameter_offload])."""

    def __init__(self, user: Any) -> None:
        self._user = user
        self.module: nn.Module = user.model
        self.forward_hooks: list = list(user.call_hooks)
        self.backward_hooks: list = []
        self.param_coordinator = _ParamCoordinator()

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:
        """Put the direct-call hooks back on every module (any still there are replaced)."""
        if module is not self.module:
            raise ValueError(f"parameter_offload._register_deepspeed_module: {type(module).__name__} is not the "
                             "engine's module; fxzero registers the hooks of the module it trains")
        self._user.register_call_hooks()
        self.forward_hooks = list(self._user.call_hooks)


def _no_external_parameters(self: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return iter(())


def give_external_parameters(model: nn.Module) -> None:
    """Give every module DeepSpeed's `ds_external_parameters()` (none), where it has none."""
    for module in model.modules():
        if not hasattr(module, "ds_external_parameters"):
            module.ds_external_parameters = types.MethodType(_no_external_parameters, module)

"""The engine's optimizer as torch sees it: param groups a schedule can read and write.

`ShardedOptimizer` is a `torch.optim.Optimizer`, so torch's LR schedulers and DeepSpeed-style
ones (`fxzero/runtime/lr_schedules.py`) accept it: its `param_groups` hold the hyperparameters
of each group of the model's parameters (the policy's `HYPERPARAMETERS`: lr, betas, eps and
weight_decay for AdamW and Adam; lr, lr_decay, eps and weight_decay for Adagrad), and the
engine's update reads them at every step (the learning rate is an input of the step program's
updates, never a constant compiled into it). The state it updates is the engine's sharded state; each group's
"params" is one empty placeholder tensor, since no full parameter exists.

[Note: who steps]
The update runs in `engine.step()`, on every rank's shards, at the accumulation boundary. That
call then calls this optimizer's `step()`, which does nothing else: it exists so that torch's
schedulers, which count optimizer steps, see one. Called by anyone else it would update nothing,
so it refuses.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from fxzero.config import OPTIMIZERS, OptimizerPolicy

__all__ = ["ShardedOptimizer", "param_groups"]


def _options(policy: Optional[OptimizerPolicy]) -> tuple[str, ...]:
    """The options a param group may set: the policy's hyperparameters (None: any policy's)."""
    if policy is not None:
        return policy.HYPERPARAMETERS
    return tuple(dict.fromkeys(k for cls in OPTIMIZERS for k in cls.HYPERPARAMETERS))


def param_groups(model: nn.Module, given: Optional[Iterable[Any]],
                 optimizer: Optional[OptimizerPolicy] = None) -> tuple[list[dict], dict[str, int]]:
    """The hyperparameter overrides of each group and each parameter FQN's group, from what a
    user passes as `model_parameters` (tensors, or dicts of "params" plus options, as for a torch
    optimizer). None, or plain tensors: one group of every parameter.

    Args:
        optimizer: the policy whose hyperparameters a group may set (None: any policy's; then
            `ShardedOptimizer` checks them against its policy).

    Raises:
        ValueError: a parameter in two groups, a tensor that is not the model's, or an option
            the optimizer does not have.
    """
    options = _options(optimizer)
    named = dict(model.named_parameters(remove_duplicate=True))
    fqn_of = {id(p): fqn for fqn, p in named.items()}
    items = list(given) if given is not None else []
    if not items or all(isinstance(x, torch.Tensor) for x in items):
        return [{}], {}
    groups, group_of = [], {}
    for i, group in enumerate(items):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"model_parameters[{i}]: a param group is a dict with 'params' (and options "
                             f"{list(options)}), got {type(group).__name__}")
        _check_options(group, options, optimizer, f"model_parameters[{i}]")
        for p in group["params"]:
            fqn = fqn_of.get(id(p))
            if fqn is None:
                raise ValueError(f"model_parameters[{i}] holds a tensor that is not a parameter of the model")
            if fqn in group_of:
                raise ValueError(f"parameter {fqn!r} is in param groups {group_of[fqn]} and {i}; give each once")
            group_of[fqn] = i
        groups.append({k: v for k, v in group.items() if k in options})
    missing = sorted(f for f, p in named.items() if p.requires_grad and f not in group_of)
    if missing:  # like torch.optim: parameters not handed to the optimizer are not trained
        raise ValueError(f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} are in no param group; "
                         "fxzero trains every trainable parameter: add them to a group (or freeze them: "
                         "requires_grad_(False))")
    return groups, group_of


def _check_options(group: Mapping, options: tuple[str, ...], policy: Optional[OptimizerPolicy], where: str) -> None:
    unknown = sorted(set(group) - {"params", *options, "name"})
    if unknown:
        whose = f"{type(policy).__name__}'s" if policy is not None else "fxzero's"
        raise ValueError(f"{where}: unknown option(s) {unknown}; {whose} param groups take {list(options)}")


class ShardedOptimizer(torch.optim.Optimizer):
    """See the module doc and [Note: who steps].

    Args:
        policy: the optimizer policy; its `defaults()` fill what a group does not set.
        groups: each group's own hyperparameters (`param_groups`).
    """

    def __init__(self, policy: OptimizerPolicy, groups: list[dict]) -> None:
        for i, group in enumerate(groups):
            _check_options(group, policy.HYPERPARAMETERS, policy, f"param group {i}")
        super().__init__([{"params": [torch.empty(0)], **g} for g in groups], policy.defaults())
        self.policy = policy
        self._engine_steps = False

    def step(self, closure=None) -> None:  # noqa: D401 - see [Note: who steps]
        if not self._engine_steps:
            raise RuntimeError("the sharded update runs in engine.step(): call that (it steps this optimizer, "
                               "and the LR schedule, at each gradient accumulation boundary)")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine clears its gradient shards after each boundary step

    def mark_stepped(self) -> None:
        """Called by the engine after its update: one optimizer step, as torch's schedulers count."""
        self._engine_steps = True
        try:
            self.step()
        finally:
            self._engine_steps = False

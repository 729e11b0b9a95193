"""The engine's optimizer as torch sees it: param groups a schedule can read and write.

`ShardedOptimizer` is a `torch.optim.Optimizer`, so torch's LR schedulers and DeepSpeed-style
ones (`fxzero/runtime/lr_schedules.py`) accept it: its `param_groups` hold the hyperparameters
of each group of the model's parameters (the policy's `HYPERPARAMETERS`: lr, betas, eps,
weight_decay and amsgrad for AdamW and Adam; lr, lr_decay, eps and weight_decay for Adagrad; lr,
momentum, dampening, weight_decay and nesterov for SGD; ...), and the engine's update reads them
at every step (the learning rate is an input of the step program's updates, never a constant
compiled into it). The state it updates is the engine's sharded state; each group's "params" is
one empty placeholder tensor, since no full parameter exists, or, when `fxzero.initialize` was
given a torch optimizer, the groups are that optimizer's own dicts ([Note: a client's optimizer
and scheduler]).

[Note: who steps]
The update runs in `engine.step()`, on every rank's shards, at the accumulation boundary. That
call then calls this optimizer's `step()`, which does nothing else: it exists so that torch's
schedulers, which count optimizer steps, see one. Called by anyone else it would update nothing,
so it refuses.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn

from fxzero import _compat
from fxzero.runtime.optimizer_state import load_sharded_state_dict, sharded_state_dict
from fxzero.config import OPTIMIZERS, OptimizerPolicy
from fxzero.config.notices import print_once

__all__ = ["ParamGroups", "ShardedOptimizer", "param_groups"]


def _options(policy: Optional[OptimizerPolicy]) -> tuple[str, ...]:
    """The options a param group may set: the policy's hyperparameters (None: any policy's)."""
    if policy is not None:
        return policy.HYPERPARAMETERS
    return tuple(dict.fromkeys(k for cls in OPTIMIZERS for k in cls.HYPERPARAMETERS))


class ParamGroups(NamedTuple):
    """What `model_parameters` says about the optimizer's groups."""

    groups: list[dict]
    """Each group's own hyperparameters (the options it sets)."""
    group_of: dict[str, int]
    """Each grouped parameter's group (absent: group 0)."""
    ungrouped: frozenset[str]
    """Trainable parameters in no group: not trained ([Note: parameters in no group])."""


def param_groups(model: nn.Module, given: Optional[Iterable[Any]],
                 optimizer: Optional[OptimizerPolicy] = None) -> ParamGroups:
    """The hyperparameter overrides of each group, each parameter FQN's group, and the trainable
    parameters in none, from what a user passes as `model_parameters` (tensors, or dicts of
    "params" plus options, as for a torch optimizer). None: one group of every parameter.

    [Note: parameters in no group]
    DeepSpeed builds its optimizer from `model_parameters` alone, and its ZeRO optimizers
    partition, reduce and update only the parameters of that optimizer's param groups
    (deepspeed/runtime/zero/stage_1_and_2.py `DeepSpeedZeroOptimizer.__init__` and stage3.py
    `_get_trainable_parameter_groups` iterate `self.optimizer.param_groups`; `engine.py`
    `_configure_optimizer` builds the optimizer from `model_parameters`): a trainable parameter
    in none of them is used by the forward (at stage 3 gathered like any other) and never
    updated, its gradient neither reduced nor counted in the clipping norm, as torch.optim
    leaves a parameter it was not given. fxzero does the same by planning it frozen (its own
    `<unit>:frozen`, no gradient computed, no optimizer state) and says so once.

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
    if not items:
        return ParamGroups([{}], {}, frozenset())
    if all(isinstance(x, torch.Tensor) for x in items):
        items = [{"params": items}]  # one group of these tensors
    groups, group_of = [], {}
    for i, group in enumerate(items):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"model_parameters[{i}]: a param group is a dict with 'params' (and options "
                             f"{list(options)}), got {type(group).__name__}")
        _check_options(group, options, optimizer, f"model_parameters[{i}]")
        params = group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else params:
            fqn = fqn_of.get(id(p))
            if fqn is None:
                raise ValueError(f"model_parameters[{i}] holds a tensor that is not a parameter of the model")
            if fqn in group_of:
                raise ValueError(f"parameter {fqn!r} is in param groups {group_of[fqn]} and {i}; give each once")
            group_of[fqn] = i
        groups.append({k: v for k, v in group.items() if k in options})
    ungrouped = sorted(f for f, p in named.items() if p.requires_grad and f not in group_of)
    if ungrouped:
        print_once([f"parameters {ungrouped[:5]}{' ...' if len(ungrouped) > 5 else ''} ({len(ungrouped)}) are in "
                    "no param group of model_parameters: they are not trained, as under DeepSpeed and torch.optim "
                    "(fxzero keeps them frozen: no gradient, no optimizer state); add them to a group to train them"])
    return ParamGroups(groups, group_of, frozenset(ungrouped))


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

    Raises:
        ValueError: a group sets an option the policy does not have, or one that needs a state
            the policy does not keep (`OptimizerPolicy.check_group`).
    """

    def __init__(self, policy: OptimizerPolicy, groups: list[dict]) -> None:
        for i, group in enumerate(groups):
            _check_options(group, policy.HYPERPARAMETERS, policy, f"param group {i}")
        self._built = False
        super().__init__([{"params": [torch.empty(0)], **g} for g in groups], policy.defaults())
        self._built = True
        self._planned_groups = len(groups)
        self.policy = policy
        self._engine_steps = False
        self.check_groups()

    _ADDED = ("the engine was built: fxzero plans each parameter's unit, gradient and optimizer state when it "
              "builds the engine, so the parameters of a group added now would never be trained. Give every group to "
              "fxzero.initialize (model_parameters=[{'params': ..., 'lr': ...}, ...]) or to the optimizer passed to "
              "it; a group's hyperparameters may change at any time through optimizer.param_groups[i]")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_built", False):  # (torch's __init__ adds the groups it was given)
            return super().add_param_group(param_group)
        raise RuntimeError(f"optimizer.add_param_group after {self._ADDED}")

    def check_group_count(self) -> None:
        """Before each update: no group was added (to a client optimizer whose groups this one shares)."""
        if len(self.param_groups) != self._planned_groups:
            raise RuntimeError(f"the optimizer has {len(self.param_groups)} param groups, {self._planned_groups} when "
                               f"{self._ADDED}")

    def check_groups(self) -> None:
        """Every group's options within what the policy's states allow (a schedule may have set them)."""
        for i, group in enumerate(self.param_groups):
            self.policy.check_group(group, f"param group {i}")

    def step(self, closure=None) -> None:  # noqa: D401 - see [Note: who steps]
        if not self._engine_steps:
            raise RuntimeError("the sharded update runs in engine.step(): call that (it steps this optimizer, "
                               "and the LR schedule, at each gradient accumulation boundary)")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine clears its gradient shards after each boundary step

    def attach(self, engine: Any) -> None:
        """The engine whose shards this optimizer's states are (a weak reference)."""
        self._engine_ref = weakref.ref(engine)

    def _engine(self, what: str) -> Any:
        engine = self._engine_ref() if getattr(self, "_engine_ref", None) is not None else None
        if engine is None:
            raise RuntimeError(f"optimizer.{what}: this optimizer's states are an engine's shards, and it has none "
                               "(built, or gone): call it on engine.optimizer")
        return engine

    def state_dict(self) -> dict[str, Any]:  # noqa: D401 - see [Note: the optimizer's own state dict]
        """This rank's optimizer shards, the param groups and the loss scaler, as DeepSpeed's ZeRO
        optimizers give theirs; no collective ([Note: the optimizer's own state dict])."""
        return sharded_state_dict(self._engine("state_dict()"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put back what `state_dict()` gave on this rank of a run of the same world size, model
        and optimizer; anything else is refused naming the difference."""
        load_sharded_state_dict(self._engine("load_state_dict()"), state_dict)

    def mark_stepped(self) -> None:
        """Called by the engine after its update: one optimizer step, as torch's schedulers count."""
        self._engine_steps = True
        try:
            self.step()
        finally:
            self._engine_steps = False

    # -- a client's torch optimizer and scheduler ([Note: a client's optimizer and scheduler]) --

    def share_groups(self, client: torch.optim.Optimizer) -> None:
        """Read and write the client optimizer's own param group dicts from now on.

        [Note: a client's optimizer and scheduler]
        DeepSpeed's ZeRO optimizers wrap the client's torch optimizer and read its `param_groups`
        (the same dicts) at every step, so a scheduler built on the client's optimizer before
        `deepspeed.initialize`, a script that writes `optimizer.param_groups[i]["lr"]` on either
        object, and DeepSpeed's engine all see one set of values. fxzero does the same: the
        engine's optimizer takes the client's list of group dicts as its own (their "params" are
        the model's parameters: placeholders where sharded, so no memory), and a scheduler built
        on the client's optimizer is pointed at the engine's (`adopt_scheduler`), which is the
        one stepped, so torch's check that the optimizer steps before the scheduler holds.
        """
        if len(client.param_groups) != len(self.param_groups):
            raise ValueError(f"the client optimizer has {len(client.param_groups)} param groups and the engine's "
                             f"{len(self.param_groups)}")
        self.param_groups = client.param_groups
        self.check_groups()

    def adopt_scheduler(self, scheduler: Any, client: Optional[torch.optim.Optimizer]) -> Any:
        """Point `scheduler` (and the schedulers it chains: SequentialLR, ChainedScheduler), built
        on `client`, at this optimizer ([Note: a client's optimizer and scheduler]); returns it.

        Raises:
            TypeError: an object without `step()` and `optimizer`.
            ValueError: a scheduler built on an optimizer that is neither this one nor `client`.
        """
        if not callable(getattr(scheduler, "step", None)) or not hasattr(scheduler, "optimizer"):
            raise TypeError(f"lr_scheduler is a {type(scheduler).__name__}: give a scheduler (an object with step() "
                            "and .optimizer, as torch.optim.lr_scheduler's) or a callable taking the engine's "
                            "optimizer and returning one")
        for s in _chained(scheduler):
            if s.optimizer is not self and (client is None or s.optimizer is not client):
                raise ValueError(
                    f"lr_scheduler ({type(s).__name__}) was built on a {type(s.optimizer).__name__} that is not the "
                    "optimizer passed to fxzero.initialize, so the learning rates it writes would reach nothing "
                    "fxzero trains with: build it on that optimizer (initialize(optimizer=opt, "
                    "lr_scheduler=StepLR(opt, ...))), or pass a callable that builds it on the engine's "
                    "(lr_scheduler=lambda opt: StepLR(opt, ...))")
        for s in _chained(scheduler):
            s.optimizer = self
        _track_step_for_schedulers(self)
        self.check_groups()
        return scheduler


def _chained(scheduler: Any) -> list[Any]:
    """The scheduler and every scheduler it steps (SequentialLR's and ChainedScheduler's `_schedulers`)."""
    out = [scheduler]
    for inner in getattr(scheduler, "_schedulers", None) or ():
        out += _chained(inner)
    return out


def _track_step_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """What torch's `LRScheduler.__init__` does to the optimizer it is built on, for one built on
    another and pointed here: mark `step()` as tracked and note each call, so the scheduler's check
    "optimizer.step() before lr_scheduler.step()" sees the engine's steps (torch/optim/lr_scheduler.py
    `patch_track_step_called`)."""
    if hasattr(optimizer.step, _compat.LR_SCHEDULER_TRACKS_STEP):
        return
    func, ref = optimizer.step.__func__, weakref.ref(optimizer)  # (no reference cycle through the wrapper)

    @functools.wraps(func)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        setattr(opt, _compat.LR_SCHEDULER_SAW_STEP, True)
        return func.__get__(opt, type(opt))(*args, **kwargs)

    setattr(tracked, _compat.LR_SCHEDULER_TRACKS_STEP, True)
    optimizer.step = tracked  # type: ignore[method-assign]

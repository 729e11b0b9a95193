"""torch.optim's own arithmetic on one range of a shard: SGD, Adamax, NAdam, RAdam, RMSprop,
Adadelta, ASGD, Rprop, and Adam/AdamW with AMSGrad.

[Note: torch's arithmetic on a shard]
An element-wise optimizer updates each element from that element's parameter, gradient and
states, plus numbers that are the same for every element of a parameter: the step count, the
group's hyperparameters, and per-parameter scalars some optimizers keep (NAdam's mu_product,
ASGD's eta and mu). A range of a flat shard (elements of one param group, from one or several
adjacent parameters) is then to torch's single-tensor implementation a tensor like any other:
called on the range's views of the parameter, gradient and states, with the scalars and the step
count the range's parameters have, it computes for those elements exactly what it computes for
them when it updates the whole parameters, bit for bit (the same operations, element by element).
So rather than writing each optimizer again, fxzero calls torch's functional update
(`torch.optim.<module>.<name>(..., foreach=False)`, imported through `fxzero/_compat.py`) on
one-element lists per range, as torch's `Optimizer.step` calls it on its lists of parameters:

- the step count is a fresh scalar tensor holding the unit's count so far (torch increments it);
- a per-parameter scalar (`SCALAR_STATES`) is kept per element, so the range's first element is
  read into a scalar tensor, updated by torch, and written back over the whole range;
- a state torch creates lazily at a parameter's first step (SGD's momentum buffer: a copy of the
  gradient, `None` before) is passed as `None` at the unit's first update and copied in after;
- a state torch initializes from the param group at the first step (ASGD's eta, Rprop's step
  sizes: the group's lr) is filled with that value before the first update;
- a state the group's options do not use (RMSprop's momentum buffer when its momentum is 0) is
  passed as an empty list, as torch passes none.

The policies name their states as torch's `optimizer.state[p]` does, in `fxzero/config/optimizers.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from fxzero import _compat
from fxzero.config import ASGD, SGD, Adadelta, Adam, Adamax, AdamW, NAdam, OptimizerPolicy, RAdam, RMSprop, Rprop

__all__ = ["has_torch_update", "torch_update"]

STEP = "step"
"""Stands for the step-count list among a functional's tensor lists."""


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How to call one torch functional update."""

    function: Callable[..., None]
    """torch's functional update (`foreach=False`: its single-tensor implementation)."""
    lists: tuple[str, ...]
    """Its tensor-list arguments after params and grads, in its order: state names and `STEP`."""
    options: Callable[[Mapping[str, Any]], dict[str, Any]]
    """Its keyword arguments from a param group."""
    lazy: tuple[str, ...] = ()
    """States torch creates at a parameter's first step (None before it)."""
    from_lr: tuple[str, ...] = ()
    """States torch fills with the group's lr at a parameter's first step."""


_PLAIN = dict(foreach=False, maximize=False, differentiable=False, capturable=False, has_complex=False)
"""The path fxzero runs: single-tensor, minimizing, not differentiable, not capturable, real."""


def _betas(g: Mapping[str, Any]) -> dict[str, float]:
    beta1, beta2 = g["betas"]
    return dict(beta1=beta1, beta2=beta2)


_SPECS: dict[type[OptimizerPolicy], _Spec] = {
    SGD: _Spec(_compat.sgd_update, ("momentum_buffer",), lambda g: dict(
        weight_decay=g["weight_decay"], momentum=g["momentum"], lr=g["lr"], dampening=g["dampening"],
        nesterov=g["nesterov"], maximize=False, foreach=False, fused=False), lazy=("momentum_buffer",)),
    AdamW: _Spec(_compat.adam_update, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", STEP), lambda g: dict(
        _PLAIN, fused=False, decoupled_weight_decay=True, amsgrad=g["amsgrad"], lr=g["lr"], **_betas(g),
        weight_decay=g["weight_decay"], eps=g["eps"])),
    Adam: _Spec(_compat.adam_update, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", STEP), lambda g: dict(
        _PLAIN, fused=False, decoupled_weight_decay=False, amsgrad=g["amsgrad"], lr=g["lr"], **_betas(g),
        weight_decay=g["weight_decay"], eps=g["eps"])),
    Adamax: _Spec(_compat.adamax_update, ("exp_avg", "exp_inf", STEP), lambda g: dict(
        _PLAIN, eps=g["eps"], **_betas(g), lr=g["lr"], weight_decay=g["weight_decay"])),
    NAdam: _Spec(_compat.nadam_update, ("exp_avg", "exp_avg_sq", "mu_product", STEP), lambda g: dict(
        _PLAIN, decoupled_weight_decay=g["decoupled_weight_decay"], **_betas(g), lr=g["lr"],
        weight_decay=g["weight_decay"], momentum_decay=g["momentum_decay"], eps=g["eps"])),
    RAdam: _Spec(_compat.radam_update, ("exp_avg", "exp_avg_sq", STEP), lambda g: dict(
        _PLAIN, decoupled_weight_decay=g["decoupled_weight_decay"], **_betas(g), lr=g["lr"],
        weight_decay=g["weight_decay"], eps=g["eps"])),
    RMSprop: _Spec(_compat.rmsprop_update, ("square_avg", "grad_avg", "momentum_buffer", STEP), lambda g: dict(
        _PLAIN, lr=g["lr"], alpha=g["alpha"], eps=g["eps"], weight_decay=g["weight_decay"], momentum=g["momentum"],
        centered=g["centered"])),
    Adadelta: _Spec(_compat.adadelta_update, ("square_avg", "acc_delta", STEP), lambda g: dict(
        _PLAIN, lr=g["lr"], rho=g["rho"], eps=g["eps"], weight_decay=g["weight_decay"])),
    ASGD: _Spec(_compat.asgd_update, ("ax", "mu", "eta", STEP), lambda g: dict(
        _PLAIN, lambd=g["lambd"], lr=g["lr"], t0=g["t0"], alpha=g["alpha"], weight_decay=g["weight_decay"]),
        from_lr=("eta",)),
    Rprop: _Spec(_compat.rprop_update, ("prev", "step_size", STEP), lambda g: dict(
        _PLAIN, step_size_min=g["step_sizes"][0], step_size_max=g["step_sizes"][1], etaminus=g["etas"][0],
        etaplus=g["etas"][1]), from_lr=("step_size",)),
}


def has_torch_update(policy: OptimizerPolicy) -> bool:
    return type(policy) in _SPECS


def torch_update(policy: OptimizerPolicy, param: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor],
                 step: int, group: Mapping[str, Any]) -> None:
    """One range's update with torch's functional update ([Note: torch's arithmetic on a shard]).

    Args:
        states: the range's view of each state the policy keeps, by name, updated in place.
        step: this update's count, from 1.
        group: the param group's hyperparameters.
    """
    spec = _SPECS[type(policy)]
    used = policy.uses(group)  # (a state the policy keeps but these options do not use: torch passes none)
    scalar_dtype = _compat.optimizer_scalar_dtype()
    first = step == 1
    if first:
        for name in spec.from_lr:
            states[name].fill_(torch.as_tensor(group["lr"], dtype=scalar_dtype).item())
    lists: list[list] = []
    scalars: dict[str, torch.Tensor] = {}
    for name in spec.lists:
        if name == STEP:
            lists.append([torch.tensor(float(step - 1), dtype=scalar_dtype)])
        elif name not in used:
            lists.append([])
        elif name in policy.SCALAR_STATES:
            scalars[name] = torch.tensor(states[name][0].item(), dtype=scalar_dtype)
            lists.append([scalars[name]])
        elif name in spec.lazy and first:
            lists.append([None])
        else:
            lists.append([states[name]])
    spec.function([param], [grad], *lists, **spec.options(group))
    for name, value in scalars.items():
        states[name].fill_(value.item())
    if first:
        for name in spec.lazy:
            created = lists[spec.lists.index(name)]
            if created and created[0] is not None:
                states[name].copy_(created[0])

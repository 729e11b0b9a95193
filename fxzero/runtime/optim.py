"""The update of one unit's shard, per parameter group: AdamW, Adam, Adagrad, Lion and LAMB
written here, every other optimizer policy by torch's own single-tensor update on the shard's
ranges (`fxzero/runtime/torch_updates.py`, [Note: torch's arithmetic on a shard]).

Each optimizer policy declares the states it keeps per element ([Note: optimizer states] in
`fxzero/config/policies.py`); `optim_step` takes them as a list in that order, wherever they
live (the device, or buffers fetched from a tier), and runs the policy's arithmetic on them.
AdamW, Adam and Adagrad are written here, with torch.optim's single-tensor operations in the same
order (so the same bits), because they are the ones people train large models with: their
temporaries go in one reused buffer rather than a fresh allocation per unit and step. Lion has
no torch implementation to call.

A unit's shard may hold parameters of several groups (say, a block's weights with weight decay
and its norms and biases without): `UnitLayout.grouped_shard_ranges` cuts the shard into element ranges that each
belong to one group, and the update reads that group's hyperparameters (the policy's
`HYPERPARAMETERS`) from the optimizer's `param_groups` at every step, so an LR schedule that
writes `param_groups[i]["lr"]` (or a momentum schedule, `betas`) drives the sharded step.

[Note: the update's dtype]
The gradient reaches the update in the masters' dtype. Where the masters and the states share
one dtype (fp32 masters and states; or bfloat16 masters with bfloat16 states, [Note:
low-precision masters] in `fxzero/config/precision.py`) the update runs on them as they are, as
torch.optim steps a parameter in its own dtype with states in that dtype. Where they differ
(bfloat16 masters with fp32 states, or the reverse), each range's parameter, gradient and
low-precision states are widened to fp32, updated there, and rounded back: what DeepSpeedCPUAdam
does with `fp32_optimizer_states` on bf16 parameters.

[Note: sums over whole parameters]
LAMB's trust ratio divides the norm of each whole parameter by the norm of its whole update, and
a rank's shard holds pieces of several parameters and most of none. A norm is the square root of
a sum of squares, and sums add over ranks, as the clipping norm does ([Note: clipping from
shards] in `stepping.py`) with one number for the whole model: here it is one number per
parameter and per sum the update needs (`OptimizerPolicy.WHOLE_PARAMETER_SUMS`). The update of a
unit then runs in two passes over its shard: the first updates the states and writes each
element's update into a scratch buffer, summing, per parameter, the squares of the weight and of
the update over the elements this rank holds (`UnitLayout.param_shard_ranges`: padding is in no
parameter's range, and a parameter this rank holds none of sums to 0); one all-reduce of that
(parameters x sums) matrix gives every rank the whole tensors' sums; the second pass applies
each parameter's update scaled by its ratio, the same on every rank. Every rank issues that
all-reduce for every unit it updates, whether or not its shard holds any of the unit's
parameters, with a length set by the layout alone and in the order of the program's updates, so
the ranks always pair the same collectives; the engine adds them to the collective sequence the
ranks compare before each forward ([Note: one collective sequence] in `agreement.py`). The
cost: 8 bytes per parameter (not per element) per step, and one collective's latency per unit.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from fxzero.config import Adagrad, Adam, AdamW, Lamb, Lion, OptimizerPolicy
from fxzero.runtime.torch_updates import has_torch_update, torch_update

__all__ = ["WholeSums", "optim_step"]


class WholeSums(NamedTuple):
    """What an update that needs sums over whole parameters gets ([Note: sums over whole parameters])."""

    ranges: list[tuple[int, int, int, int]]
    """(lo, hi, group, slot) per parameter with elements in this shard (`UnitLayout.param_shard_ranges`)."""
    params: int
    """The unit's parameter count: the rows of the summed matrix, the same on every rank."""
    reduce: Callable[[torch.Tensor], torch.Tensor]
    """Sums a tensor over the ranks, in place, and returns it once every rank's part is in."""


@torch.no_grad()
def optim_step(policy: OptimizerPolicy, param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
               step: int, groups: list[dict], ranges: list[tuple[int, int, int]],
               whole: Optional[WholeSums] = None) -> None:
    """One update of flat `param` in place, with `policy`'s arithmetic.

    Args:
        states: the policy's states for this shard (`policy.states`, in that order), in place.
        step: this update's count, from 1 (Adam's bias correction, Adagrad's lr decay).
        groups: the optimizer's param_groups (each with the policy's `HYPERPARAMETERS`).
        ranges: (lo, hi, group) element ranges to update; elements outside (parameters that got
            no gradient, padding) are left untouched, as torch.optim skips a parameter whose
            .grad is None.
        whole: for a policy with `WHOLE_PARAMETER_SUMS`, the same elements per parameter and
            the all-reduce of their sums; it updates from those (`ranges` unused).

    Raises:
        RuntimeError: a param group's options (set by a schedule, say) need a state the policy
            does not keep.
    """
    names = policy.states
    assert len(states) == len(names), (type(policy).__name__, len(states))
    for g in sorted({r[2] for r in (whole.ranges if whole is not None else ranges)}):
        try:
            policy.check_group(groups[g], f"param group {g}")
        except ValueError as e:
            raise RuntimeError(f"[rank {_rank()}] {e}") from None
    if policy.WHOLE_PARAMETER_SUMS:
        assert whole is not None, f"{type(policy).__name__} updates from sums over whole parameters"
        _lamb(policy, param, grad, dict(zip(names, states)), step, groups, whole)
        return
    update = _arithmetic(policy)
    # [Note: the update's dtype]: one dtype where parameter and states share it, else fp32.
    work = param.dtype if all(s.dtype == param.dtype for s in states) else torch.float32
    for lo, hi, g in ranges:
        held = [param[lo:hi], *(s[lo:hi] for s in states)]
        wide = [t.to(work) for t in held]  # (the tensors themselves where already in `work`)
        update(policy, wide[0], grad[lo:hi].to(work), dict(zip(names, wide[1:])), step, groups[g])
        for t, w in zip(held, wide):
            if w.dtype != t.dtype:
                t.copy_(w)  # rounded back into the dtype it is held in


_Arithmetic = Callable[[OptimizerPolicy, torch.Tensor, torch.Tensor, dict, int, dict], None]
"""(policy, param, grad, states by name, step, group hyperparameters): one range of a shard, in place."""


def _arithmetic(policy: OptimizerPolicy) -> _Arithmetic:
    if isinstance(policy, AdamW) and policy.fused:
        return _fused_adam
    if isinstance(policy, AdamW) and not policy.amsgrad:  # Adam too: L2 weight decay instead of decoupled
        return _adam
    if isinstance(policy, Adagrad):
        return _adagrad
    if isinstance(policy, Lion):
        return _lion
    if has_torch_update(policy):
        return torch_update
    raise TypeError(f"no update for optimizer {type(policy).__name__}")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """A reused buffer for the denominator: a fresh one per unit would cost a page fault per
    4 KiB on every step (the allocator unmaps large blocks when they are freed)."""
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _SCRATCH[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view_as(like)


def _adam(policy, param, grad, states, step: int, hp: dict) -> None:
    exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
    lr, (beta1, beta2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    if not isinstance(policy, Adam):  # AdamW: decoupled weight decay
        param.mul_(1 - lr * wd)
    elif wd:
        grad = grad.add(param, alpha=wd)  # torch.optim.Adam: L2 on the gradient
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # (Without bias correction, DeepSpeed's FusedAdam(bias_correction=False): both factors are 1.)
    bias_correction1 = 1 - beta1**step if policy.bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if policy.bias_correction else 1.0
    step_size = lr / bias_correction1
    # (sqrt(v) / sqrt(bc2)) + eps, the same operations as torch.optim.AdamW, in one buffer.
    denom = torch.sqrt(exp_avg_sq, out=_scratch(exp_avg_sq)).div_(math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _fused_adam(policy, param, grad, states, step: int, hp: dict) -> None:
    """`AdamW(fused=True)` (Adam too): torch's fused kernel on one range, as `torch.optim.AdamW(fused=True)`
    runs it on a whole tensor; element-wise, so a range of a flat shard is updated as its elements
    would be in the whole parameters."""
    (beta1, beta2) = hp["betas"]
    amsgrad = bool(hp.get("amsgrad", False))
    kernel = torch._fused_adam_ if isinstance(policy, Adam) else torch._fused_adamw_
    kernel([param], [grad], [states["exp_avg"]], [states["exp_avg_sq"]],
           [states["max_exp_avg_sq"]] if amsgrad else [],
           [torch.tensor(float(step), dtype=torch.float32, device=param.device)],
           lr=hp["lr"], beta1=beta1, beta2=beta2, weight_decay=hp["weight_decay"], eps=hp["eps"],
           amsgrad=amsgrad, maximize=False)


def _adagrad(policy, param, grad, states, step: int, hp: dict) -> None:
    state_sum = states["sum"]
    lr, lr_decay, eps, wd = hp["lr"], hp["lr_decay"], hp["eps"], hp["weight_decay"]
    if wd != 0:
        grad = grad.add(param, alpha=wd)  # torch.optim.Adagrad: L2 on the gradient
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum.addcmul_(grad, grad, value=1)
    # sqrt(sum) + eps, the same operations as torch.optim.Adagrad, in one buffer.
    std = torch.sqrt(state_sum, out=_scratch(state_sum)).add_(eps)
    param.addcdiv_(grad, std, value=-clr)


def _lion(policy, param, grad, states, step: int, hp: dict) -> None:
    """Lion's update (`fxzero.Lion`): the sign of the interpolation of momentum and gradient,
    decoupled weight decay, then the momentum's own running average."""
    exp_avg = states["exp_avg"]
    lr, (beta1, beta2), wd = hp["lr"], hp["betas"], hp["weight_decay"]
    direction = torch.mul(exp_avg, beta1, out=_scratch(exp_avg)).add_(grad, alpha=1 - beta1).sign_()
    if wd:
        param.mul_(1 - lr * wd)
    param.add_(direction, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


# -- LAMB ([Note: sums over whole parameters]) ----------------------------------------------------


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    return torch.dot(x, x) if x.dtype == torch.float32 else torch.dot(x.float(), x.float())


def _lamb(policy: Lamb, param: torch.Tensor, grad: torch.Tensor, states: dict, step: int, groups: list[dict],
          whole: WholeSums) -> None:
    """`fxzero.Lamb` on a unit's shard: DeepSpeed's FusedLamb kernel per parameter, its two norms
    summed from every rank's elements of it. Computes in the states' dtype, the parameter widened
    to it where it is narrower ([Note: the update's dtype], as the element-wise updates)."""
    exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
    work = exp_avg.dtype
    widen = param.dtype != work
    update = _scratch(exp_avg)  # each element's update, between the two passes
    sums = torch.zeros(whole.params, 2, dtype=torch.float32, device=param.device)  # |p|^2, |u|^2 per parameter
    for lo, hi, g, i in whole.ranges:
        hp = groups[g]
        (beta1, beta2), eps, wd = hp["betas"], hp["eps"], hp["weight_decay"]
        p, gr, m, v, u = param[lo:hi].to(work), grad[lo:hi].to(work), exp_avg[lo:hi], exp_avg_sq[lo:hi], update[lo:hi]
        m.mul_(beta1).add_(gr, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(gr, gr, value=1 - beta2)
        if policy.eps_inside_sqrt:
            torch.add(v, eps, out=u).sqrt_()
        else:
            torch.sqrt(v, out=u).add_(eps)
        torch.div(m, u, out=u)
        if wd:
            u.add_(p, alpha=wd)
        sums[i, 0] = _sum_of_squares(p)
        sums[i, 1] = _sum_of_squares(u)
    norms = whole.reduce(sums).sqrt_()
    # The kernel's ratio: |p| / |u| clamped from above, then from below, where both norms are
    # nonzero; 1, unclamped, where either is 0.
    nonzero = (norms[:, 0] != 0) & (norms[:, 1] != 0)
    ratio = norms[:, 0] / norms[:, 1]
    for lo, hi, g, i in whole.ranges:
        hp = groups[g]
        lr, (beta1, beta2) = hp["lr"], hp["betas"]
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step) if hp["bias_correction"] else lr
        coeff = torch.where(nonzero[i], ratio[i].clamp(max=hp["max_coeff"]).clamp(min=hp["min_coeff"]), 1.0)
        p = param[lo:hi].to(work) if widen else param[lo:hi]
        p.addcmul_(update[lo:hi], coeff.mul_(step_size), value=-1)  # p - (step_size * coeff) * u, the kernel's order
        if widen:
            param[lo:hi].copy_(p)  # rounded back into the masters' dtype

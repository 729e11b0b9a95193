"""Gradients computed outside the engine's programs, carried into its gradient shards.

[Note: gradients from outside the program]
fxzero trains through its compiled programs: the forward program's backward reduce-scatters each
unit's gradient into this rank's shard, and the step program updates the shards. At ZeRO-1/2
(and for a ZeRO-3 unit held whole) every rank also holds the whole parameters, and the user's
module is a view of them ([Note: the user's module]), so autograd can reach them without a
program in two ways, both common in DeepSpeed programs:

- a forward the trace cannot follow: a Python decision on a tensor's value (`.item()`,
  `if mask.any():`, a loop over a batch's rows to find each one's padding, as DeepSpeed-Chat's
  reward model does). The engine runs it eagerly (`Engine._call`), as DeepSpeed and FSDP run
  every model;
- a loss term through a module called directly, beside the engine's output or alone
  (`engine(x).sum() + model.head(y).sum()`; DeepSpeedExamples' GAN calls its modules so).

Autograd leaves those gradients on the module's own parameters. `engine.backward` collects them
and hands them to the engine's gradient path through a program of their own, compiled from a
`GradientProbe`: a module with the model's parameters under the same names, whose forward takes
the gradients g as inputs and returns the sum over parameters of (p * g_p).sum(). Its gradient
with respect to each p is 1 * g_p: g_p exactly. Its backward is an ordinary fxzero backward, so
everything a gradient goes through is the one implementation: the cast to the reduce dtype,
the reduce-scatter (or, accumulating locally, the full gradients kept), accumulation into the
shard held (a micro-step with both kinds of gradient adds them there, as two forwards into one
loss do), float16 overflow checks, gradient offload; and its step program is the update.

The ranks must run the same program, so they agree first, in two steps:

- Whether any rank's backward reaches the module's parameters. After a forward run eagerly every
  rank knows (the ranks agreed on running it so at its start). Otherwise each rank walks its
  loss's autograd graph for the parameters' gradient accumulators (`reaches`) before the
  backward and the ranks sum that one flag, issued before the backward's reduce-scatters and
  waited for after them: it does not wait for them, so the gradients still reach the step in
  flight ([Note: gradients carried into the step] in `passes/step_program.py`). Where no rank's
  does, nothing more happens: the cost of all this to a model trained through `engine(...)`
  alone is that walk of a graph of a few nodes and one all-reduce of 4 bytes a backward.
- Which parameters have a gradient: one flag per parameter summed over the ranks after the
  backward. A parameter with a gradient on some rank gets zeros where it has none (as DDP
  reduces), and one with a gradient on no rank is left out, so the update skips it as torch's
  optimizers skip a parameter whose `.grad` is None.

What it costs: the gradients live whole on every rank until the reduction (2 bytes per parameter
in bf16, as DDP's), and the probe's forward reads every parameter once. What it does not give:
a forward run eagerly is not a program, so nothing of it overlaps, `Activations` recompute and
offload do not apply to it, and `fxzero schedule` shows only the reduction and the step. At
ZeRO-3 a sharded parameter has no value until gathered: such a forward gathers every unit at its
start and holds them until its backward ends ([Note: a forward run eagerly at ZeRO-3] in
`fxzero/runtime/user_module.py`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn as nn

__all__ = ["GradientProbe", "reaches"]


def reaches(loss: torch.Tensor, params: Iterable[torch.Tensor]) -> bool:
    """Whether a backward from `loss` accumulates into one of `params`: its autograd graph holds
    one of their gradient accumulators. (A reentrant `torch.utils.checkpoint` hides what its
    region reaches until its own backward runs; `Engine.backward` says so where that happens.)"""
    wanted = {id(p) for p in params}
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # (an AccumulateGrad node's leaf)
        if variable is not None and id(variable) in wanted:
            return True
        stack.extend(child for child, _ in node.next_functions)
    return False


class GradientProbe(nn.Module):
    """The model's parameters under their own names, and a forward whose gradient with respect
    to each parameter named in `fqns` is the tensor passed for it ([Note: gradients from outside
    the program])."""

    def __init__(self, model: nn.Module, fqns: Sequence[str]) -> None:
        super().__init__()
        for fqn, param in model.named_parameters(remove_duplicate=True):
            owner: nn.Module = self
            *path, name = fqn.split(".")
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            owner.register_parameter(name, param)
        self.fqns = tuple(fqns)

    def forward(self, *grads: torch.Tensor) -> torch.Tensor:
        if len(grads) != len(self.fqns):
            raise ValueError(f"GradientProbe takes one gradient per parameter named ({len(self.fqns)}), "
                             f"got {len(grads)}")
        total = None
        for fqn, grad in zip(self.fqns, grads):
            owner: nn.Module = self
            *path, name = fqn.split(".")
            for part in path:
                owner = owner._modules[part]
            term = (getattr(owner, name) * grad).sum()  # (not get_parameter: a trace's values are plain tensors)
            total = term if total is None else total + term
        return total

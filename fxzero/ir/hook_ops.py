"""`fxzero::grad_hook`: a gradient hook the user registered on a parameter, as an operator of the
backward program ([Note: gradient hooks on parameters] in `fxzero/trace.py`).

The trace registers on each parameter's stand-in a hook that calls this operator with the key of
the user's hook, so the backward program holds one `grad_hook` node per hook where torch's
backward would call it: on the parameter's gradient as computed, before it is accumulated. At run
time the node calls the user's function on the real gradient, eagerly, so whatever it does runs as
under torch (tensors it closes over, Python, logging); the trace never looks inside it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Mapping

import torch
import torch.nn as nn

__all__ = ["grad_hook", "hook_key", "hooks_signature"]

_HOOKS: "weakref.WeakValueDictionary[int, Callable]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def hook_key(hook: Callable) -> int:
    """A key for `hook` that the program's node carries (the function is held weakly: the
    parameter's own hook list keeps it while it is registered)."""
    key = next(_KEYS)
    _HOOKS[key] = hook
    return key


@torch.library.custom_op("fxzero::grad_hook", mutates_args=())
def grad_hook(grad: torch.Tensor, key: int) -> torch.Tensor:
    """The user's hook `key` on (a copy of) `grad`: its result, or the copy it may have changed in
    place when it returns None, as torch takes a hook's result."""
    hook = _HOOKS.get(key)
    if hook is None:
        raise RuntimeError("fxzero::grad_hook: the gradient hook this program was traced with is gone (removed "
                           "from its parameter); the engine traces again at its next forward")
    mine = grad.clone()
    out = hook(mine)
    if out is None:
        return mine
    if not isinstance(out, torch.Tensor) or out.shape != grad.shape or out.dtype != grad.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise RuntimeError(f"a gradient hook returned {got} for a gradient of {tuple(grad.shape)} {grad.dtype}: a "
                           "hook must return a tensor of the gradient's shape and dtype, or None")
    return out if out is mine else out.clone()


@grad_hook.register_fake
def _(grad: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(grad)


def hooks_signature(params: Mapping[str, nn.Parameter]) -> tuple:
    """Which gradient hooks each parameter has now (their identities): a program traced with other
    hooks is stale ([Note: gradient hooks on parameters] in `fxzero/trace.py`)."""
    return tuple((f, tuple(map(id, (p._backward_hooks or {}).values())),
                  bool(getattr(p, "_post_accumulate_grad_hooks", None)))
                 for f, p in params.items() if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))

"""The initialization eager construction of a model runs, as a list of events to replay.

Built eagerly after `torch.manual_seed(s)`, a model draws, in this order:

1. construction: each layer's own init as it is built: `reset_parameters()` in `named_modules()`
   order (a module before its children, children in registration order); a layer with no
   `reset_parameters()` is taken to draw nothing (norms start from `torch.ones`), except the
   few that `_CONSTRUCTOR_INITS` knows (transformers' `Conv1D`). One that did (ViT's
   `torch.randn` cls_token) shifts every later draw: the replay warns when `_init_weights`
   draws such a tensor;
2. a Hugging Face `PreTrainedModel` ends its `__init__` with `post_init()`: it applies its
   `_initialize_weights` (the model's `_init_weights`) over its subtree, children before
   parents, skipping modules an inner model's own `post_init()` already did (its
   `_is_hf_initialized` flags), then ties weights; the tie's source keeps its value (while
   transformers' `no_init_weights()` is in force, `init_weights_disabled`, it does nothing);
3. any other model with an `_init_weights(module)` method is taken to end its `__init__` with
   `self.apply(self._init_weights)` (the nanoGPT pattern): applied in `nn.Module.apply` order to
   the model as it stands, tied parameters shared.

Init code written otherwise (`self.apply(some_fn)`, a loop over `named_parameters()` in
`__init__`) ran on meta tensors and cannot be replayed: pass `state_dict=`, or move it into
`reset_parameters()` or `_init_weights(module)`.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, NamedTuple, Optional, Union

import torch.nn as nn

__all__ = ["Apply", "Construct", "init_events", "init_weights_disabled"]


def _conv1d_init(module: nn.Module) -> None:
    # transformers.pytorch_utils.Conv1D.__init__: weight N(0, 0.02), bias from torch.zeros.
    nn.init.normal_(module.weight, std=0.02)
    nn.init.zeros_(module.bias)


# Layers with no reset_parameters() whose constructors draw from the RNG: how they draw.
_CONSTRUCTOR_INITS: dict[str, Callable[[nn.Module], None]] = {
    "transformers.pytorch_utils.Conv1D": _conv1d_init,
}


class Construct(NamedTuple):
    """A layer's own init as eager construction ran it."""

    name: str
    module: nn.Module
    init: Callable[[], None]


class Apply(NamedTuple):
    """One call of the model's init function on one module."""

    name: str
    module: nn.Module
    fn: Callable[[nn.Module], None]
    tied: bool  # tied owners share one tensor (a plain model's `self.apply`); else each its own


def _constructor_init(module: nn.Module) -> Optional[Callable[[], None]]:
    if hasattr(module, "reset_parameters"):
        return module.reset_parameters
    for cls in type(module).__mro__:
        init = _CONSTRUCTOR_INITS.get(f"{cls.__module__}.{cls.__qualname__}")
        if init is not None:
            return functools.partial(init, module)
    return None


def _pretrained_class() -> Optional[type]:
    """transformers' PreTrainedModel if transformers is loaded (a model of it is, then)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling_utils, "PreTrainedModel", None)


def init_weights_disabled(model: nn.Module) -> bool:
    """Whether the model's `post_init()` would initialize nothing now: transformers'
    `no_init_weights()` replaces `PreTrainedModel.init_weights` with a function that does nothing
    while `from_pretrained` builds a model under DeepSpeed's `zero.Init` (the checkpoint gives the
    values), so eager construction there draws nothing for it."""
    fn = getattr(type(model), "init_weights", None)
    return "no_init_weights" in getattr(fn, "__qualname__", "")


def init_events(model: nn.Module) -> list[Union[Construct, Apply]]:
    """The init events of eager construction, in order (see the module doc)."""
    pretrained = _pretrained_class()
    events: list[Union[Construct, Apply]] = []
    built: set[int] = set()

    def post_init(prefix: str, model_: nn.Module) -> None:
        custom = model_.is_custom_code()

        def walk(name: str, module: nn.Module, fn) -> None:  # transformers' smart_apply
            for child_name, child in module.named_children():
                child_fn = child._initialize_weights if isinstance(child, pretrained) else fn
                walk(f"{name}.{child_name}" if name else child_name, child, child_fn)
            events.append(Apply(name, module, lambda m, fn=fn: fn(m, custom), tied=False))

        walk(prefix, model_, model_._initialize_weights)

    def build(name: str, module: nn.Module) -> None:
        if id(module) in built:
            return
        built.add(id(module))
        own = [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
        init = _constructor_init(module)
        if own and init is not None:
            events.append(Construct(name, module, init))
        for child_name, child in module.named_children():
            build(f"{name}.{child_name}" if name else child_name, child)
        if pretrained is not None and isinstance(module, pretrained):
            post_init(name, module)

    build("", model)
    if not (pretrained is not None and isinstance(model, pretrained)) and callable(
        getattr(model, "_init_weights", None)
    ):
        def walk(name: str, module: nn.Module) -> None:  # nn.Module.apply
            for child_name, child in module.named_children():
                walk(f"{name}.{child_name}" if name else child_name, child)
            events.append(Apply(name, module, model._init_weights, tied=True))

        walk("", model)
    return events

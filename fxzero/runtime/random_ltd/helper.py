"""DeepSpeed's `runtime/data_pipeline/data_routing/helper.py` names under fxzero.

    model, optimizer, _, _ = deepspeed.initialize(model=model, config=config_with_random_ltd, ...)
    model = convert_to_random_ltd(model, GPT2Block)    # the engine, its GPT2Blocks routed
    torch.save(save_without_random_ltd(model), path)   # the weights under the model's own names

`convert_to_random_ltd` routes each `convert_type` layer in place ([Note: routing a layer in
place] in `layer.py`): the parameters keep the names and storage fxzero sharded at initialize,
where DeepSpeed's wrapper renames them (".random_ltd_layer"), and the engine's
`random_ltd_initialize()` then configures the layers the config names.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch.nn as nn

from fxzero.runtime.random_ltd.layer import RandomLayerTokenDrop, route_in_place

__all__ = ["convert_to_random_ltd", "remove_random_ltd_state_dict", "save_without_random_ltd"]


def convert_to_random_ltd(model: Any, convert_type: type) -> Any:
    """Route every `convert_type` layer of the engine's model and configure them (DeepSpeed's
    call); returns `model`, the engine."""
    if not callable(getattr(model, "random_ltd_initialize", None)):
        raise TypeError(f"convert_to_random_ltd takes the engine deepspeed.initialize returned (it calls "
                        f"engine.random_ltd_initialize()), got {type(model).__name__}; convert after initialize, "
                        "with random_ltd enabled in the config")
    if not (isinstance(convert_type, type) and issubclass(convert_type, nn.Module)):
        raise TypeError(f"convert_to_random_ltd: convert_type must be the layer class to route (an nn.Module "
                        f"subclass, e.g. GPT2Block), got {convert_type!r}")
    target = model.module if hasattr(model, "module") else model
    found = [m for m in target.modules() if isinstance(m, convert_type)]
    if not found:
        raise ValueError(f"convert_to_random_ltd: the model has no {convert_type.__name__} layer to route; pass the "
                         "class of the layers random_ltd_layer_id names")
    for layer in found:
        route_in_place(layer)
    model.random_ltd_initialize()
    return model


def save_without_random_ltd(model: Any) -> "OrderedDict[str, Any]":
    """The model's state dict (the engine's module's) under the names it has without random-LTD."""
    target = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(target.state_dict())


def remove_random_ltd_state_dict(state_dict: dict[str, Any]) -> "OrderedDict[str, Any]":
    """`state_dict` with every ".random_ltd_layer" a wrapper adds taken out of its keys."""
    return OrderedDict((key.replace(".random_ltd_layer", ""), value) for key, value in state_dict.items())


__all__ += ["RandomLayerTokenDrop"]

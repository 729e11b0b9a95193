"""A small built-in model zoo for tests, the demo and the CLI.

Every model here is made of standard torch layers initialized by their own
`reset_parameters()`, in the order the modules are registered, and the GPT then applies GPT-2's
init with `self.apply(self._init_weights)` as the last step of its `__init__`. That is what lets
fxzero build a model on the meta device and materialize it later with the values eager
construction gives under the same `torch.manual_seed` (`fxzero.runtime.init_replay` replays
exactly that sequence). Three rules keep that true, so keep them when adding a model:

- any init beyond the layers' own goes in the model's `_init_weights(module)`, applied by
  `self.apply(self._init_weights)` at the end of `__init__` (after any tie); no other
  `self.apply(init_fn)` pass, and no parameter created outside a layer;
- every submodule is constructed right where it is registered, so construction order (the
  order the RNG is consumed eagerly) equals registration order (the order `modules()` yields);
- a tied parameter (`GPT.lm_head.weight is GPT.wte.weight`) is tied before the
  `self.apply`, which then writes it through each owner: the last write wins, in the replay too.

Models build from a frozen config; `build(name, **overrides)` is the registry the CLI uses.
Rotary tables are computed in the forward (a pure function of the shape), not held in buffers.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from fxzero.zoo.cnn_model import CNN, CNNConfig
from fxzero.zoo.common import replace_fields
from fxzero.zoo.gpt_model import GPT, GPT_SIZES, GPTConfig, gpt
from fxzero.zoo.llama_model import LLAMA_SIZES, Llama, LlamaConfig, llama

__all__ = [
    "CNN",
    "CNNConfig",
    "GPT",
    "GPTConfig",
    "GPT_SIZES",
    "LLAMA_SIZES",
    "Llama",
    "LlamaConfig",
    "MODELS",
    "build",
    "gpt",
    "llama",
]


MODELS: dict[str, Callable[..., nn.Module]] = {
    "gpt-tiny": lambda **kw: gpt("tiny", **kw),
    "gpt-small": lambda **kw: gpt("small", **kw),
    "gpt2": lambda **kw: gpt("gpt2", **kw),
    "gpt-1b": lambda **kw: gpt("1b", **kw),
    "gpt-2b": lambda **kw: gpt("2b", **kw),
    "llama-tiny": lambda **kw: llama("tiny", **kw),
    "llama-small": lambda **kw: llama("small", **kw),
    "llama-7b": lambda **kw: llama("7b", **kw),
    "llama3-8b": lambda **kw: llama("3-8b", **kw),
    "llama3-70b": lambda **kw: llama("3-70b", **kw),
    "cnn": lambda **kw: CNN(replace_fields(CNNConfig(), kw)),
}
"""Model builders by name; each takes config-field overrides as keyword arguments."""


def build(name: str, **overrides) -> nn.Module:
    """Build a zoo model by name.

    Builds on the current default device, so `with torch.device("meta"): build("gpt2")`
    allocates nothing.

    Args:
        name: One of `MODELS`: "gpt-tiny", "gpt-small", "gpt2", "gpt-1b", "gpt-2b", "llama-tiny",
            "llama-small", "llama-7b", "llama3-8b", "llama3-70b" (Meta's published shapes), "cnn".
        **overrides: Fields of the model's config to change, e.g. `build("gpt-tiny", n_blocks=2)`.

    Raises:
        ValueError: for an unknown name.
        TypeError: for an override that is not a field of the model's config.
    """
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](**overrides)

"""The engine's side of random-LTD: the scheduler, which layers route, and each call's kept count.

    engine = deepspeed.initialize(...)[0]              # the config enables random_ltd
    engine = convert_to_random_ltd(engine, GPT2Block)  # routes the layers, then random_ltd_initialize()
    loss = engine(**batch).loss                        # update_seq(global_steps); layers keep `kept` tokens

What DeepSpeed's engine does (`random_ltd_initialize`, `_forward_prologue`, checkpoints), held
apart from `Engine`, which calls in: `RandomLTDRouting.initialize` configures the routed layers,
`call` advances the schedule before a training forward and adds the kept count to the call
([Note: where random-LTD draws its tokens] in `layer.py`), `state_dict` is what checkpoints keep.

Which layers route: DeepSpeed's rule, so that a config tuned under DeepSpeed routes the same
layers. The ids of "random_ltd_layer_id", sorted, are matched in turn against the routed
layers in module order: a layer routes when the next id, as text, is part of its name
("transformer.h.3" for 3), and takes the next layer number (0 for the first). The number
matched must be "random_ltd_layer_num".
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch
import torch.nn as nn

from fxzero._compat import maybe_mark_dynamic
from fxzero.config.notices import warn_ineffective
from fxzero.config.random_ltd import RandomLTD
from fxzero.runtime.random_ltd.layer import CURRENT, ForwardDraw, RandomLayerTokenDrop
from fxzero.runtime.random_ltd.scheduler import RandomLTDScheduler

__all__ = ["KEPT", "RandomLTDRouting"]

KEPT = "_fxzero_random_ltd_kept"
"""The keyword carrying the kept count into the model's call: a tensor of `kept` elements, its
one dim symbolic (the program reads its size, never its values); the root's pre-hook removes it."""


class RandomLTDRouting:
    """Random-LTD for one engine: its scheduler and routed layers."""

    def __init__(self, policy: RandomLTD, *, global_batch_size: Optional[int], micro_batch_size: Optional[int],
                 rank: int) -> None:
        self.policy = policy
        self.rank = rank
        self.config = policy.deepspeed_config(global_batch_size=global_batch_size or 0,
                                              micro_batch_size=micro_batch_size)
        """DeepSpeed's random-LTD dict (`Engine.random_ltd_config()`), with the batch sizes it adds."""
        self.scheduler = RandomLTDScheduler(self.config)
        self.layers: list[nn.Module] = []
        """The routed layers, by their layer number."""
        self._hooks: list[Any] = []

    def initialize(self, model: nn.Module) -> list[str]:
        """Configure the routed layers of `model` by DeepSpeed's rule (module doc); returns their names."""
        queue = collections.deque(sorted(self.policy.layer_ids))
        routed: list[tuple[str, nn.Module]] = []
        for name, layer in model.named_modules():
            if isinstance(layer, RandomLayerTokenDrop) and queue and str(queue[0]) in name:
                layer.init_config(self.config, self.scheduler, len(routed))
                routed.append((name, layer))
                queue.popleft()
        if len(routed) != self.policy.layer_num:
            wrapped = [n for n, m in model.named_modules() if isinstance(m, RandomLayerTokenDrop)]
            raise ValueError(f"[rank {self.rank}] random-LTD: random_ltd_layer_num is {self.policy.layer_num}, and "
                             f"random_ltd_layer_id {list(self.policy.layer_ids)} matched {len(routed)} of the "
                             f"converted layers {wrapped} ({[n for n, _ in routed]}): an id matches a converted "
                             "layer whose name contains it, in order; make the two agree (DeepSpeed requires it too)")
        self.layers = [layer for _, layer in routed]
        if not self._hooks:
            self._hooks = [model.register_forward_pre_hook(_enter, with_kwargs=True),
                           model.register_forward_hook(_leave, always_call=True)]
        return [name for name, _ in routed]

    def call(self, model: nn.Module, args: tuple, kwargs: dict, global_steps: int,
             device: torch.device) -> tuple[tuple, dict]:
        """Before a forward of the engine: in training, the schedule's value for this step (DeepSpeed's
        `_forward_prologue`), and the kept count added to the call where a routed layer trains."""
        if model.training:
            self.scheduler.update_seq(global_steps)
            if not self.layers:
                warn_ineffective([f"[rank {self.rank}] random-LTD is enabled in the config and no layer routes: "
                                  "the schedule advances, and every token goes through every layer; convert the "
                                  "model's layers after initialize (convert_to_random_ltd(engine, LayerClass))"])
        if not any(layer.training for layer in self.layers):
            return args, kwargs
        if KEPT in kwargs:
            raise ValueError(f"[rank {self.rank}] the model was called with keyword {KEPT!r}, which fxzero's "
                             "random-LTD uses itself; rename it")
        carrier = torch.empty(self.scheduler.get_current_seq(), dtype=torch.int8, device=device)
        maybe_mark_dynamic(carrier, [0])  # (one program for every kept count: module doc of layer.py)
        return args, {**kwargs, KEPT: carrier}

    def state_dict(self) -> dict[str, int]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.scheduler.load_state_dict(state)


def _enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The routed model's forward begins: the kept count the engine passed (absent: an eager call,
    whose layers read the scheduler), and no draw yet."""
    carrier = kwargs.pop(KEPT, None)
    kept = carrier.shape[0] if carrier is not None else None
    if kept is None:
        CURRENT.set(None)
    else:
        CURRENT.set(ForwardDraw(kept))
    return args, kwargs


def _leave(module: nn.Module, args: tuple, output: Any) -> None:
    CURRENT.set(None)  # (the draw, fake tensors while tracing, is never kept past its forward)

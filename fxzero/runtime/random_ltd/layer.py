"""Random layer-token drop: a routed layer runs on a random, sorted subset of each sample's tokens.

    part = hidden[b, idx[b], :]        # idx: `kept` positions per sample, drawn at random, sorted
    out  = layer(part, mask sliced to the kept tokens)
    hidden[b, idx[b], :] = out         # the other tokens skip the layer unchanged

DeepSpeed's `RandomLayerTokenDrop` (runtime/data_pipeline/data_routing/basic_layer.py) with its
CUDA kernels (ops/random_ltd: token_sort_, token_gather, token_scatter_) written as torch
operators: `gather` and `scatter`, whose autograd is the kernels' backward (the dropped tokens'
gradient passes through, the kept ones' comes from the layer), so fxzero's tracer follows them
like any other operator, and the layer also runs eagerly on any device.

[Note: where random-LTD draws its tokens]
In the program, as DeepSpeed does in its forward: the first routed layer (id 0) draws the kept
positions of every routed layer at once, `multinomial(ones(layers * batch, seq), kept)` sorted
per row (DeepSpeed's `gpt_sample_tokens`), from the global RNG of the device, at the same point of
the forward; the later layers take their row. Drawing on the host and feeding the positions in
would keep programs free of random operators, but the host cannot know the sizes to draw: the
hidden states' batch and length exist only inside the model (a ViT's 197 tokens come from the
image's patches and a class token). Random operators are already part of fxzero's programs
(dropout): the runtime draws them from the same RNG as eager, the backward reads the positions
the forward saved (never drawn again: `separate_phases` does not recompute random operators), and
the same seed gives the same tokens as DeepSpeed's Python path on the same device.

The kept count changes with the schedule, so it reaches the program as a size, never a constant:
the engine passes a carrier tensor of `kept` elements, its dim marked dynamic, as a keyword the
model's root pre-hook removes (`routing.py`); the layer reads `kept` from its size. One program
serves the whole schedule: `kept < seq` (route or not) is a guard on the two sizes, so a call on
the other side of it (the schedule reaching the length) gets a program of its own.

[Note: routing a layer in place]
Scripts convert their layers after `deepspeed.initialize`. DeepSpeed replaces the layer by a wrapper holding it, so its parameters' names gain ".random_ltd_layer".
fxzero has laid out and sharded the parameters by name at initialize, so `convert_to_random_ltd`
routes the layer in place instead: its class becomes a subclass of both its own class and
`RandomLayerTokenDrop` whose forward routes, the parameters keep their names and storage, and
`save_without_random_ltd` gives the same keys as DeepSpeed's. The routed class is made once per
class and pickles (and deep-copies) by its original class. `RandomLayerTokenDrop(layer)`, built
before initialize, is DeepSpeed's wrapper.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import types
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

__all__ = ["RandomLayerTokenDrop", "route_in_place", "sample_tokens"]

SAMPLE_INDEX, ATTENTION_MASK = "sample_idx", "attention_mask"
"""Where DeepSpeed's first routed layer leaves a forward's draw for the others (scheduler.state)."""


@dataclasses.dataclass
class ForwardDraw:
    """One forward of the routed model: the kept count, and the first routed layer's draw."""

    kept: Any
    """Tokens each routed layer keeps: the carrier's size (symbolic in a program), or the scheduler's."""
    indices: Optional[torch.Tensor] = None
    """[routed layers, batch, kept], sorted along the last dim."""
    mask: Any = None
    """The decoder's mask sliced to the kept tokens (shared), or the encoder's per layer."""


CURRENT: contextvars.ContextVar[Optional[ForwardDraw]] = contextvars.ContextVar("fxzero_random_ltd", default=None)
"""The forward in progress through the routed model's root (set by its pre-hook, `routing.py`)."""


def sample_tokens(kept: Any, seq: Any, batch: Any, layers: int, device: torch.device) -> torch.Tensor:
    """`kept` distinct positions of `seq` per (layer, sample), uniformly, sorted: [layers, batch, kept]
    (DeepSpeed's `gpt_sample_tokens`/`bert_sample_tokens` draw, with the sort its kernel does)."""
    weights = torch.ones(layers * batch, seq, device=device)
    drawn = torch.multinomial(weights, kept)
    return drawn.reshape(layers, batch, kept).sort(dim=-1).values


def gather_tokens(hidden: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """The kept tokens: [batch, kept, h] (or [kept, batch, h]) of hidden [batch, seq, h] ([seq, batch, h])."""
    if batch_first:
        return hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return hidden.gather(0, idx.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def scatter_tokens(hidden: torch.Tensor, part: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """hidden with the kept tokens replaced by the layer's output `part` (a new tensor)."""
    if batch_first:
        return torch.scatter(hidden, 1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]), part)
    return torch.scatter(hidden, 0, idx.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1]), part)


def _encoder_mask(mask: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """An encoder's mask [batch, heads, seq or 1, seq] restricted to the kept tokens (rows and
    columns; a mask broadcast over the queries keeps its one row), as DeepSpeed's bert path."""
    b, h, rows, _ = mask.shape
    kept = idx.shape[-1]
    if rows != 1:
        mask = mask.gather(2, idx[:, None, :, None].expand(b, h, kept, mask.shape[-1]))
    return mask.gather(3, idx[:, None, None, :].expand(b, h, mask.shape[2], kept))


def _reset(module: nn.Module) -> None:
    """The routing state DeepSpeed's wrapper starts with: unrouted until the engine configures it."""
    module.random_ltd_scheduler = None
    module.random_ltd_layer_id = None
    module.reserved_length = -1
    module.curr_seq = -1
    module.batch_first = False


class RandomLayerTokenDrop(nn.Module):
    """DeepSpeed's random-LTD wrapper: `layer` runs on the kept tokens of each training forward
    once the engine has configured it (`Engine.random_ltd_initialize`); unconfigured, or in
    eval, it is the layer itself. See [Note: where random-LTD draws its tokens]."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        _reset(self)

    def init_config(self, config: Mapping[str, Any], scheduler: Any, random_ltd_layer_id: int) -> None:
        """Route this layer as routed layer `random_ltd_layer_id` (the engine's call): DeepSpeed's
        random-LTD dict ("model_mask_name", "model_type", "hidden_state_order") and scheduler."""
        order, kind = config["hidden_state_order"], config["model_type"]
        if order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(f"random-LTD hidden_state_order {order!r}: give \"batch_seq_dim\" ([batch, seq, "
                             "hidden]) or \"seq_batch_dim\" ([seq, batch, hidden])")
        if kind not in ("decoder", "encoder"):
            raise ValueError(f"random-LTD model_type {kind!r}: give \"decoder\" (a causal mask, sliced to the "
                             "kept length) or \"encoder\" (a full mask, gathered at the kept tokens)")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.max_length = scheduler.state["max_value"]
        self.mask_name = config["model_mask_name"]
        self.micro_bs = config.get("micro_batch_size")
        self.model_type = kind
        self.batch_first = order == "batch_seq_dim"

    def _layer_call(self) -> Callable[..., Any]:
        return self.random_ltd_layer

    def _layer_signature(self) -> Optional[inspect.Signature]:
        try:
            return inspect.signature(self.random_ltd_layer.forward)
        except (TypeError, ValueError):
            return None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _route(self, hidden_states, args, kwargs)


def _route(module: RandomLayerTokenDrop, hidden: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """The routed forward (module doc): the layer on the kept tokens, scattered back."""
    call = module._layer_call()
    scheduler = module.random_ltd_scheduler
    if scheduler is None or not module.training:
        return call(hidden, *args, **kwargs)
    if hidden.dim() != 3:
        raise ValueError(f"random-LTD routes hidden states of 3 dims ([batch, seq, hidden] or [seq, batch, "
                         f"hidden]); layer {type(module).__name__} got {tuple(hidden.shape)}")
    draw = CURRENT.get()
    if draw is None:  # called on its own, not through the converted model: DeepSpeed's scheduler.state
        draw = ForwardDraw(scheduler.get_current_seq(), scheduler.state.get(SAMPLE_INDEX),
                           scheduler.state.get(ATTENTION_MASK))
        shared = scheduler.state
    else:
        shared = None
    batch, seq = (hidden.shape[0], hidden.shape[1]) if module.batch_first else (hidden.shape[1], hidden.shape[0])
    if isinstance(draw.kept, int) and isinstance(seq, int):  # (DeepSpeed's attributes: never a trace's symbols)
        module.reserved_length, module.curr_seq = draw.kept, seq
    if not draw.kept < seq:  # (symbolic: a guard, so each side is a program of its own)
        return call(hidden, *args, **kwargs)
    bound, mask = _bind_mask(module, hidden, args, kwargs)
    layer_id = module.random_ltd_layer_id
    if layer_id == 0:
        draw.indices = sample_tokens(draw.kept, seq, batch, module.random_ltd_num_layer, hidden.device)
        if mask is None:
            draw.mask = None
        elif module.model_type == "decoder":
            draw.mask = mask[:, :, : draw.kept, : draw.kept]
        else:
            draw.mask = [_encoder_mask(mask, draw.indices[i]) for i in range(module.random_ltd_num_layer)]
        if shared is not None:
            shared[SAMPLE_INDEX], shared[ATTENTION_MASK] = draw.indices, draw.mask
    elif draw.indices is None:
        raise RuntimeError(f"random-LTD layer {layer_id} ran before routed layer 0 in this forward: the first "
                           "routed layer draws every routed layer's tokens; route the layers in the order the "
                           "forward calls them (random_ltd_layer_id sorted)")
    idx = draw.indices[layer_id]
    part = gather_tokens(hidden, idx, module.batch_first)
    if module.mask_name is not None and mask is not None:
        sliced = draw.mask if module.model_type == "decoder" else draw.mask[layer_id]
        _set_argument(bound, module.mask_name, sliced)
    out = _call_bound(call, bound, part)
    first = out[0] if isinstance(out, tuple) else out
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"random-LTD: layer {type(module).__name__} returned {type(out).__name__}; a routed layer "
                        "returns the hidden states, as a tensor or as the first item of a tuple")
    merged = scatter_tokens(hidden, first, idx, module.batch_first)
    return (merged, *out[1:]) if isinstance(out, tuple) else merged


# -- the layer's mask argument ----------------------------------------------------------------

@dataclasses.dataclass
class _Bound:
    """The layer's call with its arguments by name where its signature names them."""

    signature: Optional[inspect.BoundArguments]
    args: tuple
    kwargs: dict


def _bind_mask(module: RandomLayerTokenDrop, hidden: torch.Tensor, args: tuple, kwargs: dict
               ) -> tuple[_Bound, Optional[torch.Tensor]]:
    """The call bound to the layer's signature, and the mask `model_mask_name` names: a keyword
    (DeepSpeed reads `kwargs[name]`) or, where the model passes it positionally (Hugging Face's
    GPT-2 blocks since transformers 4.5x), the parameter of that name. None: no mask given, as
    with a causal model under SDPA, which then masks the kept tokens causally itself."""
    name = module.mask_name
    signature = module._layer_signature()
    bound = None
    if signature is not None:
        try:
            bound = signature.bind(hidden, *args, **kwargs)
        except TypeError:
            bound = None
    call = _Bound(bound, args, dict(kwargs))
    if name is None:
        return call, None
    if name in kwargs:
        mask = kwargs[name]
    elif bound is not None and name in bound.arguments:
        mask = bound.arguments[name]
    elif signature is not None and name in signature.parameters:
        mask = None  # (a parameter not passed: its default)
    else:
        params = list(signature.parameters) if signature is not None else "unknown"
        raise ValueError(f"random-LTD model_mask_name {name!r}: layer {type(module).__name__} was called without "
                         f"it and has no parameter of that name (its parameters: {params}); set model_mask_name to "
                         "the keyword the layer takes its attention mask by, or null for no mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        what = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"random-LTD model_mask_name {name!r}: layer {type(module).__name__} got a mask of "
                         f"{what}; random-LTD slices a 4-dim mask [batch, heads or 1, seq, seq] to the kept tokens")
    if module.model_type == "encoder" and mask is None:
        raise ValueError(f"random-LTD model_type \"encoder\" needs the layer's attention mask (model_mask_name "
                         f"{name!r} is None in this call): the kept tokens' mask is gathered from it")
    return call, mask


def _set_argument(call: _Bound, name: str, value: Any) -> None:
    """Replace the argument `name` of the call: a parameter of the layer's, or a keyword its
    `**kwargs` took, or (no signature) a keyword."""
    bound = call.signature
    if bound is None:
        call.kwargs[name] = value
        return
    param = bound.signature.parameters.get(name)
    if param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        bound.arguments[name] = value
        return
    var_keyword = next(p.name for p in bound.signature.parameters.values() if p.kind == p.VAR_KEYWORD)
    bound.arguments.setdefault(var_keyword, {})[name] = value


def _call_bound(layer: Callable[..., Any], call: _Bound, part: torch.Tensor) -> Any:
    """The layer on the kept tokens, with the call's other arguments as given (the mask replaced)."""
    if call.signature is None:
        return layer(part, *call.args, **call.kwargs)
    first = next(iter(call.signature.arguments))
    call.signature.arguments[first] = part
    return layer(*call.signature.args, **call.signature.kwargs)


# -- routing a layer in place ([Note: routing a layer in place]) --------------------------------

class _RoutedInPlace(RandomLayerTokenDrop):
    """The base of a layer routed in place: the layer is itself the wrapped layer."""

    @property
    def random_ltd_layer(self) -> nn.Module:  # type: ignore[override]
        """DeepSpeed's wrapped layer: here the layer itself, routed in place."""
        return self

    def _layer_call(self) -> Callable[..., Any]:
        return functools.partial(self._fxzero_layer_forward, self)

    def _layer_signature(self) -> Optional[inspect.Signature]:
        try:
            return inspect.signature(types.MethodType(self._fxzero_layer_forward, self))
        except (TypeError, ValueError):
            return None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _route(self, hidden_states, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return _rebuild_routed, (type(self)._fxzero_original, self.__dict__)


def _rebuild_routed(cls: type, state: dict) -> nn.Module:
    """A routed layer from pickle or deepcopy: an instance of `cls` routed again."""
    layer = cls.__new__(cls)
    layer.__dict__.update(state)
    layer.__class__ = _routed_class(cls)
    return layer


_ROUTED: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """`cls` routed: a subclass of `_RoutedInPlace` and `cls` whose forward routes and then runs
    `cls.forward` (one per class, named for it)."""
    routed = _ROUTED.get(cls)
    if routed is None:
        name = f"RandomLTD_{cls.__module__.replace('.', '_')}_{cls.__qualname__.replace('.', '_')}"
        routed = type(name, (_RoutedInPlace, cls), {"__module__": __name__, "__qualname__": name,
                                                    "_fxzero_layer_forward": staticmethod(cls.forward),
                                                    "_fxzero_original": cls})
        _ROUTED[cls] = routed
    return routed


def route_in_place(layer: nn.Module) -> nn.Module:
    """Make `layer` a `RandomLayerTokenDrop` without moving it or renaming its parameters."""
    if isinstance(layer, RandomLayerTokenDrop):
        return layer
    layer.__class__ = _routed_class(type(layer))
    _reset(layer)
    return layer

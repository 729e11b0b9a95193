"""`RandomLTD`: random layer-token drop, DeepSpeed's data routing (`data_efficiency.data_routing.random_ltd`).

    Config(random_ltd=RandomLTD(layer_ids=(1, 2, 3), total_layer_num=5, min_value=8, max_value=32,
                                require_steps=100, seq_per_step=8, model_mask_name="attention_mask"))

Layers the script converts (`convert_to_random_ltd(engine, GPT2Block)`) and this policy names run
on `kept` random tokens of each sample in training, `kept` going from `min_value` to `max_value`
over `require_steps` optimizer steps ("fixed_linear"); the other tokens skip them. See
docs/random_ltd.md and `fxzero/runtime/random_ltd/`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Literal, Optional

__all__ = ["RandomLTD", "random_ltd_from_deepspeed"]


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RandomLTD.{name} must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomLTD:
    """Random-LTD: which layers route, how many tokens they keep when, and how the model passes
    its hidden states and mask (DeepSpeed's "random_ltd" keys)."""

    layer_ids: tuple[int, ...]
    """"random_ltd_layer_id": the layers that route, matched in order against the converted
    layers' names (`fxzero/runtime/random_ltd/routing.py`)."""
    layer_num: Optional[int] = None
    """"random_ltd_layer_num": how many layers route (None: len(layer_ids)); the engine checks it
    against the layers matched, as DeepSpeed does."""
    total_layer_num: int
    """"total_layer_num": the model's layers, for the layer-tokens consumed (`consumed_layer_tokens`)."""
    min_value: int
    """Tokens kept at step 0."""
    max_value: int
    """Tokens kept from `require_steps` on (and counted for the layers that do not route)."""
    require_steps: int
    """Optimizer steps from min_value to max_value."""
    seq_per_step: int
    """The kept count is a multiple of this (rounded down)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """The one schedule DeepSpeed 0.19.8 computes."""
    model_type: Literal["decoder", "encoder"] = "decoder"
    """"decoder": the mask (causal) is sliced to the kept length, the same for every layer;
    "encoder": the mask is gathered at each layer's kept tokens (rows and columns), and needed."""
    model_mask_name: Optional[str] = None
    """The routed layer's argument holding the attention mask (keyword or positional); None: no mask."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    """How the routed layer's first argument is laid out: [batch, seq, hidden] or [seq, batch, hidden]."""

    def __post_init__(self) -> None:
        ids = self.layer_ids
        if not isinstance(ids, tuple) or not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                        for i in ids):
            raise ValueError(f"RandomLTD.layer_ids must be a non-empty tuple of layer indices >= 0, got {ids!r}")
        if self.layer_num is None:
            object.__setattr__(self, "layer_num", len(ids))
        for name in ("layer_num", "total_layer_num", "min_value", "max_value", "require_steps", "seq_per_step"):
            _positive_int(name, getattr(self, name))
        if self.layer_num > self.total_layer_num:
            raise ValueError(f"RandomLTD.layer_num {self.layer_num} exceeds total_layer_num {self.total_layer_num}")
        if self.min_value > self.max_value:
            raise ValueError(f"RandomLTD.min_value {self.min_value} exceeds max_value {self.max_value}")
        if self.schedule_type != "fixed_linear":
            raise ValueError(f"RandomLTD.schedule_type {self.schedule_type!r}: DeepSpeed 0.19.8 and fxzero compute "
                             "\"fixed_linear\" only")
        if self.model_type not in ("decoder", "encoder"):
            raise ValueError(f"RandomLTD.model_type {self.model_type!r}: give \"decoder\" (the causal mask sliced to "
                             "the kept length) or \"encoder\" (a full mask gathered at the kept tokens); DeepSpeed "
                             "has only these two")
        if self.hidden_state_order not in ("batch_seq_dim", "seq_batch_dim"):
            raise ValueError(f"RandomLTD.hidden_state_order {self.hidden_state_order!r}: give \"batch_seq_dim\" "
                             "([batch, seq, hidden]) or \"seq_batch_dim\" ([seq, batch, hidden])")
        if self.model_mask_name is not None and not isinstance(self.model_mask_name, str):
            raise ValueError(f"RandomLTD.model_mask_name must be a name or None, got {self.model_mask_name!r}")
        if self.model_type == "encoder" and self.model_mask_name is None:
            raise ValueError("RandomLTD(model_type=\"encoder\") gathers the attention mask at the kept tokens: name "
                             "the layer's mask argument in model_mask_name (DeepSpeed requires one too)")

    def deepspeed_config(self, *, global_batch_size: int, micro_batch_size: Optional[int]) -> dict[str, Any]:
        """DeepSpeed's random-LTD dict, as its engine hands its scheduler and layers (and
        `engine.random_ltd_config()` returns), with the batch sizes the engine adds."""
        return {
            "enabled": True, "total_layer_num": self.total_layer_num, "random_ltd_layer_num": self.layer_num,
            "random_ltd_layer_id": list(self.layer_ids), "model_mask_name": self.model_mask_name,
            "model_type": self.model_type, "hidden_state_order": self.hidden_state_order,
            "random_ltd_schedule": {"min_value": self.min_value, "max_value": self.max_value,
                                    "schedule_type": self.schedule_type,
                                    "schedule_config": {"require_steps": self.require_steps,
                                                        "seq_per_step": self.seq_per_step}},
            "layer_token_lr_schedule": {"enabled": False},
            "global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
        }


_LEAF = None
_SCHEMA: dict[str, Any] = {
    "enabled": _LEAF, "seed": _LEAF,
    "data_sampling": {"enabled": _LEAF, "num_epochs": _LEAF, "num_workers": _LEAF, "pin_memory": _LEAF,
                      "curriculum_learning": _LEAF, "dynamic_batching": _LEAF},
    "data_routing": {"enabled": _LEAF, "random_ltd": {
        "enabled": _LEAF, "total_layer_num": _LEAF, "random_ltd_layer_num": _LEAF, "random_ltd_layer_id": _LEAF,
        "model_mask_name": _LEAF, "model_type": _LEAF, "hidden_state_order": _LEAF,
        "random_ltd_schedule": {"min_value": _LEAF, "max_value": _LEAF, "schedule_type": _LEAF,
                                "schedule_config": {"require_steps": _LEAF, "seq_per_step": _LEAF}},
        "layer_token_lr_schedule": {"enabled": _LEAF, "total_layer_tokens": _LEAF, "warmup_type": _LEAF,
                                    "warmup_layer_tokens": _LEAF}}},
}
"""The keys DeepSpeed 0.19.8 reads in "data_efficiency" (runtime/data_pipeline/config.py and its
users); the data sampler's curriculum_learning and dynamic_batching are read only for "enabled"."""

_REQUIRED = ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name", "model_type",
             "hidden_state_order", "random_ltd_schedule")
_SAMPLING = {"enabled": "DeepSpeed's data sampler (curriculum learning's ordering of the data)",
             "curriculum_learning": "curriculum learning (DeepSpeed's data sampler feeding samples by difficulty)",
             "dynamic_batching": "dynamic batching (DeepSpeed's variable batch size and learning rate)"}


def _check_keys(section: Any, schema: dict[str, Any], path: str) -> None:
    """Every key of `section` is one DeepSpeed reads there, recursively (an unknown one is an error
    naming the nearest), as the key table checks the other sections."""
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: {path!r} must be an object, got {section!r}")
    for key, value in section.items():
        if key not in schema:
            near = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else f" (it reads {', '.join(schema)})"
            raise ValueError(f"DeepSpeed config: unknown key {path + '.' + key!r}{hint}")
        if isinstance(schema[key], dict) and value is not None:
            _check_keys(value, schema[key], f"{path}.{key}")


def _sampling_refused(sampling: dict[str, Any]) -> None:
    """Data sampling is not in fxzero: each of its switches (which DeepSpeed reads independently:
    curriculum learning runs whatever data_sampling.enabled says) must be off."""
    for key, feature in _SAMPLING.items():
        value = sampling.get(key)
        on = value is True if key == "enabled" else isinstance(value, dict) and value.get("enabled", False) is True
        if on:
            where = "enabled" if key == "enabled" else f"{key}.enabled"
            raise ValueError(f"DeepSpeed config: data_efficiency.data_sampling.{where}=true is not supported by "
                             f"fxzero: {feature} is not in fxzero; set it to false, or drop the section "
                             "(random-LTD, data_efficiency.data_routing, runs)")


def random_ltd_from_deepspeed(section: Any, ineffective: list[str], notes: list[str]) -> Optional[RandomLTD]:
    """The policy a DeepSpeed config's "data_efficiency" section asks for (None: random_ltd not
    enabled), every key checked; data sampling refused unless off; "seed" warned about (it seeds
    the data sampler only).

    DeepSpeed 0.19.8 turns random-LTD on by "random_ltd.enabled" alone: "data_efficiency.enabled"
    and "data_routing.enabled" are read but switch nothing, and fxzero does the same (said once
    in `notes` where they are false)."""
    if section is None:
        return None
    _check_keys(section, _SCHEMA, "data_efficiency")
    _sampling_refused(section.get("data_sampling") or {})
    if "seed" in section:
        ineffective.append("DeepSpeed config key 'data_efficiency.seed' has no effect in fxzero: it seeds DeepSpeed's "
                           "data sampler (curriculum learning), which fxzero does not have; random-LTD draws from "
                           "torch's RNG, as DeepSpeed's does")
    routing = section.get("data_routing") or {}
    ltd = routing.get("random_ltd") or {}
    if ltd.get("enabled", False) is not True:
        return None
    path = "data_efficiency.data_routing.random_ltd"
    missing = [k for k in _REQUIRED if k not in ltd]
    schedule = ltd.get("random_ltd_schedule") or {}
    missing += [f"random_ltd_schedule.{k}" for k in ("min_value", "max_value", "schedule_type", "schedule_config")
                if "random_ltd_schedule" in ltd and k not in schedule]
    steps = schedule.get("schedule_config") or {}
    missing += [f"random_ltd_schedule.schedule_config.{k}" for k in ("require_steps", "seq_per_step")
                if "schedule_config" in schedule and k not in steps]
    if missing:
        raise ValueError(f"DeepSpeed config: {path} is enabled and lacks {', '.join(missing)} (DeepSpeed reads each "
                         "and has no default for it)")
    if (ltd.get("layer_token_lr_schedule") or {}).get("enabled", False):
        raise ValueError(f"DeepSpeed config: {path}.layer_token_lr_schedule.enabled=true is not supported: DeepSpeed "
                         "0.19.8 does not implement it either (it raises); set it to false, or drop the section")
    off = [name for name, value in (("data_efficiency.enabled", section.get("enabled", False)),
                                    ("data_efficiency.data_routing.enabled", routing.get("enabled", False)))
           if value is not True]
    if off:
        notes.append(f"{' and '.join(off)} false with {path}.enabled true: DeepSpeed 0.19.8 runs random-LTD by "
                     "random_ltd.enabled alone, and so does fxzero")
    ids = ltd["random_ltd_layer_id"]
    if not isinstance(ids, list):
        raise ValueError(f"DeepSpeed config: {path}.random_ltd_layer_id must be a list of layer indices, got {ids!r}")
    try:
        return RandomLTD(layer_ids=tuple(ids), layer_num=ltd["random_ltd_layer_num"],
                         total_layer_num=ltd["total_layer_num"], min_value=schedule["min_value"],
                         max_value=schedule["max_value"], require_steps=steps["require_steps"],
                         seq_per_step=steps["seq_per_step"], schedule_type=schedule["schedule_type"],
                         model_type=ltd["model_type"], model_mask_name=ltd["model_mask_name"],
                         hidden_state_order=ltd["hidden_state_order"])
    except ValueError as e:
        raise ValueError(f"DeepSpeed config: {path}: {e}") from None

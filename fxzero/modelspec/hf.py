"""Hugging Face models as MODEL specs: `transformers:ClassName` built from a config, offline.

    fxzero compile transformers:GPT2LMHeadModel --model-config '{"n_layer": 2, "n_embd": 64}'
    fxzero compile transformers:LlamaForCausalLM --model-config path/to/checkpoint/   (its config.json)
    fxzero compile 'transformers:GPT2LMHeadModel(n_layer=2)'     literal arguments override fields

The class is any model class transformers exports (or a `transformers.PreTrainedModel` subclass
a `module:Class` / `file.py:Class` spec names); its config is `ClassName.config_class` built from
--model-config, a JSON object or a config.json (the file, or the folder holding it), with the
literal arguments on top; without either, the config class's defaults. Nothing is downloaded:
--model-config is never a hub name. The model is built under `torch.device("meta")`, as zoo
models are.

Without --inputs a model is traced on `default_inputs`: token ids for a model whose forward
takes input_ids, images for one that takes pixel_values. Either way `default_constants` adds
use_cache=false where forward takes it and the spec does not say: the KV cache is of no use to a
training step, which would drop it with a warning.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import sys
import warnings
from typing import Any, Optional

import torch
import torch.nn as nn

from fxzero.modelspec.errors import SpecError

__all__ = ["build", "config_record", "default_constants", "default_inputs", "is_hf_model", "is_hf_target", "is_model_class",
           "load_config_dict", "resolve_class"]

DEFAULT_BATCH = 2
"""The first dimension of every default input."""
DEFAULT_SEQ_LEN = 128
"""Token ids default to (DEFAULT_BATCH, min(DEFAULT_SEQ_LEN, max_position_embeddings))."""
DEFAULT_IMAGE_SIZE = 224
"""Images default to (DEFAULT_BATCH, num_channels, image_size, image_size), 224 without image_size."""


def is_hf_target(target: str) -> bool:
    """Whether a MODEL target names something in transformers (`transformers:GPT2LMHeadModel`)."""
    module = target.rpartition(":")[0]
    return module == "transformers" or module.startswith("transformers.")


def _transformers(spec_text: str):
    try:
        import transformers
    except ModuleNotFoundError as e:
        if e.name == "transformers":
            raise SpecError(f"MODEL {spec_text!r} needs the transformers package, which is not installed "
                            "(pip install transformers)") from e
        raise SpecError(f"MODEL {spec_text!r}: importing transformers failed: {e}") from e
    return transformers


def _pretrained_model_class():
    """`transformers.PreTrainedModel`, or None when transformers has not been imported (then no
    object can be one of its subclasses, and nothing is imported to find out)."""
    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def is_model_class(obj: Any) -> bool:
    """A `transformers.PreTrainedModel` subclass (built from a config, not called bare)."""
    base = _pretrained_model_class()
    return base is not None and isinstance(obj, type) and issubclass(obj, base)


def is_hf_model(model: nn.Module) -> bool:
    base = _pretrained_model_class()
    return base is not None and isinstance(model, base)


def resolve_class(target: str, spec_text: str) -> type:
    """The model class `transformers:ClassName` (or `transformers.sub.module:ClassName`) names.

    Raises:
        SpecError: transformers is missing, the name is not one it exports (naming the closest
            names that are), or it is not a model class.
    """
    transformers = _transformers(spec_text)
    where, _, name = target.rpartition(":")
    module = transformers
    if where != "transformers":
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001 - any import failure is the spec's to fix
            raise SpecError(f"MODEL {spec_text!r}: importing {where} failed: {type(e).__name__}: {e}") from e
    try:
        cls = getattr(module, name)
    except AttributeError:
        exported = [n for n in dir(module) if n[:1].isupper()]
        by_lower = {n.lower(): n for n in exported}
        close = [by_lower[n] for n in difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.6)]
        hint = f"; did you mean {', '.join(close)}?" if close else "; e.g. GPT2LMHeadModel or LlamaForCausalLM"
        raise SpecError(f"MODEL {spec_text!r}: {where} has no class {name!r}{hint}") from None
    except Exception as e:  # noqa: BLE001 - transformers' lazy import of the model's module failed
        raise SpecError(f"MODEL {spec_text!r}: importing {where}.{name} failed: {type(e).__name__}: {e}") from e
    if not is_model_class(cls):
        raise SpecError(f"MODEL {spec_text!r}: {where}.{name} is not a model class (a transformers.PreTrainedModel "
                        "subclass such as GPT2LMHeadModel)")
    return cls


def load_config_dict(text: str) -> dict:
    """--model-config: a JSON object, or a config.json given as the file or the folder holding it.

    Raises:
        SpecError: not JSON, not an object, or no such file (a hub name is not fetched).
    """
    stripped = text.strip()
    if stripped.startswith("{"):
        source, raw = "--model-config", stripped
    else:
        path = os.path.join(stripped, "config.json") if os.path.isdir(stripped) else stripped
        if not os.path.isfile(path):
            raise SpecError(
                f"--model-config {text!r}: no such file or folder; give a JSON object such as "
                "'{\"n_layer\": 2}' or the path of a config.json (the file or its folder); nothing is downloaded"
            )
        source = f"--model-config {path}"
        with open(path) as f:
            raw = f.read()
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SpecError(f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(config, dict):
        raise SpecError(f"{source}: a config is a JSON object, got {type(config).__name__}")
    return config


def _warn_unknown_fields(config_class: type, fields: dict) -> None:
    """A field the config class does not define is kept as an attribute no model code reads.
    (A config's fields: what it serializes, its aliases, and its properties such as num_labels.)"""
    try:
        defaults = config_class()
        known = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {})) | set(dir(defaults))
    except Exception:  # noqa: BLE001 - a config class without defaults (composite): nothing to check
        return
    unknown = sorted(set(fields) - known)
    if not unknown:
        return
    described = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1)
        described.append(f"{key} (did you mean {close[0]}?)" if close else key)
    warnings.warn(f"{config_class.__name__} has no field {', '.join(described)}; the model may ignore "
                  f"{'it' if len(unknown) == 1 else 'them'}", stacklevel=3)


def build(cls: type, spec_text: str, args: tuple, overrides: dict, model_config: Optional[str], *,
          device: str = "meta") -> nn.Module:
    """`cls(config)` under `torch.device(device)`, the config from `model_config` and `overrides`.

    Raises:
        SpecError: positional arguments, a config of another model type, or a config the model
            rejects.
    """
    if args:
        raise SpecError(f"MODEL {spec_text!r}: a Hugging Face model takes config fields by name, "
                        f"e.g. '{spec_text.partition('(')[0]}(n_layer=2)'")
    config_class = getattr(cls, "config_class", None)
    if not isinstance(config_class, type):
        raise SpecError(f"MODEL {spec_text!r}: {cls.__name__} has no config_class to build its config from")
    fields = {**(load_config_dict(model_config) if model_config is not None else {}), **overrides}
    given_type, wanted_type = fields.get("model_type"), getattr(config_class, "model_type", None)
    if given_type and wanted_type and given_type != wanted_type:
        raise SpecError(f"--model-config is a {given_type!r} config; {cls.__name__} takes a {wanted_type!r} "
                        f"one ({config_class.__name__})")
    _warn_unknown_fields(config_class, fields)
    try:
        config = config_class.from_dict(fields)
        with torch.device(device):
            return cls(config)
    except Exception as e:  # noqa: BLE001 - a config the model cannot be built from is the user's to fix
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise SpecError(f"MODEL {spec_text!r}: {cls.__name__} cannot be built from this config: "
                        f"{type(e).__name__}: {message}") from e


def _forward_parameters(model: nn.Module) -> list[str]:
    return [name for name, p in inspect.signature(model.forward).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def default_constants(model: nn.Module) -> dict[str, Any]:
    """The constants a Hugging Face model's call gets unless --inputs names them."""
    return {"use_cache": False} if "use_cache" in _forward_parameters(model) else {}


def default_inputs(model: nn.Module, *, what: str) -> str:
    """The --inputs spec a Hugging Face model is traced on when none is given.

        input_ids=int64[B,T]:0..vocab_size      forward takes input_ids (T = min(128, max_position_embeddings)),
                                                and decoder_input_ids alike for an encoder-decoder
        pixel_values=float32[B,C,S,S]           forward takes pixel_values (C num_channels, S image_size or 224)

    Raises:
        SpecError: a model whose main input is neither; the message lists what forward takes.
    """
    config = model.config
    params = _forward_parameters(model)
    main = getattr(model, "main_input_name", "input_ids")
    parts = []
    if main == "input_ids" and "input_ids" in params and isinstance(getattr(config, "vocab_size", None), int):
        positions = getattr(config, "max_position_embeddings", None)
        seq = min(DEFAULT_SEQ_LEN, positions) if isinstance(positions, int) and positions > 0 else DEFAULT_SEQ_LEN
        ids = f"int64[{DEFAULT_BATCH},{seq}]:0..{config.vocab_size}"
        parts.append(f"input_ids={ids}")
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            parts.append(f"decoder_input_ids={ids}")
    elif main == "pixel_values" and "pixel_values" in params:
        size = getattr(config, "image_size", None) or DEFAULT_IMAGE_SIZE
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        parts.append(f"pixel_values=float32[{DEFAULT_BATCH},{getattr(config, 'num_channels', 3)},{height},{width}]")
    else:
        raise SpecError(
            f"{what} ({type(model).__name__}) has no default inputs: its forward takes {', '.join(params)}; "
            f"describe them with --inputs, e.g. --inputs '{main}=int64[2,128]:0..1000'"
        )
    return " ".join(parts)


def config_record(model: nn.Module) -> Optional[dict]:
    """The config of a Hugging Face model as JSON (what differs from the defaults), for the
    manifest; None for any other model."""
    if not is_hf_model(model):
        return None
    return json.loads(json.dumps(model.config.to_diff_dict(), default=str))

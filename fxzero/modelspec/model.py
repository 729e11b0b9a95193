"""MODEL specs: what a name resolves to, and building it on the meta device.

    gpt2                                a zoo model (`fxzero.zoo.MODELS`)
    pkg.module:factory                  a callable in an importable module
    path/to/file.py:ClassName           a callable in a Python file
    transformers:ClassName              a Hugging Face model, built from its config (`hf.py`)
    NAME(key=value, ...)                any of the above, called with keyword arguments
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Optional

import torch
import torch.nn as nn

from fxzero.modelspec import hf
from fxzero.modelspec.errors import SpecError

__all__ = ["ModelSpec", "build_model", "parse_model"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A parsed MODEL spec: where the factory lives and the arguments it is called with."""

    text: str
    """The spec as written."""
    target: str
    """The zoo name, `module:attr` or `file.py:attr`, without arguments."""
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


_HELP = (
    "a MODEL is a zoo name ({zoo}), 'pkg.module:factory', 'path/to/file.py:ClassName' or "
    "'transformers:ClassName', optionally called with literal arguments, e.g. 'gpt-tiny(n_blocks=2)'"
)


def _zoo_names() -> list[str]:
    from fxzero import zoo

    return sorted(zoo.MODELS)


def parse_model(text: str) -> ModelSpec:
    """Split `text` into its target and literal call arguments (nothing is imported yet)."""
    text = text.strip()
    if not text:
        raise SpecError("empty MODEL spec; " + _HELP.format(zoo=", ".join(_zoo_names())))
    target, args, kwargs = text, (), ()
    if text.endswith(")") and "(" in text:
        target, _, rest = text.partition("(")
        try:
            call = ast.parse(f"f({rest}", mode="eval").body
            assert isinstance(call, ast.Call)
            args = tuple(ast.literal_eval(a) for a in call.args)
            kwargs = tuple((k.arg, ast.literal_eval(k.value)) for k in call.keywords)
        except (SyntaxError, ValueError, AssertionError, TypeError) as e:
            raise SpecError(
                f"MODEL {text!r}: the arguments in parentheses must be Python literals "
                f"like n_blocks=2 or widths=(8, 16) ({type(e).__name__})"
            ) from None
        if any(k is None for k, _ in kwargs):
            raise SpecError(f"MODEL {text!r}: **kwargs are not supported; name each argument")
    return ModelSpec(text, target.strip(), args, kwargs)


def _load_file(path: str, spec_text: str):
    if not os.path.isfile(path):
        raise SpecError(f"MODEL {spec_text!r}: no such file {path!r}")
    name = "fxzero_user_" + re.sub(r"\W", "_", os.path.abspath(path))
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"MODEL {spec_text!r}: {path!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    # The file's own folder is importable while it loads, as for `python file.py`.
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise SpecError(f"MODEL {spec_text!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def _load_module(name: str, spec_text: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise SpecError(
                f"MODEL {spec_text!r}: no module named {e.name!r} (is it installed, or on "
                "PYTHONPATH? a file is named as path/to/file.py:Name)"
            ) from e
        raise SpecError(f"MODEL {spec_text!r}: importing {name} failed: {e}") from e
    except Exception as e:
        raise SpecError(f"MODEL {spec_text!r}: importing {name} failed: {type(e).__name__}: {e}") from e


def _resolve(spec: ModelSpec):
    """The callable a spec names."""
    from fxzero import zoo

    if spec.target in zoo.MODELS:
        return zoo.MODELS[spec.target]
    if ":" not in spec.target:
        close = [n for n in zoo.MODELS if spec.target.lower() in n or n in spec.target.lower()]
        hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
        raise SpecError(
            f"MODEL {spec.text!r} does not resolve{hint}: "
            + _HELP.format(zoo=", ".join(_zoo_names()))
        )
    where, _, attr = spec.target.rpartition(":")
    if not where or not attr:
        raise SpecError(f"MODEL {spec.text!r}: expected 'module:name' or 'file.py:name' with both parts")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _load_file(where, spec.text)
    else:
        module = _load_module(where, spec.text)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            raise SpecError(
                f"MODEL {spec.text!r}: {where} has no attribute {attr!r}"
                + (f"; it defines {', '.join(names[:12])}" if names else "")
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"MODEL {spec.text!r}: {attr} is a {type(obj).__name__}, not a class or factory")
    return obj


def build_model(spec: ModelSpec | str, *, model_config: Optional[str] = None, device: str = "meta") -> nn.Module:
    """Build the model a spec names, on `device` (meta by default: nothing is allocated).

    Args:
        model_config: for a Hugging Face model (`transformers:ClassName`, or any
            `transformers.PreTrainedModel` subclass a spec names), its config: a JSON object or
            the path of a config.json (`hf.load_config_dict`); None: the config class's defaults.

    Raises:
        SpecError: the spec does not resolve, the factory rejects its arguments, it does not
            return an nn.Module, or `model_config` is given for a model that is not a Hugging
            Face one.
    """
    if isinstance(spec, str):
        spec = parse_model(spec)
    if hf.is_hf_target(spec.target):
        return hf.build(hf.resolve_class(spec.target, spec.text), spec.text, spec.args, dict(spec.kwargs),
                        model_config, device=device)
    factory = _resolve(spec)
    if hf.is_model_class(factory):
        return hf.build(factory, spec.text, spec.args, dict(spec.kwargs), model_config, device=device)
    if model_config is not None:
        raise SpecError(
            f"--model-config applies to Hugging Face models (MODEL 'transformers:ClassName'); "
            f"{spec.text!r} takes its settings as arguments, e.g. 'gpt-tiny(n_blocks=2)'"
        )
    try:
        with torch.device(device):
            model = factory(*spec.args, **dict(spec.kwargs))
    except SpecError:
        raise
    except (TypeError, ValueError) as e:
        raise SpecError(f"MODEL {spec.text!r}: {e}") from e
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise SpecError(f"MODEL {spec.text!r} returned the class {model.__name__}; return an instance")
    if not isinstance(model, nn.Module):
        raise SpecError(f"MODEL {spec.text!r} built a {type(model).__name__}, not a torch.nn.Module")
    return model

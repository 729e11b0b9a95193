"""MODEL and --inputs specs: how the CLI names a model and the inputs it is traced on.

A MODEL spec is one of

    gpt2                                a zoo model (`fxzero.zoo.MODELS`)
    pkg.module:factory                  a callable in an importable module
    path/to/file.py:ClassName           a callable in a Python file
    NAME(key=value, ...)                any of the above, called with keyword arguments

The arguments are Python literals (`'gpt-tiny(n_blocks=2)'`, `'models.py:Net(widths=(8, 16))'`).
Models are built under `torch.device("meta")`, so naming a 7B model allocates nothing.

An --inputs spec is `DTYPE[SHAPE]`, with `:LOW..HIGH` for integer dtypes (the value range of
token ids, HIGH exclusive): `int64[2,128]:0..50257`, `float32[8,3,32,32]`. Several inputs are
separated by `;` or given as repeated options.

Every mistake raises `SpecError`, a ValueError whose message is one line a person can act on.
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
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["InputSpec", "ModelSpec", "SpecError", "build_model", "example_inputs", "parse_inputs", "parse_model"]


class SpecError(ValueError):
    """A MODEL or --inputs spec that does not resolve; the message says how to fix it."""


# ---------------------------------------------------------------------------------------------
# MODEL


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
    "a MODEL is a zoo name ({zoo}), 'pkg.module:factory' or 'path/to/file.py:ClassName', "
    "optionally called with literal arguments, e.g. 'gpt-tiny(n_blocks=2)'"
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


def build_model(spec: ModelSpec | str, *, device: str = "meta") -> nn.Module:
    """Build the model a spec names, on `device` (meta by default: nothing is allocated).

    Raises:
        SpecError: the spec does not resolve, the factory rejects its arguments, or it does not
            return an nn.Module.
    """
    if isinstance(spec, str):
        spec = parse_model(spec)
    factory = _resolve(spec)
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


# ---------------------------------------------------------------------------------------------
# --inputs


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One example input: dtype, shape and, for integers, the value range [low, high)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    low: Optional[int] = None
    high: Optional[int] = None

    def __str__(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')}[{','.join(map(str, self.shape))}]"
        return text + (f":{self.low}..{self.high}" if self.high is not None else "")

    def to_json(self) -> dict:
        return {"dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.shape),
                "low": self.low, "high": self.high}

    @classmethod
    def from_json(cls, d: dict) -> "InputSpec":
        return cls(getattr(torch, d["dtype"]), tuple(d["shape"]), d.get("low"), d.get("high"))

    @classmethod
    def of(cls, t: torch.Tensor) -> "InputSpec":
        """The spec of an example tensor (integer ranges from its values when it has any)."""
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_meta or t.numel() == 0:
            return cls(t.dtype, tuple(t.shape))
        return cls(t.dtype, tuple(t.shape), int(t.min()), int(t.max()) + 1)

    def make(self, generator: Optional[torch.Generator] = None, batch: Optional[int] = None) -> torch.Tensor:
        """A CPU tensor of this spec (dimension 0 replaced by `batch` when given)."""
        shape = (batch, *self.shape[1:]) if batch is not None and self.shape else self.shape
        if self.dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=generator).bool()
        if self.dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(self.dtype)
        return torch.randint(self.low, self.high, shape, generator=generator, dtype=self.dtype)


_INPUT = re.compile(r"^\s*(\w+)\s*\[([\d\s,]*)\]\s*(?::\s*(-?\d+)\s*\.\.\s*(-?\d+))?\s*$")
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def parse_inputs(texts: Sequence[str]) -> list[InputSpec]:
    """Parse --inputs values (each may hold several specs separated by ';')."""
    specs = []
    for text in texts:
        for part in filter(str.strip, text.split(";")):
            m = _INPUT.match(part)
            if not m:
                raise SpecError(
                    f"--inputs {part.strip()!r}: expected DTYPE[SHAPE], with :LOW..HIGH for integers, "
                    "e.g. 'int64[2,128]:0..50257' or 'float32[8,3,32,32]'"
                )
            name, dims, low, high = m.groups()
            dtype = _DTYPES.get(name.lower())
            if dtype is None:
                raise SpecError(f"--inputs {part.strip()!r}: unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPES))}")
            shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
            integer = not dtype.is_floating_point and dtype != torch.bool
            if integer and low is None:
                raise SpecError(
                    f"--inputs {part.strip()!r}: an integer input needs its value range, "
                    f"e.g. '{name}[{dims}]:0..50257' for token ids below 50257"
                )
            if not integer and low is not None:
                raise SpecError(f"--inputs {part.strip()!r}: a value range applies to integer dtypes only")
            if integer and int(low) >= int(high):
                raise SpecError(f"--inputs {part.strip()!r}: the range {low}..{high} is empty (HIGH is exclusive)")
            specs.append(InputSpec(dtype, shape, int(low) if integer else None, int(high) if integer else None))
    return specs


def example_inputs(model: nn.Module, specs: Sequence[InputSpec] = (), *, what: str = "the model") -> tuple[torch.Tensor, ...]:
    """The inputs to trace `model` on: from `specs` when given, else `model.example_inputs()`.

    Raises:
        SpecError: no specs and no usable example_inputs() method.
    """
    if specs:
        gen = torch.Generator().manual_seed(0)
        return tuple(s.make(gen) for s in specs)
    method = getattr(model, "example_inputs", None)
    if not callable(method):
        raise SpecError(
            f"{what} ({type(model).__name__}) has no example_inputs() method; describe its inputs "
            "with --inputs, e.g. --inputs 'int64[2,128]:0..50257' or --inputs 'float32[8,3,32,32]'"
        )
    out = method()
    if isinstance(out, torch.Tensor):
        out = (out,)
    if not (isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out)):
        raise SpecError(
            f"{type(model).__name__}.example_inputs() returned {type(out).__name__}; it must return "
            "a tuple of tensors (or pass --inputs)"
        )
    return tuple(out)

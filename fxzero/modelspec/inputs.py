"""--inputs specs: the call a model is traced on, `model(*args, **kwargs)`.

    SPEC   := ITEM (SEP ITEM)*             SEP: ';', or spaces before the next item; or repeat --inputs
    ITEM   := TENSOR                       a positional input (all of them come first)
            | NAME=TENSOR                  a keyword input
            | NAME=CONSTANT                a keyword constant of the program
    TENSOR := DTYPE[SHAPE]                 float32[8,3,32,32]
            | DTYPE[SHAPE]:LOW..HIGH       integers in [LOW, HIGH): int64[2,128]:0..50257
    CONSTANT := true | false | none | an integer | a number

For example `'input_ids=int64[2,128]:0..50257 attention_mask=int64[2,128]:1..2 use_cache=false'`.
A tensor's values are drawn at random (seed 0); only shapes, dtypes and constants shape the
traced program.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn

from fxzero.modelspec import hf
from fxzero.modelspec.errors import SpecError

__all__ = ["CallSpec", "Constant", "ExampleCall", "InputSpec", "example_call", "example_inputs", "parse_call",
           "parse_inputs"]


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


Constant = Union[bool, int, float, None]
"""A keyword argument that is not a tensor: a constant of the traced program (`use_cache=false`)."""


def _constant_text(value: Constant) -> str:
    """A constant as --inputs writes it: true, false, none, 3, 0.5."""
    if value is None or isinstance(value, bool):
        return {True: "true", False: "false", None: "none"}[value]
    return repr(value)


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """How a model is called: positional tensor inputs, then keyword tensors and constants."""

    args: tuple[InputSpec, ...] = ()
    """The positional inputs, in order."""
    kwargs: tuple[tuple[str, Union[InputSpec, Constant]], ...] = ()
    """The keyword arguments, in the order given: a tensor's spec, or a constant."""

    @property
    def empty(self) -> bool:
        return not self.args and not self.kwargs

    def __str__(self) -> str:
        named = (f"{k}={v if isinstance(v, InputSpec) else _constant_text(v)}" for k, v in self.kwargs)
        return " ".join([*map(str, self.args), *named])

    def to_json(self) -> list[dict]:
        """One entry per argument: an InputSpec's JSON, with "name" for a keyword; a constant
        is {"name", "value"}."""
        out = [s.to_json() for s in self.args]
        for name, v in self.kwargs:
            out.append({"name": name, **v.to_json()} if isinstance(v, InputSpec) else {"name": name, "value": v})
        return out

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Optional[Mapping[str, Any]] = None) -> "CallSpec":
        """The spec of an example call (tensors described by `InputSpec.of`)."""
        def describe(x: Any, where: str):
            if isinstance(x, torch.Tensor):
                return InputSpec.of(x)
            if x is None or isinstance(x, (bool, int, float)):
                return x
            raise SpecError(f"{where} is a {type(x).__name__}; an example input is a tensor or a constant")

        return cls(tuple(describe(x, f"argument {i}") for i, x in enumerate(args)),
                   tuple((k, describe(v, k)) for k, v in (kwargs or {}).items()))

    def make(self, generator: Optional[torch.Generator] = None,
             batch: Optional[int] = None) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """The call's (args, kwargs): CPU tensors of each spec, in order, and the constants."""
        args = tuple(s.make(generator, batch) for s in self.args)
        kwargs = {k: v.make(generator, batch) if isinstance(v, InputSpec) else v for k, v in self.kwargs}
        return args, kwargs


# ---------------------------------------------------------------------------------------------
# Parsing

# A run of spaces where the next item starts: before `NAME=` or `DTYPE[`, never right after
# an '=' (`x = int64[2]`), nor inside brackets (a shape holds no names: `float32[2, 3]`).
_ITEM_BREAK = re.compile(r"(?<![=\s])\s+(?=[A-Za-z_]\w*\s*[=\[])")
_KEYWORD = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(.*?)\s*$", re.S)
_TENSOR = re.compile(r"^\s*(\w+)\s*\[([\d\s,]*)\]\s*(?::\s*(-?\d+)\s*\.\.\s*(-?\d+))?\s*$")
_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.I)
_WORDS = {"true": True, "false": False, "none": None}
_NOT_A_CONSTANT = object()
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_EXPECTED = ("expected DTYPE[SHAPE] (with :LOW..HIGH for integers), NAME=DTYPE[SHAPE] or NAME=CONSTANT, "
             "e.g. 'int64[2,128]:0..50257', 'float32[8,3,32,32]' or 'input_ids=int64[2,128]:0..50257 use_cache=false'")


def _tensor(text: str, item: str) -> InputSpec:
    m = _TENSOR.match(text)
    if not m:
        raise SpecError(f"--inputs {item!r}: {_EXPECTED}")
    name, dims, low, high = m.groups()
    dtype = _DTYPES.get(name.lower())
    if dtype is None:
        raise SpecError(f"--inputs {item!r}: unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPES))}")
    shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
    integer = not dtype.is_floating_point and dtype != torch.bool
    if integer and low is None:
        raise SpecError(
            f"--inputs {item!r}: an integer input needs its value range, "
            f"e.g. '{name}[{dims}]:0..50257' for token ids below 50257"
        )
    if not integer and low is not None:
        raise SpecError(f"--inputs {item!r}: a value range applies to integer dtypes only")
    if integer and int(low) >= int(high):
        raise SpecError(f"--inputs {item!r}: the range {low}..{high} is empty (HIGH is exclusive)")
    return InputSpec(dtype, shape, int(low) if integer else None, int(high) if integer else None)


def _constant(text: str):
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    if _NUMBER.match(text):
        return int(text) if text.lstrip("-").isdigit() else float(text)
    return _NOT_A_CONSTANT


def _item(item: str) -> tuple[Optional[str], Union[InputSpec, Constant]]:
    """(None, spec) for a positional input, (name, spec or constant) for a keyword one."""
    keyword = _KEYWORD.match(item)
    if keyword is None:
        if "=" in item:
            raise SpecError(f"--inputs {item!r}: a keyword input is NAME=VALUE, NAME a Python identifier "
                            "such as input_ids")
        if _constant(item) is not _NOT_A_CONSTANT:
            raise SpecError(f"--inputs {item!r}: a constant is passed by name, NAME={item} (e.g. use_cache=false)")
        return None, _tensor(item, item)
    name, value = keyword.groups()
    if not value:
        raise SpecError(f"--inputs {item!r}: no value after '='; e.g. {name}=int64[2,128]:0..50257 or {name}=false")
    if "[" in value:
        return name, _tensor(value, item)
    constant = _constant(value)
    if constant is _NOT_A_CONSTANT:
        raise SpecError(f"--inputs {item!r}: {value!r} is neither DTYPE[SHAPE] nor a constant "
                        "(true, false, none or a number)")
    return name, constant


def parse_call(texts: Sequence[str]) -> CallSpec:
    """Parse --inputs values (each may hold several items, separated by spaces or ';')."""
    args: list[InputSpec] = []
    kwargs: dict[str, Union[InputSpec, Constant]] = {}
    for text in texts:
        for part in filter(str.strip, text.split(";")):
            for item in _ITEM_BREAK.split(part.strip()):
                name, value = _item(item)
                if name is None:
                    if kwargs:
                        raise SpecError(f"--inputs {item!r}: a positional input after keyword inputs "
                                        f"({', '.join(kwargs)}); give the positional inputs first")
                    args.append(value)
                elif name in kwargs:
                    raise SpecError(f"--inputs {item!r}: {name} is given twice")
                else:
                    kwargs[name] = value
    return CallSpec(tuple(args), tuple(kwargs.items()))


def parse_inputs(texts: Sequence[str]) -> list[InputSpec]:
    """Parse --inputs values that are positional inputs only (`parse_call` takes keywords too)."""
    call = parse_call(texts)
    if call.kwargs:
        name = call.kwargs[0][0]
        raise SpecError(f"--inputs '{name}=...': only positional inputs are taken here, "
                        "e.g. 'int64[8,64]:0..1000' or 'float32[8,3,32,32]'")
    return list(call.args)


# ---------------------------------------------------------------------------------------------
# The inputs a model is traced on


def example_inputs(model: nn.Module, specs: Sequence[InputSpec] = (), *, what: str = "the model") -> tuple[torch.Tensor, ...]:
    """Positional inputs to trace `model` on: from `specs` when given, else `model.example_inputs()`.

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
            "with --inputs, e.g. --inputs 'int64[2,128]:0..50257', 'float32[8,3,32,32]' or "
            "'input_ids=int64[2,128]:0..50257'"
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


class ExampleCall(NamedTuple):
    """The call a model is traced on, with the spec that describes it (for the manifest)."""

    spec: CallSpec
    args: tuple
    kwargs: dict
    completed: bool
    """True when fxzero made up part of `spec`: a Hugging Face model's default inputs or
    constants (`hf.default_inputs`, `hf.default_constants`), which the CLI says."""


def example_call(model: nn.Module, spec: CallSpec = CallSpec(), *, what: str = "the model") -> ExampleCall:
    """The call to trace `model` on: `spec` when given, else `model.example_inputs()`, else for a
    Hugging Face model its default inputs; a Hugging Face model's call also gets the default
    constants `spec` does not name (use_cache=false).

    Raises:
        SpecError: nothing gives the inputs.
    """
    is_hf = hf.is_hf_model(model)
    if spec.empty and (not is_hf or callable(getattr(model, "example_inputs", None))):
        xs = example_inputs(model, what=what)
        return ExampleCall(CallSpec.of(xs), xs, {}, completed=False)
    full = spec
    if is_hf:
        given = spec if not spec.empty else parse_call([hf.default_inputs(model, what=what)])
        named = {name for name, _ in given.kwargs}
        added = tuple((k, v) for k, v in hf.default_constants(model).items() if k not in named)
        full = CallSpec(given.args, given.kwargs + added)
    return ExampleCall(full, *full.make(torch.Generator().manual_seed(0)), completed=full != spec)

"""DeepSpeed's ZeRO-3 leaf modules (`deepspeed.utils.set_z3_leaf_modules`): modules gathered whole.

DeepSpeed's ZeRO-3 gathers each module's own parameters as its forward starts, in the order it
recorded on the first step, and prefetches along that order. A mixture-of-experts block runs
other experts on every batch, so that order breaks; `set_z3_leaf_modules(model, [MoeBlock])`
flags such blocks (`module._z3_leaf = True`) and DeepSpeed then gathers each one's parameters,
its children's included, as one piece. Hugging Face's accelerate (`transformer_moe_cls_names`),
LLaMA-Factory and axolotl call it for every MoE model they train at ZeRO-3, and DeepSpeed's
config has the same as `zero_optimization.leaf_module` (by default Mixtral's, Qwen2-MoE's and
Qwen3-MoE's sparse blocks).

[Note: leaf modules are never split across units]
fxzero's gathers follow the program, which is the same on every step whatever the experts do,
so the order problem does not arise. What the flag still means here is its promise, that the
module's parameters come and go as one piece: `fxzero/units.py` never splits a leaf module
across units. A leaf inside a unit stays in it (with the default policy, a model's blocks; a
mixture-of-experts block is inside its decoder layer); a leaf that a units policy would split
(`UnitsPolicy(module_classes=(Expert,))` inside a leaf block) is one unit instead; and a leaf
outside every unit is a unit of its own rather than part of the root unit. At ZeRO-3 its
parameters carry `ds_z3_leaf_module` (the outermost leaf holding them), as DeepSpeed's do,
which `z3_leaf_parameter` reads.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Sequence, Union

import torch.nn as nn

from fxzero.config.policies import DEFAULT_LEAF_CLASSES, LeafModules

__all__ = ["apply_leaf_modules", "get_z3_leaf_modules", "mark_leaf_parameters",
           "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]

_FLAG = "_z3_leaf"  # (DeepSpeed's attribute: code written for DeepSpeed may set or read it directly)
_PARAM_ATTR = "ds_z3_leaf_module"

ClassRef = Union[type, str]
"""A module class, or its name: `__name__` or the fully qualified `module.QualName`."""


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether `module` is flagged as a leaf."""
    return bool(getattr(module, _FLAG, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether `param` belongs to a leaf module (set at ZeRO-3 when the engine starts, as DeepSpeed's)."""
    return hasattr(param, _PARAM_ATTR)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` flagged as leaves, in module order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    setattr(module, _FLAG, flag)


def _matches(module: nn.Module, ref: ClassRef) -> bool:
    if isinstance(ref, type):
        return isinstance(module, ref)
    cls = type(module)
    return ref in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(model: nn.Module, classes: Sequence[ClassRef], flag: bool,
                  raise_if_not_found: bool) -> list[nn.Module]:
    if isinstance(classes, (str, type)) or not all(isinstance(c, (str, type)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of module classes or class names, got {classes!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for module in found:
        set_z3_leaf_module(module, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"no module of the classes {list(classes)} in the model ({type(model).__name__}): name a class "
                         "the model has (its class, or the class's name), or pass raise_if_not_found=False")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[ClassRef],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of `model` that is an instance of one of `leaf_module_classes` (classes or
    class names) as a leaf: its parameters, its children's included, are never split across units
    ([Note: leaf modules are never split across units]). Returns the modules flagged.

    Raises:
        ValueError: no module matches (unless `raise_if_not_found` is False).
    """
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[ClassRef],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the leaf flag of the modules `set_z3_leaf_modules` would flag; returns them."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def _set_by(model: nn.Module, keys: Iterable[str], flag: bool, raise_if_not_found: bool, what: str,
            match) -> tuple[list[nn.Module], list[str]]:
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for key in keys:
        hits = [m for name, m in named if match(name, key)]
        if not hits:
            missing.append(key)
        for module in hits:
            set_z3_leaf_module(module, flag)
            found.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"no module {what} {missing} in the model ({type(model).__name__}): see "
                         "model.named_modules() for the names, or pass raise_if_not_found=False")
    return list(found.values()), missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of the modules named (as `model.named_modules()` names them); returns the
    modules and the names that matched none."""
    return _set_by(model, module_names, flag, raise_if_not_found, "named", lambda name, key: name == key)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of the modules whose name ends with one of the suffixes; returns the
    modules and the suffixes that matched none."""
    return _set_by(model, module_name_suffixes, flag, raise_if_not_found, "whose name ends with",
                   lambda name, key: name.endswith(key))


def apply_leaf_modules(model: nn.Module, leaves: LeafModules) -> list[nn.Module]:
    """Flag the modules `leaves` selects (`Config.leaf_modules`; none found is no error: DeepSpeed's
    default classes are ones most models lack); an entry beyond DeepSpeed's defaults that matches
    nothing is warned about, as DeepSpeed warns. Returns the modules flagged."""
    flagged = {id(m): m for m in _set_by_class(model, leaves.classes, True, raise_if_not_found=False)}
    for keys, setter, what in ((leaves.names, set_z3_leaf_modules_by_name, "names"),
                               (leaves.name_suffixes, set_z3_leaf_modules_by_suffix, "name suffixes")):
        modules, missing = setter(model, keys, raise_if_not_found=False)
        flagged.update((id(m), m) for m in modules)
        if missing:
            warnings.warn(f"Config.leaf_modules (zero_optimization.leaf_module): no module matches the {what} "
                          f"{missing}; those entries flag nothing (see model.named_modules())", stacklevel=2)
    if not flagged and leaves.classes and leaves.classes != DEFAULT_LEAF_CLASSES:
        warnings.warn(f"Config.leaf_modules (zero_optimization.leaf_module): no module of the classes "
                      f"{list(leaves.classes)} in the model ({type(model).__name__}); no module is flagged as a "
                      "leaf", stacklevel=2)
    return list(flagged.values())


def mark_leaf_parameters(model: nn.Module) -> None:
    """Give each parameter under a leaf module `ds_z3_leaf_module` (the outermost leaf holding it),
    as DeepSpeed's ZeRO-3 does when it registers its hooks; clear it elsewhere."""
    leaf_of: dict[int, tuple[nn.Parameter, "nn.Module | None"]] = {}

    def visit(module: nn.Module, leaf: "nn.Module | None") -> None:
        leaf = leaf if leaf is not None else (module if z3_leaf_module(module) else None)
        for p in module.parameters(recurse=False):
            if leaf_of.get(id(p), (p, None))[1] is None:  # (a parameter shared with a leaf is the leaf's)
                leaf_of[id(p)] = (p, leaf)
        for child in module.children():
            visit(child, leaf)

    visit(model, None)
    for p, leaf in leaf_of.values():
        if leaf is not None:
            setattr(p, _PARAM_ATTR, leaf)
        else:
            p.__dict__.pop(_PARAM_ATTR, None)

"""The Python state of a model's modules, and forwards that change it on every call.

[Note: a forward that changes its module's state]
A trace runs the forward in Python and records the tensor operations it reaches; the Python
around them runs at trace time only. A forward that keeps Python state on its module and decides
by it (DeepSpeed's leaf-module test model picks `self.linears[self.counter % 2]` and then does
`self.counter += 1`) would be traced once and replayed with the trace's decision on every later
call: a silent wrong answer (that model trained one of its two layers). So the trace snapshots
each module's own attributes (not its parameters, buffers, submodules or hooks) before the
forward, after the first of its two runs of the forward and after the second
(`fxzero/trace.py::trace_joint`). A change in the second run means the forward changes the
state on every call: the snapshot from before is put back and `StatefulForward` raised, which
an engine answers by running that forward eagerly, as eager PyTorch would, and which
`fxzero schedule` reports. A change in the first run only (an attribute set on the first call
and the same after every later one, a lazily built table) leaves the program valid, and stays.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn

__all__ = ["StatefulForward", "changed", "restore", "snapshot"]

_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"}
"""The attributes every nn.Module has (its parameters, buffers, submodules, hooks): not the
module's own state."""

Snapshot = dict[tuple[str, str], tuple[Any, Any]]
"""(module FQN, attribute) -> (the object, a copy of its value then where it is plain data, else
None: compared by identity)."""

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_PLAIN_TYPES = frozenset(_PLAIN_SCALARS)


class StatefulForward(ValueError):
    """The forward changes its modules' Python attributes on every call
    ([Note: a forward that changes its module's state])."""

    needs_values = True
    """As `fxzero.trace.DataDependentControlFlow.needs_values`: an engine runs the forward eagerly."""

    def __init__(self, changes: list[str]) -> None:
        super().__init__(
            f"the forward changes {'; '.join(changes[:3])}{' ...' if len(changes) > 3 else ''} on every call: fxzero "
            "traces the model once into one static program, which would repeat the traced call's Python decisions "
            "and not the change. Keep such state out of the module's attributes (pass it as an input, or keep it in "
            "a buffer the forward updates with tensor operations)")
        self.changes = changes

    def with_rank(self, rank: int) -> "StatefulForward":
        self.args = (f"[rank {rank}] {self.args[0]}",)
        return self


def _own_state(module: nn.Module, seen: set[int]):
    """The module's own attributes, and the scalar settings of an object it holds (a Hugging Face
    config's `use_cache`, `pad_token_id`: forwards read them at every call), under "attr.setting",
    once per object (`seen`: the ids of those listed already; a config every layer holds is listed
    at its first holder). Types are read with `type()`, never through the object (a Hugging Face
    config's `__getattribute__` is costly, and this runs before every call)."""
    for name, value in vars(module).items():  # (methods and functions set on it are behaviour, not state)
        kind = type(value)
        if name in _MODULE_INTERNALS or issubclass(kind, (torch.Tensor, nn.Module)) or callable(value):
            continue
        yield name, value
        if kind in _PLAIN_TYPES or id(value) in seen or issubclass(kind, (type, list, tuple, set, frozenset, dict)):
            continue
        seen.add(id(value))
        try:
            settings = object.__getattribute__(value, "__dict__")
        except AttributeError:
            continue
        for setting, v in list(settings.items()):
            if type(v) in _PLAIN_TYPES:
                yield f"{name}.{setting}", v


def _plain(value: Any, depth: int = 0) -> bool:
    """Numbers, strings, None, and lists, tuples, sets and dicts of them: the values a forward
    decides by, copied and compared by value. Any other object is compared by identity (an
    attribute rebound to another object is a change; one changed inside is not seen)."""
    kind = type(value)  # (never through the object: see _own_state)
    if kind in _PLAIN_TYPES or issubclass(kind, _PLAIN_SCALARS):
        return True
    if depth > 4:
        return False
    if issubclass(kind, (list, tuple, set, frozenset)):
        return all(_plain(v, depth + 1) for v in value)
    if issubclass(kind, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def snapshot(model: nn.Module) -> Snapshot:
    """Each module's own attributes: the object, and a copy where it is plain data."""
    return observe(model)[0]


def observe(model: nn.Module) -> tuple[Snapshot, tuple]:
    """`snapshot(model)`, and what the modules run, by identity (a program traced with other code
    computes what that code did, so it is stale): their hooks (forward, forward-pre, backward,
    backward-pre) and torch's global module hooks, functions set on a module (`model.forward =
    ...`, a gradient-checkpointing function), and each class's `forward` (a library patching
    `LlamaAttention.forward`). One walk over the modules: the engine reads both before every call
    (2.4 ms for a 32-layer Hugging Face Llama on this CPU)."""
    seen: set[int] = set()
    snap: Snapshot = {}
    code: list = []
    classes: dict[type, int] = {}
    for fqn, module in model.named_modules():
        for name, value in _own_state(module, seen):
            snap[(fqn, name)] = (value, _copy(value))
        _code_of(fqn, module, code, classes)
    return snap, _code_summary(code, classes)


def _copy(value: Any) -> Any:
    """A copy of plain data (a scalar is its own: immutable), None for any other object."""
    if type(value) in _PLAIN_TYPES:
        return value
    return copy.deepcopy(value) if _plain(value) else None


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _code_of(fqn: str, m: nn.Module, code: list, classes: dict) -> None:
    hooks = tuple(tuple(map(id, getattr(m, d).values())) if getattr(m, d) else () for d in _HOOK_DICTS)
    functions = tuple((name, id(v)) for name, v in vars(m).items()
                      if name not in _MODULE_INTERNALS and callable(v) and not issubclass(type(v), (torch.Tensor, nn.Module)))
    if any(hooks) or functions:
        code.append((fqn, hooks, functions))
    kind = type(m)
    if kind not in classes:
        classes[kind] = id(getattr(kind, "forward", None))


def _code_summary(code: list, classes: dict) -> tuple:
    from torch.nn.modules import module as torch_module

    global_hooks = tuple(tuple(map(id, getattr(torch_module, name, {}).values())) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"))
    return tuple(code), global_hooks, tuple((t.__qualname__, i) for t, i in classes.items())


def fingerprint(snap: Snapshot) -> tuple:
    """A hashable summary of a snapshot: equal for two snapshots between which `changed` sees no
    change (plain data by value, other objects by identity)."""
    return tuple(sorted((key, _frozen(copy_) if copy_ is not None else ("id", id(obj)))
                        for key, (obj, copy_) in snap.items()))


def _frozen(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_frozen, value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(map(_frozen, value)))
    if isinstance(value, dict):
        return ("dict", *((_frozen(k), _frozen(v)) for k, v in value.items()))
    return (type(value).__name__, value)


def _differs(old: "tuple[Any, Any] | None", new: "tuple[Any, Any] | None") -> bool:
    if old is None or new is None:
        return True
    if old[1] is None or new[1] is None:  # (not plain data, then or now: by identity)
        return old[0] is not new[0] or (old[1] is None) != (new[1] is None)
    return not _equal(old[1], new[1])


def _equal(a: Any, b: Any) -> bool:
    """Plain data equal by value, a NaN equal to a NaN (an attribute holding NaN is unchanged)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def changed(before: Snapshot, after: Snapshot) -> list[str]:
    """What differs between two snapshots, as "module.attribute (before -> after)" lines."""
    out = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if _differs(old, new):
            fqn, name = key
            show = lambda v: "unset" if v is None else _short(v[0] if v[1] is None else v[1])  # noqa: E731
            out.append(f"{f'{fqn}.{name}' if fqn else name} ({show(old)} -> {show(new)})")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def restore(model: nn.Module, before: Snapshot) -> None:
    """Put back the attributes changed since `before` (the same object where it was replaced,
    its copy from then where plain data was changed in place; one set since is removed). The
    others are left alone, so objects modules share (a config) stay shared."""
    after = snapshot(model)
    modules = dict(model.named_modules())
    for key in before.keys() | after.keys():
        old, new = before.get(key), after.get(key)
        if not _differs(old, new):
            continue
        fqn, name = key
        owner: Any = modules[fqn]
        holder, _, name = name.rpartition(".")  # (a setting of an object the module holds: "config.use_cache")
        if holder:
            owner = getattr(owner, holder, None)
            if owner is None:
                continue
        if old is None:
            delattr(owner, name)
        elif new is not None and old[0] is new[0] and old[1] is not None:  # (changed in place: its copy)
            setattr(owner, name, copy.deepcopy(old[1]))
        else:
            setattr(owner, name, old[0])

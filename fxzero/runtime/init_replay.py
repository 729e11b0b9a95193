"""Replay a meta-built model's own initialization, a few tensors at a time.

A model built under `torch.device("meta")` has shapes but no values: its init code ran on meta
tensors and drew nothing from the RNG. `initial_values(model, seed)` replays what eager
construction after `torch.manual_seed(seed)` runs (the events of `fxzero.runtime.init_events`:
each layer's `reset_parameters()`, then a Hugging Face model's `post_init()` init, or a plain
model's `self.apply(self._init_weights)`), on every rank alike, and yields each tensor's final
value as soon as no later event writes it.

[Note: plan, then replay]
Keeping every tensor between its construction and its `_init_weights` would hold the whole
model (construction draws everything first). So the replay is planned first: a dry run of the
init events on meta placeholders, under a dispatch mode that records which tensors each event
writes (placeholders are told apart by storage, so a view's write counts for its base) and
whether the first write overwrites the whole tensor (the torch.nn.init functions that skip meta
tensors are made to write them there). Then the real run:

- a construction event runs on fresh tensors of its module alone, advancing the RNG as eager
  construction did; a value no init event writes is final at once, the others are dropped;
- an init event makes real only the tensors it writes. A tensor's starting value is needed
  only if its first write does not overwrite all of it; it is then recomputed by rerunning its
  module's construction from the RNG state recorded before it;
- a tensor is final after the last event that writes it, and is handed on and freed; one that a
  later event overwrites whole before reading it (a tied matrix, written as `wte`'s and again
  as `lm_head`'s) is freed in between too.

So at most one module's tensors (with `_init_weights` of a parent: the children's tensors it
writes) exist at a time. Each owner of a tied parameter (`lm_head.weight is wte.weight`) keeps
its own tensor through construction and Hugging Face's init, as eagerly before the tie.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Iterator, NamedTuple, Optional, Union

import torch
import torch.nn as nn

from fxzero._compat import TorchDispatchMode
from fxzero.config.notices import warn_once
from fxzero.runtime.init_events import Apply, Construct, init_events, init_weights_disabled

__all__ = ["initial_values", "rng_after_construction"]


# torch.nn.init functions that return a meta tensor untouched: the dry run would not see them
# write. There, each overwrites its meta tensor with normal_ (random) or zero_ instead.
_QUIET_ON_META = {"trunc_normal_": "normal_", "orthogonal_": "normal_", "sparse_": "normal_", "dirac_": "zero_"}

# In-place ops that draw from the RNG, and those whose result does not depend on the tensor's
# previous values.
_RANDOM = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
                     "cauchy_", "random_"})
_OVERWRITES = _RANDOM | {"fill_", "zero_", "copy_"}


def _loud_on_meta(init: Callable, op: str) -> Callable:
    @functools.wraps(init)
    def wrapper(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if tensor.is_meta:
            with torch.no_grad():
                return getattr(tensor, op)()
        return init(tensor, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _inits_seen_on_meta() -> Iterator[None]:
    """For the dry run: `_QUIET_ON_META` write meta tensors, in torch.nn.init and in the table
    transformers' own init functions call through (it holds torch's functions, taken at import)."""
    tables = [vars(torch.nn.init)]
    hf_init = sys.modules.get("transformers.initialization")
    if isinstance(getattr(hf_init, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf_init.TORCH_INIT_FUNCTIONS)
    saved = [(table, name, table[name]) for table in tables for name in _QUIET_ON_META if name in table]
    try:
        for table, name, init in saved:
            table[name] = _loud_on_meta(init, _QUIET_ON_META[name])
        yield
    finally:
        for table, name, init in saved:
            table[name] = init


class _Owner(NamedTuple):
    """One module's own parameter or buffer: a tied parameter has one owner per module."""

    module: nn.Module
    kind: str  # "param" | "buffer"
    attr: str
    fqn: str  # the module path and attribute (a tied parameter's later owners included)
    orig: torch.Tensor  # the model's tensor (meta), put back when the replay ends


def _owners(model: nn.Module) -> list[_Owner]:
    out = []
    for name, module in model.named_modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, t in table.items():
                if t is not None:
                    out.append(_Owner(module, kind, attr, f"{name}.{attr}" if name else attr, t))
    return out


def _hf_sources(model: nn.Module) -> set[str]:
    """Hugging Face ties `{target: source}`: the source keeps its value."""
    return set((getattr(model, "all_tied_weights_keys", None) or {}).values())


class _WriteRecorder(TorchDispatchMode):
    """Notes which placeholders an event writes, and whether a write overwrites one whole."""

    def __init__(self, cell_of_storage: dict[int, int], placeholders: list[torch.Tensor]) -> None:
        super().__init__()
        self.cell_of_storage = cell_of_storage
        self.placeholders = placeholders
        self.writes: dict[int, bool] = {}  # cell -> whether its first write overwrote it all
        self.random: set[int] = set()  # cells whose first write drew random numbers

    def _note(self, func, t: torch.Tensor) -> None:
        cell = self.cell_of_storage.get(t.untyped_storage()._cdata)
        if cell is None or cell in self.writes:
            return
        whole, op = self.placeholders[cell], func.overloadpacket.__name__
        self.writes[cell] = (op in _OVERWRITES and t.storage_offset() == 0 and t.shape == whole.shape
                             and t.stride() == whole.stride())
        if op in _RANDOM:
            self.random.add(cell)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    self._note(func, t)
        return func(*args, **kwargs)


class _Plan(NamedTuple):
    writes: dict[int, list[int]]  # cell -> the init events writing it, in order
    whole: dict[tuple[int, int], bool]  # (event, cell) -> whether the event overwrites it whole first
    written_at: dict[int, list[int]]  # init event -> the cells it writes
    drawn_first: set[int]  # cells whose first write draws from the RNG

    def first_whole(self, cell: int) -> bool:
        return self.whole[(self.writes[cell][0], cell)]

    def next_write(self, cell: int, k: int) -> Optional[int]:
        later = [j for j in self.writes[cell] if j > k]
        return later[0] if later else None


_ABSENT = object()


class _Replay:
    """The state of one replay: owners, their cells, what is real now (see the module doc)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.events = init_events(model)
        self.owners = _owners(model)
        self.by_module: dict[int, list[int]] = {}  # id(module) -> its own owners
        for i, o in enumerate(self.owners):
            self.by_module.setdefault(id(o.module), []).append(i)
        self.construct_of = {}  # owner -> its construction event
        for k, event in enumerate(self.events):
            if isinstance(event, Construct):
                for i in self.by_module.get(id(event.module), ()):
                    self.construct_of[i] = k
        # Owners of one tensor (a tied parameter); the winner's value is the tensor's value.
        groups: dict[int, list[int]] = {}
        for i, o in enumerate(self.owners):
            groups.setdefault(id(o.orig), []).append(i)
        sources = _hf_sources(model)
        self.winner: dict[int, int] = {}  # owner -> the owner whose value its tensor takes
        for members in groups.values():
            win = next((i for i in members if self.owners[i].fqn in sources), members[0])
            for i in members:
                self.winner[i] = win
        self.unique_fqn = {}  # winner owner -> the name fxzero knows its tensor by
        params = {id(p): fqn for fqn, p in model.named_parameters()}
        buffers = {id(b): fqn for fqn, b in model.named_buffers()}
        for members in groups.values():
            o = self.owners[members[0]]
            self.unique_fqn[self.winner[members[0]]] = (params if o.kind == "param" else buffers).get(id(o.orig))
        self.tied = False  # whether tied owners share their winner's cell now
        self.tie_group: dict[int, list[int]] = {}  # winner -> every owner of its tensor
        for i, w in self.winner.items():
            self.tie_group.setdefault(w, []).append(i)
        self.live: dict[int, torch.Tensor] = {}  # cell -> its real tensor, while events still write it
        self.live_bytes = 0
        self.peak_bytes = 0  # the most bytes of full tensors this replay held at once

    # -- cells and installation ---------------------------------------------------------------
    def cell(self, owner: int) -> int:
        return self.winner[owner] if self.tied else owner

    def members(self, cell: int) -> list[int]:
        return self.tie_group[cell] if self.tied else [cell]

    def _set(self, owner: int, t: torch.Tensor) -> None:
        o = self.owners[owner]
        (o.module._parameters if o.kind == "param" else o.module._buffers)[o.attr] = t

    def _get(self, owner: int) -> torch.Tensor:
        o = self.owners[owner]
        return (o.module._parameters if o.kind == "param" else o.module._buffers)[o.attr]

    def _fresh(self, owner: int, device: str) -> torch.Tensor:
        o = self.owners[owner]
        t = torch.empty_like(o.orig, device=device)
        return nn.Parameter(t, requires_grad=o.orig.requires_grad) if o.kind == "param" else t

    def install(self, cell: int, t: torch.Tensor) -> None:
        for owner in self.members(cell):
            self._set(owner, t)

    def restore(self) -> None:
        for i, o in enumerate(self.owners):
            self._set(i, o.orig)

    def _count(self, delta: int) -> None:
        self.live_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    # -- the dry run --------------------------------------------------------------------------
    def plan(self) -> _Plan:
        """Which cells each init event writes, from a run on meta placeholders."""
        placeholders = [self._fresh(i, "meta") for i in range(len(self.owners))]
        cell_of_storage = {t.untyped_storage()._cdata: i for i, t in enumerate(placeholders)}
        for i, t in enumerate(placeholders):
            self._set(i, t)
        writes: dict[int, list[int]] = {}
        whole: dict[tuple[int, int], bool] = {}
        written_at: dict[int, list[int]] = {}
        drawn_first: set[int] = set()
        for k, event in enumerate(self.events):
            if not isinstance(event, Apply):
                continue
            self._switch_ties(event.tied, placeholders.__getitem__)
            recorder = _WriteRecorder(cell_of_storage, placeholders)
            try:
                with torch.no_grad(), _inits_seen_on_meta(), recorder:
                    event.fn(event.module)
            except Exception as e:
                raise ValueError(
                    f"the model's init code failed on module {event.name or '<root>'!r} "
                    f"({type(event.module).__name__}), run on meta tensors to plan its replay: {e}; "
                    "pass state_dict= to fxzero.compile, or keep the init to in-place writes"
                ) from e
            for module in event.module.modules():  # a tensor replaced outright is written too
                for owner in self.by_module.get(id(module), ()):
                    cell = self.cell(owner)
                    now = self._get(owner)
                    if now is not placeholders[cell]:
                        recorder.writes.setdefault(cell, True)
                        placeholders[cell] = now
                        cell_of_storage[now.untyped_storage()._cdata] = cell
            for cell, full in recorder.writes.items():
                whole[(k, cell)] = full
                if cell not in writes and cell in recorder.random:
                    drawn_first.add(cell)
                writes.setdefault(cell, []).append(k)
            written_at[k] = sorted(recorder.writes)
        self.tied = False
        return _Plan(writes, whole, written_at, drawn_first)

    def _switch_ties(self, tied: bool, tensor_of: Callable[[int], torch.Tensor]) -> None:
        """Enter the phase where tied owners share their winner's cell (happens once)."""
        if tied and not self.tied:
            self.tied = True
            for i in range(len(self.owners)):
                self._set(i, tensor_of(self.winner[i]))

    # -- the real run -------------------------------------------------------------------------
    def run_construct(self, event: Construct) -> dict[int, torch.Tensor]:
        """Run one layer's own init on fresh tensors; its owners' values."""
        mine = self.by_module.get(id(event.module), [])
        before = {i: self._get(i) for i in mine}
        for i in mine:
            self._set(i, self._fresh(i, "cpu"))
        self._count(sum(self._get(i).nbytes for i in mine))
        try:
            with torch.no_grad():
                event.init()
            return {i: self._get(i) for i in mine}
        finally:
            for i, t in before.items():
                self._set(i, t)

    def values(self, seed: Union[int, torch.Tensor]) -> Iterator[tuple[str, str, torch.Tensor]]:
        """Plan, check, then replay every event under `seed` ([Note: plan, then replay]): an int
        for `torch.manual_seed`, or a CPU RNG state (`torch.get_rng_state()`) to start from."""
        flags = _hf_flags(self.model)
        plan = self.plan()
        _put_back_flags(flags)  # the dry run's _initialize_weights marked modules done
        self._check(plan)
        recompute = {cell for cell in plan.writes if not plan.first_whole(cell) and cell in self.construct_of}
        rng_before = {self.construct_of[cell] for cell in recompute}
        saved_rng: dict[int, torch.Tensor] = {}
        placeholders = [self._fresh(i, "meta") for i in range(len(self.owners))]
        for i, t in enumerate(placeholders):
            self._set(i, t)
        if isinstance(seed, torch.Tensor):
            torch.random.set_rng_state(seed)
        else:
            torch.manual_seed(seed)
        for k, event in enumerate(self.events):
            if isinstance(event, Construct):
                if k in rng_before:
                    saved_rng[k] = torch.random.get_rng_state()
                for owner, value in self.run_construct(event).items():
                    if owner not in plan.writes:
                        yield from self._final(owner, value)
                    self._count(-value.nbytes)
                continue
            self._switch_ties(event.tied, lambda c: self.live.get(c, placeholders[c]))
            for cell in plan.written_at[k]:
                if cell not in self.live:
                    first = plan.writes[cell][0] == k
                    self.live[cell] = self._start(cell, first and not plan.whole[(k, cell)], saved_rng)
                    self._count(self.live[cell].nbytes)
                self.install(cell, self.live[cell])
            with torch.no_grad():
                event.fn(event.module)
            for cell in plan.written_at[k]:
                replaced = [t for t in map(self._get, self.members(cell)) if t is not self.live[cell]]
                if replaced:  # the init assigned a new tensor rather than writing in place
                    self._count(replaced[0].nbytes - self.live[cell].nbytes)
                    self.live[cell] = replaced[0]
                after = plan.next_write(cell, k)
                if after is None or plan.whole[(after, cell)]:  # final, or overwritten before it is read
                    value = self.live.pop(cell)
                    self.install(cell, placeholders[cell])
                    if after is None:
                        yield from self._final(cell, value)
                    self._count(-value.nbytes)
        for owner, o in enumerate(self.owners):  # written by nothing: the model's own value
            if owner not in plan.writes and owner not in self.construct_of and not o.orig.is_meta:
                yield from self._final(owner, o.orig)

    def _start(self, cell: int, kept: bool, saved_rng: dict[int, torch.Tensor]) -> torch.Tensor:
        """A cell's value before an init event writes it: the constructed (or the model's own)
        value if the event keeps some of it (`kept`), else a fresh tensor it overwrites whole."""
        o = self.owners[cell]
        if not kept:
            return self._fresh(cell, "cpu")
        if cell in self.construct_of:  # rerun its construction from the RNG state eagerly before it
            k = self.construct_of[cell]
            now = torch.random.get_rng_state()
            torch.random.set_rng_state(saved_rng[k])
            try:
                values = self.run_construct(self.events[k])
            finally:
                torch.random.set_rng_state(now)
            self._count(-sum(value.nbytes for value in values.values()))
            return values[cell]
        t = o.orig.detach().clone()  # real: _check refused a meta one
        return nn.Parameter(t, requires_grad=o.orig.requires_grad) if o.kind == "param" else t

    def _final(self, cell: int, value: torch.Tensor) -> Iterator[tuple[str, str, torch.Tensor]]:
        if self.winner[cell] == cell:
            yield self.owners[cell].kind, self.unique_fqn[cell], value

    def _check(self, plan: _Plan) -> None:
        """Refuse, before anything runs, a tensor whose starting value nothing gives; warn about
        tensors whose constructor may have drawn random numbers this replay cannot know of."""
        drawn = []
        for owner, o in enumerate(self.owners):
            if not o.orig.is_meta or owner in self.construct_of:
                continue
            if self.winner[owner] != owner and owner not in plan.writes:
                continue  # a tied parameter's later owner: its value is not kept
            if owner in plan.writes and plan.first_whole(owner):
                if owner in plan.drawn_first:
                    drawn.append(o.fqn)
                continue
            what = ("the model's _init_weights changes it without setting it first"
                    if owner in plan.writes else "nothing in the model's own init sets it")
            raise ValueError(
                f"{'parameter' if o.kind == 'param' else 'buffer'} {o.fqn!r} is on the meta device, its module "
                f"({type(o.module).__name__}) has no reset_parameters() and {what}, so fxzero cannot "
                "initialize it; pass state_dict= to fxzero.compile, add reset_parameters() to the module, "
                "or set it in the model's _init_weights(module)"
            )
        if drawn:
            warn_once([
                f"{drawn[:3]}{' ...' if len(drawn) > 3 else ''} have no reset_parameters() and the model's "
                "_init_weights draws them: if their constructor drew random numbers too (torch.randn in "
                "__init__), eager construction drew those and fxzero cannot replay them, so every later "
                "draw differs from eager construction's under the same seed (a valid init, not the same "
                "values); give their module a reset_parameters(), or pass state_dict= for exact values"
            ], UserWarning)


def _hf_flags(model: nn.Module) -> dict[nn.Module, object]:
    return {m: m.__dict__.get("_is_hf_initialized", _ABSENT) for m in model.modules()}


def _put_back_flags(flags: dict[nn.Module, object]) -> None:
    for m, flag in flags.items():
        if flag is _ABSENT:
            m.__dict__.pop("_is_hf_initialized", None)
        else:
            m._is_hf_initialized = flag


def initial_values(model: nn.Module, seed: Union[int, torch.Tensor], stats: Optional[dict] = None
                   ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield ("param" | "buffer", fqn, value) for each tensor the model's own init gives.

    Values come as soon as they are final (see the module doc), each once: a tied parameter
    under its first name. The model is left as it was (meta tensors, ties, Hugging Face's
    `_is_hf_initialized` flags) and so is the global RNG.

    Args:
        seed: `torch.manual_seed`'s seed, or the CPU RNG state construction started from
            (`fxzero.zero.Init` records it).
        stats: if given, `stats["peak_bytes"]` is set to the most bytes of full tensors the
            replay held at once, and `stats["rng_after"]` to the RNG state the replay ended in
            (where eager construction would have left the global RNG).

    Raises:
        ValueError: for a meta parameter no init sets.
    """
    replay = _Replay(model)
    flags = _hf_flags(model)
    rng_state = torch.random.get_rng_state()
    try:
        yield from replay.values(seed)
        if stats is not None:
            stats["rng_after"] = torch.random.get_rng_state()
    finally:
        replay.restore()
        _put_back_flags(flags)
        torch.random.set_rng_state(rng_state)
        if stats is not None:
            stats["peak_bytes"] = replay.peak_bytes


def rng_after_construction(model: nn.Module, state: torch.Tensor) -> torch.Tensor:
    """The CPU RNG state eager construction of `model` from `state` ends in (`zero.Init` moves
    the global RNG there). Under transformers' `no_init_weights()` (`from_pretrained` builds the
    model so at ZeRO-3, the checkpoint giving the values) `post_init()` initializes nothing and
    torch.nn.init's functions do nothing: only the layers' own construction runs, and draws only
    what a layer draws some other way. The global RNG is left where it is."""
    if not init_weights_disabled(model):
        stats: dict = {}
        for _ in initial_values(model, state, stats):
            pass
        return stats.get("rng_after", state)
    replay = _Replay(model)
    now = torch.random.get_rng_state()
    try:
        torch.random.set_rng_state(state)
        for event in replay.events:
            if isinstance(event, Construct):
                replay.run_construct(event)
        return torch.random.get_rng_state()
    finally:
        replay.restore()
        torch.random.set_rng_state(now)

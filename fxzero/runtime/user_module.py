"""The user's module after `fxzero.compile`: a view of what the engine trains, never a stale copy.

[Note: the user's module]
The engine trains its own storage (`RankState`): flat buffers per unit, sharded across ranks.
The module the user passed (and `engine.module`, the same object) is kept consistent with it:

- A parameter whose whole value this rank holds (every unit at ZeRO-1/2, a persistent unit at
  ZeRO-3) is a view of that value: of the copy in the compute dtype under mixed precision (as
  DeepSpeed's module is cast to bf16/fp16), of the fp32 parameters otherwise. Reading it gives
  the trained value after every step; calling the module directly runs with them.
- A parameter sharded across ranks (ZeRO-3) is a placeholder on the meta device, of its shape and
  compute dtype: `numel()`, `shape`, `requires_grad` read as before, but no value exists on any
  rank, and reading one is an error, never a stale value. (DeepSpeed leaves empty tensors.)
  Calling the module, or a submodule owning such parameters, directly is an error naming the
  engine; `fxzero.zero.GatheredParameters` gathers them for eager use.
- Buffers are the engine's own (BatchNorm's running statistics as the last forward left them).
- `model.state_dict()`, or any submodule's, and so Hugging Face's `save_pretrained()`, gives the
  trained values: placeholders are filled by gathering their units, one unit at a time, in the
  compute dtype (DeepSpeed's `zero3_consolidated_16bit_state_dict`). At ZeRO-3 that is a
  collective: every rank calls it, and ranks that disagree raise rather than hang
  ([Note: one collective sequence]). `state_dict(keep_vars=True)` returns the parameters
  themselves, placeholders included, and gathers nothing (fxzero's own code lists keys with it).
  `engine.full_state_dict()` gives the fp32 masters.

[Note: the DeepSpeed attributes of a parameter]
Programs written for DeepSpeed tell a ZeRO-3 parameter by its attributes: `hasattr(p, "ds_id")`
before gathering it (PEFT's and DeepSpeed-Chat's save and merge code), `p.ds_status ==
ZeroParamStatus.NOT_AVAILABLE` for which to gather, `p.ds_shape` and `p.ds_numel` for its whole
size (DeepSpeed leaves an empty tensor). At ZeRO-3 every parameter the engine trains carries
them, with their meaning here: `ds_id` its index in the model, `ds_shape`/`ds_numel` its whole
size, `ds_persist` whether its unit is held whole, `ds_active_sub_modules` an empty set (no
module holds it gathered between calls), and `ds_status` AVAILABLE where this rank
holds the value (a persistent unit, or inside GatheredParameters) and NOT_AVAILABLE for a
placeholder, kept current by every rebinding. Alike on every rank, so a program's choice of
what to gather is the same everywhere. At ZeRO-1/2 no parameter has them, as under DeepSpeed.
A model built under `zero.Init` carries them from the block's end (NOT_AVAILABLE outside
GatheredParameters on every rank, the holder included: [Note: gathering before initialize] in
`fxzero/zero.py`). `ds_tensor` (DeepSpeed's shard) is not given: the shard is the engine's.

A parameter the user replaces after compile (`model.to(dtype)`, `.half()`, `p.data = t`) no
longer views anything the engine holds: it would keep the values of that moment while the
engine trains on, and every later `state_dict()` would be that stale model. `bind()` after each
step finds such parameters and points them back at the trained values, warning once.

The parameter objects keep their identity throughout (`torch.utils.swap_tensors` where a value
moves between the meta device and memory), so references the user holds (an optimizer's param
list, `model.lm_head.weight`) stay the module's.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import warnings
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.nn as nn

from fxzero.config.notices import warn_ineffective
from fxzero.ir.layout import ParamSlot, UnitLayout
from fxzero.leaf_modules import mark_leaf_parameters
from fxzero.runtime.agreement import agree
from fxzero.runtime.comm import Comm
from fxzero.runtime.module_writes import EngineHook, ModuleWrites
from fxzero.runtime.state import RankState

__all__ = ["UserModule", "ZeroParamStatus", "binding_of"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's name for where a ZeRO-3 parameter's value is (`param.ds_status`, [Note: the
    DeepSpeed attributes of a parameter])."""

    AVAILABLE = 1
    """This rank holds its whole value (a persistent unit, or inside GatheredParameters)."""
    NOT_AVAILABLE = 2
    """Sharded: a placeholder on this rank ([Note: the user's module])."""
    INFLIGHT = 3
    """Being gathered. fxzero's gathers run inside its programs, never on the user's parameters,
    so no parameter is ever left in it."""


_DS_ATTRS = ("ds_id", "ds_status", "ds_shape", "ds_numel", "ds_persist", "ds_active_sub_modules",
             "ds_z3_leaf_module")
"""The attributes DeepSpeed's ZeRO-3 parameters carry that programs read ([Note: the DeepSpeed
attributes of a parameter])."""

_BINDING = "_fxzero_binding"
"""The attribute each bound parameter carries: (its `UserModule`, its FQN)."""


def binding_of(param: torch.Tensor) -> Optional[tuple["UserModule", str]]:
    """The `UserModule` that keeps `param` (and its FQN), or None for a tensor fxzero does not manage."""
    return getattr(param, _BINDING, None)


def _set(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make `param` hold `value` (a view, shared), keeping the Parameter object itself (and its
    `ds_status` current, where it has one)."""
    if param.device == value.device:
        param.data = value
    else:
        # (set_data cannot move a tensor between the meta device and memory: swap the objects' contents.
        # `.data`: a version counter of its own, as set_data leaves the parameter's, so the engine's
        # in-place updates of the buffer it views are not taken for the user's writes: module_writes.py)
        moved = nn.Parameter(value.data, requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)
        torch.utils.swap_tensors(param, moved)
    if "ds_status" in param.__dict__:
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE if value.is_meta else ZeroParamStatus.AVAILABLE


def mark_zero3(param: nn.Parameter, index: int, shape: tuple[int, ...], persist: bool, available: bool) -> None:
    """Give `param` DeepSpeed's ZeRO-3 attributes ([Note: the DeepSpeed attributes of a parameter])."""
    param.ds_id = index
    param.ds_shape = torch.Size(shape)
    param.ds_numel = torch.Size(shape).numel()
    param.ds_persist = persist
    param.ds_status = ZeroParamStatus.AVAILABLE if available else ZeroParamStatus.NOT_AVAILABLE
    param.ds_active_sub_modules = set()  # (DeepSpeed's modules using it now; programs clear it: always empty here)


def unmark_zero3(param: nn.Parameter) -> None:
    for attr in _DS_ATTRS:
        param.__dict__.pop(attr, None)


class UserModule:
    """Keeps the user's module a view of this rank's `RankState` ([Note: the user's module])."""

    def __init__(self, model: nn.Module, state: RankState, comm: Comm, *, compute_dtype: Optional[torch.dtype],
                 timeout: float, zero3: bool = False) -> None:
        """
        Args:
            compute_dtype: what the model computes in under mixed precision (None: fp32 training).
            timeout: seconds a gather waits for the other ranks (`Config.collective_timeout`).
            zero3: the engine runs ZeRO-3: its parameters carry DeepSpeed's ZeRO-3 attributes.
        """
        self.model, self.state, self.comm = model, state, comm
        self.compute_dtype = compute_dtype
        self.timeout = timeout
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters(remove_duplicate=True))
        self.slot: dict[str, tuple[UnitLayout, ParamSlot]] = {
            slot.fqn: (layout, slot) for layout in state.layouts for slot in layout.slots}
        self.units_of: dict[str, list[str]] = {}  # FQN -> its units (a tiled parameter's: one per tile)
        for layout in state.layouts:
            for slot in layout.slots:
                self.units_of.setdefault(slot.fqn, []).append(layout.name)
        self._module_fqn = {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        buffer_first: dict[int, str] = {}
        self.buffer_owners = [(owner, name, buffer_first.setdefault(id(b), fqn))
                               for fqn, b, owner, name in _named_buffers(model)]
        self._bound: dict[str, Optional[int]] = {}  # unit -> id of the storage its params view (None: placeholders)
        self._gathered: set[str] = set()  # FQNs GatheredParameters holds full right now
        self._held: list[str] = []  # FQNs gathered for a forward run eagerly ([Note: a forward run eagerly at ZeRO-3])
        self._outer: Optional[tuple[int, str, bool]] = None  # the outermost state_dict() call in progress
        self._warned_converted = False
        self._pointed: dict[int, torch.Tensor] = {}  # buffer_owners index -> the engine's buffer it was pointed at
        for index, (fqn, p) in enumerate(self.params.items()):
            setattr(p, _BINDING, (self, fqn))
            if zero3:  # (available or not: bind() below sets ds_status from what the parameter holds)
                mark_zero3(p, index, tuple(p.shape), persist=all(
                    u in state.whole for u in self.units_of.get(fqn, [])), available=False)
            else:
                unmark_zero3(p)  # (built under zero.Init, trained at ZeRO-1/2: DeepSpeed's are ZeRO-3's alone)
        if zero3:
            mark_leaf_parameters(model)
        self._engine: Any = None  # a weak reference to the engine, set by it
        self._hooks = []
        pre, post = _function(self._state_dict_pre_hook), _function(self._state_dict_post_hook)
        before, after = _function(self._direct_call_start), _function(self._direct_call_end)
        self._direct: list[Optional[list[str]]] = []  # what each direct call in progress gathered
        self._units_owned: dict[str, list[str]] = {}  # module FQN -> the units all of whose parameters are under it
        self._sharded = any(layout.name not in state.whole for layout in state.layouts)
        for layout in state.layouts:
            self._units_owned.setdefault(_common_module(slot.fqn for slot in layout.slots), []).append(layout.name)
        for module in model.modules():
            self._hooks.append(module.register_state_dict_pre_hook(pre))
            self._hooks.append(module.register_state_dict_post_hook(post))
        self.call_hooks: list = []
        self._call_hook_functions = (before, after)
        self.register_call_hooks()
        self.writes = ModuleWrites(self)  # ([Note: writes into the user's module])
        self.bind(force=True)

    def register_call_hooks(self) -> None:
        """(Re-)register the hooks of direct calls ([Note: calling a ZeRO-3 model directly]) on
        the modules holding parameters or owning units; any still registered are removed first,
        so a program that removed some (TRL's `remove_hooks` before generating, [Note:
        DeepSpeed's parameter_offload]) gets each once again."""
        for handle in self.call_hooks:
            handle.remove()
        before, after = self._call_hook_functions
        self.call_hooks = []
        for module in self.model.modules():
            if any(p is not None for p in module._parameters.values()) or \
                    self._module_fqn.get(id(module)) in self._units_owned:
                self.call_hooks.append(module.register_forward_pre_hook(before))
                self.call_hooks.append(module.register_forward_hook(after, always_call=True))

    @property
    def engine(self) -> Any:
        """The engine training this module (None once it is gone)."""
        return self._engine() if self._engine is not None else None

    @engine.setter
    def engine(self, engine: Any) -> None:
        self._engine = weakref.ref(engine)

    # -- binding ----------------------------------------------------------------------------

    @torch.no_grad()
    def bind(self, force: bool = False) -> None:
        """Point every parameter at what the engine holds now (after a step, a load, a gather),
        and every buffer at the engine's. Cheap when nothing moved: units whose storage is the
        one already viewed are skipped."""
        tiles: dict[str, torch.Tensor] = {}  # (a tiled parameter assembled from its tiles' whole buffers)
        for layout in self.state.layouts:
            whole = self.state.whole_buffer(layout.name, compute=True)
            key = id(whole) if whole is not None else None
            if not force and layout.name in self._bound and self._bound[layout.name] == key:
                if whole is None or self._viewing(layout, whole):
                    continue
                self._converted()
            self._bound[layout.name] = key
            for slot in layout.slots:
                if slot.fqn in self._gathered:
                    continue
                if whole is not None and slot.param_shape is not None:
                    value = slot.read_into(whole, tiles)
                elif whole is not None:
                    value = whole[slot.offset : slot.offset + slot.numel].view(slot.shape)
                else:
                    dtype = self.compute_dtype if self.compute_dtype and layout.dtype.is_floating_point else layout.dtype
                    value = torch.empty(slot.full_shape, dtype=dtype, device="meta")
                self._put(slot.fqn, value)
        self.bind_buffers()

    def _put(self, fqn: str, value: torch.Tensor) -> None:
        """Make the parameter `fqn` hold `value`: the engine's doing, not a write of the user's."""
        _set(self.params[fqn], value)
        self.writes.seen(fqn)

    def gathered_now(self, fqn: str) -> bool:
        """Whether GatheredParameters (or a direct call) holds the parameter full right now."""
        return fqn in self._gathered

    def _viewing(self, layout: UnitLayout, whole: torch.Tensor) -> bool:
        """Whether the unit's parameters still view its whole buffer: `model.to(dtype)`, `.half()`
        or `.double()` replaced them with converted copies, which would keep the values of that
        moment while the engine trains on."""
        ptr = whole.untyped_storage().data_ptr()
        return all(self.params[slot.fqn].untyped_storage().data_ptr() == ptr for slot in layout.slots
                   if slot.param_shape is None and slot.fqn not in self._gathered)

    def _converted(self) -> None:
        if not self._warned_converted:
            self._warned_converted = True
            warnings.warn(
                f"[rank {self.comm.rank}] the model's parameters were replaced after compile (model.to(dtype), "
                ".half(), .double(), or a parameter's .data assigned): they held the values of that moment while the "
                "engine trained on. fxzero points them at the trained values again after each step, in the engine's "
                "dtype; to save in another dtype, convert after the last step (or use engine.save_16bit_model())",
                stacklevel=4)

    @torch.no_grad()
    def bind_buffers(self) -> None:
        """Point every buffer at the engine's, which the programs read; a buffer the user replaced
        since the last binding has its value carried into the engine's first ([Note: writes into
        the user's module]). A buffer the engine replaced (a forward's new running statistics) is
        simply pointed at."""
        buffers = self.state.buffers
        for index, (owner, name, fqn) in enumerate(self.buffer_owners):
            value, held = buffers.get(fqn), owner._buffers.get(name)
            if value is None or held is None:
                continue
            if held is not self._pointed.get(index, held) and not held.is_meta:  # (the user's, since)
                if tuple(held.shape) != tuple(value.shape):
                    raise ValueError(
                        f"[rank {self.comm.rank}] the buffer {fqn!r} was replaced after compile by one of shape "
                        f"{tuple(held.shape)}; the programs were compiled for {tuple(value.shape)}. Write a value "
                        "of that shape (or in place), or build the engine after setting it")
                value.copy_(held)
            owner._buffers[name] = self._pointed[index] = value

    def placeholders(self) -> list[str]:
        """FQNs of the parameters with no value on this rank (sharded, not gathered)."""
        return [fqn for fqn, p in self.params.items() if p.is_meta]

    # -- gathering --------------------------------------------------------------------------

    def _units_of(self, fqns: Iterable[str]) -> list[UnitLayout]:
        """The units holding `fqns`, in layout order (the same order on every rank)."""
        wanted = {unit for f in fqns for unit in self.units_of[f]}
        return [layout for layout in self.state.layouts if layout.name in wanted]

    def gather(self, fqns: Iterable[str], *, compute: bool, what: str, yields: bool = False
               ) -> Iterator[tuple[UnitLayout, torch.Tensor]]:
        """(layout, full flat buffer) of every unit holding `fqns`, one at a time: a collective
        where a unit is sharded, agreed on by every rank first. `compute`: in the compute dtype
        (else the fp32 masters). `yields`: raise `OtherRanksElsewhere`, gathering nothing, when
        the other ranks are at a GatheredParameters gather ([Note: a state_dict() on some ranks
        only] in `fxzero/runtime/agreement.py`)."""
        layouts = self._units_of(fqns)
        sharded = [lay for lay in layouts if self.state.whole_buffer(lay.name, compute) is None]
        sequence = tuple(f"{what}: all_gather of {lay.name} ({lay.padded_numel} x "
                         f"{self.compute_dtype if compute and self.compute_dtype else lay.dtype})" for lay in sharded)
        if sharded and not agree(self.comm, sequence, timeout=self.timeout,
                                 yields_to=f"{_GATHERED}:" if yields else None,
                                 where=f"{what} (at ZeRO-3 it gathers: call it on every rank)"):
            raise OtherRanksElsewhere(what)
        for layout in layouts:
            yield layout, self.state.full_unit(layout.name, self.comm, compute=compute)

    # -- state_dict -------------------------------------------------------------------------

    def _state_dict_pre_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._outer is None or prefix == "":  # (the outermost call; a stale one from an error is replaced)
            self._outer = (id(module), prefix, keep_vars)
            if not keep_vars:
                self.writes.take(check_parameters=False)  # (a replaced module's parameters are its own)

    def _state_dict_post_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        if self._outer is None or self._outer[:2] != (id(module), prefix):
            return  # an inner module: the outermost call fills everything once
        keep_vars = self._outer[2]
        self._outer = None
        if keep_vars:
            return
        base = self._module_fqn.get(id(module), "")
        wanted: dict[str, list[str]] = {}  # FQN -> its keys in this state dict (aliases of a tied one)
        for key, value in state_dict.items():
            if key.startswith(prefix) and isinstance(value, torch.Tensor) and value.is_meta:
                fqn = self._unique_fqn(base, key[len(prefix):])
                if fqn is not None:
                    wanted.setdefault(fqn, []).append(key)
        if not wanted:
            return
        name = "model.state_dict()" if module is self.model else f"{type(module).__name__}.state_dict()"
        values: dict[str, torch.Tensor] = {}
        try:
            for layout, flat in self.gather(wanted, compute=True, what=name, yields=True):
                for slot in layout.slots:
                    if slot.fqn in wanted:  # (a tied parameter: one tensor under each of its names, as eager's)
                        value = slot.read_into(flat, values)
                        for key in wanted[slot.fqn]:
                            state_dict[key] = value
        except OtherRanksElsewhere:
            warnings.warn(
                f"[rank {self.comm.rank}] {name} at ZeRO-3 on some ranks only, while the others gather otherwise "
                f"(GatheredParameters): {len(wanted)} sharded parameters are left as meta placeholders, as DeepSpeed "
                "leaves empty ones. A file saved from this state dict holds no values for them (loading it is an "
                "error). For the trained values call state_dict() on every rank, or gather with "
                "fxzero.zero.GatheredParameters, or save with engine.save_16bit_model()", stacklevel=4)

    def _unique_fqn(self, base: str, rel: str) -> Optional[str]:
        """The FQN fxzero keys `rel` (relative to the module at `base`) by: the first name of a tied one."""
        fqn = f"{base}.{rel}" if base else rel
        if fqn in self.slot:
            return fqn
        owner_path, _, attr = fqn.rpartition(".")
        try:
            param = self.model.get_submodule(owner_path).get_parameter(attr) if owner_path else \
                self.model.get_parameter(attr)
        except AttributeError:
            return None
        found = binding_of(param)
        return found[1] if found is not None and found[0] is self else None

    # -- direct calls -----------------------------------------------------------------------

    def _direct_call_start(self, module: nn.Module, args: Any) -> None:
        """[Note: calling a ZeRO-3 model directly]
        A module whose parameters are sharded (ZeRO-3 placeholders) can be called directly under
        `torch.no_grad()` (Hugging Face's `generate`, an evaluation loop, DeepSpeed-Chat's
        generation from its actor at ZeRO-3), as under DeepSpeed's hooks: for the call, the units
        this module is (its layout's name), and those holding its own parameters, are gathered in
        the compute dtype, every rank gathering alike (a collective, agreed first); at its end
        they are placeholders again. A unit is gathered by the innermost module holding all its
        parameters: a decoder layer's call gathers its unit once for all its Linear layers, the
        transformer's its embeddings for its whole forward; at most the units on the call stack
        are whole at once.

        With gradients enabled (the embeddings of a model called apart from the engine, as
        adversarial training perturbs them: `engine(inputs_embeds=engine.module.embed(ids) + delta)`)
        autograd keeps the gathered parameters until the backward, so the units stay whole past the
        call, as a forward run eagerly holds them ([Note: a forward run eagerly at ZeRO-3]): the
        engine's backward carries the gradients they get into the shards ([Note: gradients from
        outside the program] in `fxzero/runtime/outside_grads.py`) and then makes them
        placeholders again (`release_held`; else the step does)."""
        self._direct.append(None)  # (popped by the call's end hook, which runs whatever happens)
        if not self._sharded:  # (ZeRO-1/2: every parameter is a view already)
            return
        fqn = self._module_fqn.get(id(module), "")
        units = list(self._units_owned.get(fqn, []))
        units += [u for name, p in module._parameters.items() if p is not None and p.is_meta
                  and binding_of(p) is not None for u in self.units_of.get(binding_of(p)[1], [])]
        wanted = [slot.fqn for layout in self._units_named(units) for slot in layout.slots
                  if self.params[slot.fqn].is_meta and slot.fqn not in self._gathered and self._in_place(slot.fqn)]
        if not wanted:
            return
        if torch.is_grad_enabled():  # (held until the backward has carried their gradients)
            self._hold(wanted, f"{type(module).__name__} ({fqn or 'the model'}) called directly with gradients")
            self._held.extend(wanted)
            return
        self._hold(wanted, f"{type(module).__name__} ({fqn or 'the model'}) called directly under no_grad")
        self._direct[-1] = wanted

    def gather_for_generate(self) -> None:
        """[Note: generating from a ZeRO-3 model gathered once]
        With `Config.gather_for_generate` (DeepSpeed's hybrid engine), the model's `generate` is
        wrapped so that the whole model is gathered once, in the compute dtype, as
        GatheredParameters gathers it (changes dropped), for the call: the forwards it runs, one per
        token, then find every parameter whole and gather nothing ([Note: calling a ZeRO-3 model
        directly]), and at its end the parameters are placeholders again. The values are those each
        layer's own gather gives, so the tokens are too. A collective, as DeepSpeed's: every rank
        generates together (Hugging Face's `synced_gpus=True`, as DeepSpeed-Chat passes). A model
        without `generate` has nothing to gather for: said once."""
        generate = getattr(self.model, "generate", None)
        if not callable(generate):
            warn_ineffective([f"Config.gather_for_generate=True has no effect: {type(self.model).__name__} has no "
                              "generate method to gather the model for (a Hugging Face model's)"])
            return

        @functools.wraps(generate)
        def generate_gathered(*args: Any, **kwargs: Any) -> Any:
            with self.gathered(list(self.params), modifier_rank=None):
                return generate(*args, **kwargs)

        self.model.generate = generate_gathered

    def _direct_call_end(self, module: nn.Module, args: Any, output: Any) -> None:
        wanted = self._direct.pop() if self._direct else None
        if wanted:
            self._release(wanted)

    def _hold(self, wanted: list[str], what: str) -> None:
        """The parameters `wanted` whole, in the compute dtype, until `_release` (a collective)."""
        tiles: dict[str, torch.Tensor] = {}
        for layout, flat in self.gather(wanted, compute=True, what=what):
            for slot in layout.slots:
                if slot.fqn in wanted:
                    value = slot.read_into(flat, tiles) if slot.param_shape is not None else \
                        flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    self._put(slot.fqn, value)
        self._gathered.update(wanted)

    def _release(self, wanted: list[str]) -> None:
        self._gathered.difference_update(wanted)
        for fqn in wanted:
            layout, slot = self.slot[fqn]
            dtype = self.compute_dtype if self.compute_dtype and layout.dtype.is_floating_point else layout.dtype
            self._put(fqn, torch.empty(slot.full_shape, dtype=dtype, device="meta"))

    def hold_for_eager(self) -> None:
        """[Note: a forward run eagerly at ZeRO-3]
        A forward the trace cannot follow runs as the model is ([Note: gradients from outside the
        program] in `fxzero/runtime/outside_grads.py`), and autograd keeps the parameters it
        used until the backward. At ZeRO-3 their values exist only while gathered, so every
        sharded unit is gathered, in the compute dtype, at the forward's start, on every rank
        alike (whatever modules each rank's data makes it call: a branch one rank takes gathers
        nothing the others do not), and stays whole until the backward has carried its gradients
        into the shards (`release_held`, from `engine.backward`; or at the end of a forward under
        no_grad, or at the step). For that step the rank holds the whole model in the compute
        dtype, as ZeRO-2 holds it, plus its full gradients until they are reduced; the optimizer
        states and fp32 masters stay sharded. DeepSpeed's hooks gather module by module and again
        in the backward; fxzero's programs do that for every forward the trace can follow."""
        wanted = [fqn for fqn, p in self.params.items() if p.is_meta and fqn not in self._gathered]
        if wanted:
            self._hold(wanted, "the model's forward, run eagerly at ZeRO-3 (every unit gathered)")
            self._held.extend(wanted)

    def release_held(self) -> None:
        """Placeholders again for what `hold_for_eager` gathered."""
        held, self._held = self._held, []
        if held:
            self._release(held)

    def _in_place(self, fqn: str) -> bool:
        """Whether the model holds this parameter itself now: not while a trace swaps values in
        (`torch.func.functional_call`), when its modules run on what the trace gives them."""
        owner, _, name = fqn.rpartition(".")
        try:
            module = self.model.get_submodule(owner) if owner else self.model
        except AttributeError:
            return False
        return module._parameters.get(name) is self.params[fqn]

    def _units_named(self, names: Iterable[str]) -> list[UnitLayout]:
        wanted = set(names)
        return [layout for layout in self.state.layouts if layout.name in wanted]

    # -- GatheredParameters -----------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, fqns: list[str], modifier_rank: Optional[int]) -> Iterator[None]:
        """Full values in the parameters `fqns` for the block's duration; with `modifier_rank`,
        the fp32 masters, and that rank's values at the end become every rank's (its shard, the
        compute-dtype copy, a tier); without, changes are dropped, so the values are those the
        model computes with: in the compute dtype under mixed precision, as DeepSpeed's gathered
        parameters are (TRL generates inside such a block: half the memory of fp32 masters, the
        tokens DeepSpeed's model samples). A collective."""
        fqns = [f for f in fqns if f not in self._gathered]  # (nested: the outer block owns them)
        flats, tiles = {}, {}
        for layout, flat in self.gather(fqns, compute=modifier_rank is None, what=_GATHERED):
            if modifier_rank is not None:
                flats[layout.name] = flat  # (the unit's other parameters, for the write-back)
            for slot in layout.slots:
                if slot.fqn in fqns and slot.param_shape is not None:  # (a tiled parameter's tiles: assembled)
                    self._put(slot.fqn, slot.read_into(flat, tiles))
                elif slot.fqn in fqns:
                    # Each its own tensor, not a view of the unit's buffer: a value kept past the block
                    # (`state[name] = p.data.cpu()`, then torch.save) would keep, and save, the whole unit.
                    self._put(slot.fqn, flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone())
        self._gathered.update(fqns)
        try:
            yield
        finally:
            self._gathered.difference_update(fqns)
            try:
                if modifier_rank is not None and flats:
                    for layout in self._units_of(fqns):  # the parameters' values back into their units
                        for slot in layout.slots:
                            if slot.fqn in fqns:
                                flats[layout.name][slot.offset : slot.offset + slot.numel].copy_(
                                    self.params[slot.fqn].detach().reshape(-1)[slot.start : slot.start + slot.numel])
                    self._write_back(flats, modifier_rank)
            finally:
                self.bind(force=True)

    @torch.no_grad()
    def _write_back(self, flats: dict[str, torch.Tensor], modifier_rank: int) -> None:
        low_dtype = self.compute_dtype
        for unit, flat in flats.items():
            if self.comm.world_size > 1:  # modifier_rank's bits to every rank: the others add zeros
                bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[flat.element_size()])
                if self.comm.rank != modifier_rank:
                    bits.zero_()
                self.comm.all_reduce(bits, count=False).wait()
            self.state.install_unit(unit, lambda lo, hi, flat=flat: flat[lo:hi], low_dtype)


_GATHERED = "GatheredParameters"
"""What a GatheredParameters gather calls itself in the ranks' agreement."""


class OtherRanksElsewhere(Exception):
    """A yielding gather's other ranks are at other collectives: it gathered nothing."""


def _common_module(fqns: Iterable[str]) -> str:
    """The innermost module holding every parameter named ("" for the model)."""
    paths = [fqn.split(".")[:-1] for fqn in fqns]
    common = paths[0] if paths else []
    for path in paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] == path[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def _function(method) -> EngineHook:
    """A hook calling `method` (`EngineHook`: torch marks hooks with attributes, which a bound
    method cannot take; pickling the model is refused naming what to save)."""
    return EngineHook(method)


def _named_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module, str]]:
    """(FQN, buffer, owning module, attribute) of every buffer, aliases included."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, b in module._buffers.items():
            if b is not None:
                yield (f"{prefix}.{name}" if prefix else name), b, module, name

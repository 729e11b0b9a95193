"""DeepSpeed's `deepspeed.zero`: build a model without its full weights, and gather them for a while.

    with fxzero.zero.Init(config_dict_or_path=ds_config):      # deepspeed.zero.Init
        model = MyModel()                                       # on the meta device: nothing allocated
    engine, *_ = fxzero.initialize(model=model, config=ds_config)

    with fxzero.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.zero_()                        # written back into every rank's shards

[Note: zero.Init]
DeepSpeed's `zero.Init` partitions each parameter as its module is constructed: the init code
runs on full tensors, one module at a time, drawing from the global RNG. fxzero builds the model
on the meta device instead (nothing allocated, nothing drawn) and records where the global RNG
stood; `fxzero.initialize` then replays the model's own init from that state, one module at a
time, each rank keeping its shards (`fxzero/runtime/init_replay.py`): the same values DeepSpeed's
construction gives. At the block's end the global RNG is moved to where eager construction would
have left it (by a replay whose values are dropped), so later draws in the script (data order,
dropout) are DeepSpeed's too. `remote_device` needs no translating: construction allocates
nothing on any device, and where shards live while training is the config's `offload_param`.

[Note: gathering before initialize]
Code written for DeepSpeed gathers a model built under `zero.Init` before `initialize`:
Hugging Face's `from_pretrained` at ZeRO-3 builds the model in the block, then runs its init and
loads the checkpoint's values on rank 0 inside `GatheredParameters(params, modifier_rank=0)`,
module by module. DeepSpeed has each parameter partitioned by then; fxzero has no shards before
`initialize` (their layout is the compile's). So the first gather makes one rank the model's
holder (the block's modifier, else rank 0), which builds it whole from its own init replayed
(the values `initialize` would have given); the other ranks keep their meta placeholders. In
each block every rank holds the gathered parameters whole, broadcast from the holder; at its
end the modifier's values go to the holder (with `modifier_rank=None` changes are dropped) and
the other ranks drop theirs. `initialize` then shards the model from the holder, one parameter
at a time (`fxzero.runtime.materialize`). Memory until then: the whole model on the holder
(Hugging Face's loading reads the whole checkpoint on rank 0 in any case), the gathered
parameters on the others, as under DeepSpeed.

[Note: parameters made beside a held model]
Code also makes new parameters beside such a model before `initialize`, outside any `Init`
block, on the device of the model's own (`weight.device`): Hugging Face's
`resize_token_embeddings` builds a new embedding so and swaps it in, in a GatheredParameters
block with the old one; LoRA scripts add their adapters so. Under DeepSpeed they are whole on
every rank, alike. Here that device is the CPU on the holder and the meta device elsewhere, so
only the holder has their values: a parameter no engine holds and not built under `Init` that
is meta on some rank (found with one all-reduce) is the held model's, whole on its holder, and
is gathered from it like the model's own (the model of the other parameters gathered with it,
else the one model held). `initialize` shards every parameter of the model from the holder, so
the new ones come from it too. A parameter real on every rank is left as it is, as DeepSpeed
leaves parameters that are not ZeRO's.

Building such a module draws from the global RNG (nn.Embedding's normal_ init) on the holder
only: the others built it on the meta device. Under DeepSpeed every rank draws it, so ranks
seeded alike stay alike, and the dropout masks training draws next depend on it. So where every
rank's RNG was alike at the model's first gather (`InitRecord.rng_alike`), each gather block's
end and `initialize` put the other ranks' RNG where the holder's is; ranks seeded apart are
left apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import weakref
from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.nn as nn

from fxzero.config.notices import warn_ineffective, warn_once
from fxzero.runtime.init_replay import initial_values, rng_after_construction
from fxzero.runtime.materialize import rng_from
from fxzero.runtime.user_module import ZeroParamStatus, binding_of, mark_zero3

__all__ = ["GatheredParameters", "Init", "InitRecord", "ZeRORuntimeException", "ZeroParamStatus", "init_record",
           "param_status", "register_external_parameter", "unwrap_model_for_generation",
           "zero_wrapper_for_fp_tensor_constructor"]

_RECORD = "_fxzero_zero_init"
"""The attribute a module built under `Init` carries: its `InitRecord`."""


@dataclasses.dataclass(frozen=True)
class InitRecord:
    """What `fxzero.initialize` needs of a model built under `zero.Init`."""

    rng_state: torch.Tensor
    """The global CPU RNG state when the block began: its init is replayed from here."""
    config: Any = None
    """`config_dict_or_path` (or `config`): the DeepSpeed config, used when initialize gets none."""
    held_by: Optional[int] = None
    """The rank that holds the model whole since its first gather before initialize ([Note:
    gathering before initialize]); None: never gathered, every rank's parameters are meta."""
    rng_alike: bool = False
    """Whether every rank's global RNG was alike at that first gather: then each gather block,
    and `initialize`, leaves the others' RNG where the holder's is ([Note: parameters made
    beside a held model])."""


_BUILT_IN: dict[int, tuple[str, "weakref.ref[nn.Module]"]] = {}
"""id(parameter) -> (its name, the model built under `Init` that holds it, weakly). Not the
parameter itself: `torch.utils.swap_tensors` refuses a tensor that has a weak reference."""

_BUILT_BY = "_fxzero_built_under_init"
"""The attribute of a parameter built under `Init` holding its `_BUILT_IN` entry: what it was
built in stays with the object (an id can be reused; a module attribute reassigned), so a
parameter replaced in its module (transformers' `resize_token_embeddings` sets the embedding's
new weight while the head still holds the old, tied one) is still its model's on every rank."""
_OPEN_BLOCKS: list["Init"] = []
"""The `Init` blocks being executed (construction under way)."""


def init_record(model: nn.Module) -> Optional[InitRecord]:
    """The record of a model built under `Init`, or None."""
    return getattr(model, _RECORD, None)


class Init:
    """DeepSpeed's `zero.Init`: construct modules on the meta device ([Note: zero.Init]).

    Args (DeepSpeed's; those fxzero has no use for are accepted and named once if set):
        module: an already-built module: nothing to do (fxzero shards it at initialize).
        remote_device: "cpu"/"nvme"/None: construction allocates nothing, so any is honoured;
            training placement is the config's `offload_param`.
        config_dict_or_path, config: the DeepSpeed config, kept for `initialize` (used when it
            is given none).
        enabled: False: construct eagerly, as without the block.
        dtype: DeepSpeed casts parameters to it at construction; fxzero keeps fp32 masters and
            computes in the config's bf16/fp16 (a different dtype is named once).
    """

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, **ignored: Any) -> None:
        if remote_device not in (None, "none", "cpu", "nvme", "cuda"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): one of None, 'cpu', 'nvme'")
        if mpu is not None or data_parallel_group is not None:
            raise ValueError("zero.Init: fxzero is data parallel over every rank: mpu and data_parallel_group "
                             "are not supported")
        notes = [f"zero.Init({k}=...) has no effect in fxzero: it shards over every rank, allocating nothing at "
                 "construction" for k, v in ignored.items() if v not in (None, False)]
        if dtype is not None and dtype != torch.float32:
            notes.append(f"zero.Init(dtype={dtype}) has no effect in fxzero: parameters keep fp32 masters and "
                         "compute in the config's bf16/fp16 dtype")
        warn_ineffective(notes)
        self.enabled = enabled and module is None
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        created: dict[int, nn.Module] = {}
        children: set[int] = set()

        def on_param(module: nn.Module, name: str, param: Any) -> None:
            created.setdefault(id(module), module)

        def on_module(module: nn.Module, name: str, submodule: Any) -> None:
            created.setdefault(id(module), module)
            if submodule is not None:
                children.add(id(submodule))

        self._created, self._children = created, children
        self._start = torch.random.get_rng_state()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.callback(nn.modules.module.register_module_parameter_registration_hook(on_param).remove)
        stack.callback(nn.modules.module.register_module_module_registration_hook(on_module).remove)
        _OPEN_BLOCKS.append(self)
        stack.callback(_OPEN_BLOCKS.remove, self)
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stack is None:
            return
        self._stack.close()
        self._stack = None
        if exc[0] is not None:
            return
        roots = [m for i, m in self._created.items() if i not in self._children]
        state = self._start
        for root in roots:  # each root's init, replayed as eager construction ran it, in order
            setattr(root, _RECORD, InitRecord(state, self.config))
            for index, (name, p) in enumerate(root.named_parameters()):
                _BUILT_IN[id(p)] = p.__dict__[_BUILT_BY] = (name, weakref.ref(root))
                mark_zero3(p, index, tuple(p.shape), persist=False, available=False)
            hook = functools.partial(_empty_where_not_held, weakref.ref(root))
            for module in root.modules():
                module.register_state_dict_post_hook(hook)
            state = rng_after_construction(root, state)
        torch.random.set_rng_state(state)  # where eager construction would have left the RNG


def _empty_where_not_held(root_ref: "weakref.ref[nn.Module]", module: nn.Module, state_dict: dict, prefix: str,
                          local_metadata: Any) -> None:
    """[Note: a state_dict() before initialize]
    Before `initialize`, a model built under `zero.Init` has values only where a rank holds it
    ([Note: gathering before initialize]); elsewhere its tensors are meta placeholders, which
    code written for DeepSpeed cannot read (TRL's `hash_module` copies each to the CPU before
    training when the reference log-probabilities are precomputed). DeepSpeed's partitioned
    parameters are empty tensors there, on every rank. So in such a `state_dict()` a tensor this
    rank does not hold is an empty one of its dtype, as DeepSpeed's: on every rank before the
    model's first gather (transformers lists the keys so before loading a checkpoint), and on
    the ranks other than its holder after, with a one-time warning naming the way to the
    values (the holder's are its values). After `initialize` the engine's
    hooks give every value ([Note: the user's module] in `fxzero/runtime/user_module.py`)."""
    root = root_ref()
    first = next(root.parameters(), None) if root is not None else None
    if first is None or binding_of(first) is not None:  # (initialized: every parameter is bound)
        return
    emptied = 0
    for key, value in list(state_dict.items()):
        if not (key.startswith(prefix) and isinstance(value, torch.Tensor) and value.is_meta):
            continue
        rel = key[len(prefix):]
        owner, _, name = rel.rpartition(".")
        try:
            holder_module = module.get_submodule(owner) if owner else module
        except AttributeError:
            continue
        own = holder_module._parameters.get(name, holder_module._buffers.get(name))
        if own is value:  # (state_dict(keep_vars=True): the tensors themselves are asked for)
            continue
        state_dict[key] = torch.empty(0, dtype=value.dtype)
        emptied += 1
    record = init_record(root)
    if emptied and record is not None and record.held_by is not None:  # (else empty on every rank alike)
        rank, _ = _rank_and_world()
        warn_once([f"[rank {rank}] state_dict() of a model built under zero.Init, before fxzero.initialize, on a "
                   f"rank that does not hold it (rank {record.held_by} holds it whole since its first gather): "
                   "its tensors are empty (numel 0) in it, as DeepSpeed's "
                   "partitioned parameters are. For their values gather on every rank with "
                   "fxzero.zero.GatheredParameters(model.parameters()), or call state_dict() after initialize"],
                  UserWarning, stacklevel=4)


def zero_wrapper_for_fp_tensor_constructor(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's `Init` wraps tensor constructors with this, casting floating tensors to the
    config's dtype and device; fxzero's builds on the meta device and casts nothing, so it returns
    `fn` as it is. Code that patches it around `Init` (Hugging Face's
    `prevent_arange_dtype_change`) finds it, and changes nothing."""
    return fn


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed needs this for a parameter used outside its module's forward; fxzero traces the
    whole forward, so every use is seen: nothing to do."""


def param_status(param: torch.Tensor) -> ZeroParamStatus:
    """Whether this rank holds `param`'s value now: its `ds_status` where it has one ([Note: the
    DeepSpeed attributes of a parameter] in `fxzero/runtime/user_module.py`), else not for a
    meta placeholder."""
    status = getattr(param, "ds_status", None)
    if status is not None:
        return status
    return ZeroParamStatus.NOT_AVAILABLE if param.is_meta else ZeroParamStatus.AVAILABLE


class ZeRORuntimeException(Exception):
    """DeepSpeed's exception for two refusals fxzero does not share, so it raises it nowhere: a
    client optimizer with ZeRO-Offload under `zero_force_ds_cpu_optimizer` (fxzero runs its own
    update of the client's optimizer on whatever tier the states live) and a checkpoint from
    another data-parallel world size (fxzero re-slices it). A script's `except` clause for it
    keeps working."""


def _built_under_init(param: torch.Tensor) -> Optional[nn.Module]:
    """The model built under `Init` that `param` was built in (and belongs to while it lives, held
    by that model's modules or not), or None."""
    entry = param.__dict__.get(_BUILT_BY)
    return entry[1]() if entry is not None else None


def _swap_in(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param` (the same object) now holds `value`'s storage, on its device: a meta placeholder
    made whole, or a whole one made a placeholder again. Its attributes stay (the swap moves
    them too: Hugging Face's `_is_hf_initialized` flags must stay put)."""
    other = nn.Parameter(value, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, other)
    param.__dict__.update(other.__dict__)


@torch.no_grad()
def _materialize(root: nn.Module) -> None:
    """Give a model built under `Init` its values whole, in place, on this rank: its own init
    replayed from where the block began ([Note: gathering before initialize]). Parameters keep
    their identity; the global RNG is left where it is."""
    values = list(initial_values(root, init_record(root).rng_state))  # (the replay puts the model back as it was)
    for what, fqn, value in values:
        if what == "param":
            _swap_in(root.get_parameter(fqn), value)
        else:
            owner, _, name = fqn.rpartition(".")
            root.get_submodule(owner)._buffers[name] = value


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _holder(root: nn.Module, modifier_rank: Optional[int]) -> int:
    """The rank holding `root` whole, chosen at its first gather (the modifier, else rank 0),
    which builds it then ([Note: gathering before initialize])."""
    record = init_record(root)
    if record.held_by is None:
        rank, world = _rank_and_world()
        holder = modifier_rank if modifier_rank is not None else 0
        if not 0 <= holder < world:
            raise ValueError(f"[rank {rank}] GatheredParameters(modifier_rank={modifier_rank}): ranks are "
                             f"0..{world - 1}")
        if rank == holder:
            _materialize(root)
        record = dataclasses.replace(record, held_by=holder, rng_alike=_rng_alike_everywhere())
        setattr(root, _RECORD, record)
    return record.held_by


def _rng_alike_everywhere() -> bool:
    """Whether every rank's global CPU RNG is in one state (a collective)."""
    import torch.distributed as dist

    if _rank_and_world()[1] == 1:
        return True
    digest = int.from_bytes(hashlib.blake2b(torch.random.get_rng_state().numpy().tobytes(), digest_size=7).digest(),
                            "little")
    both = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(both[0]) == -int(both[1])


def _join(group: list[torch.Tensor], p: torch.Tensor) -> None:
    if not any(p is q for q in group):
        group.append(p)


def _loose_on_holder(loose: list[torch.Tensor], unsharded: dict[int, list[torch.Tensor]], alike: dict[int, bool]
                     ) -> list[tuple[torch.Tensor, int, bool]]:
    """Of parameters neither an engine's nor built under `Init`, those that are some held
    model's, with its holder ([Note: parameters made beside a held model]); the others are left
    as they are, but a meta one has nothing to gather: an error. A collective where the call
    has such parameters and a model is held (every rank classifies alike)."""
    if not loose:
        return []
    if not unsharded:
        for record in _held_records():
            alike[record.held_by] = alike.get(record.held_by, False) or record.rng_alike
    holders = set(unsharded) or set(alike)
    if len(holders) == 1 and _rank_and_world()[1] > 1:
        import torch.distributed as dist

        meta = torch.tensor([p.is_meta for p in loose], dtype=torch.uint8)
        dist.all_reduce(meta, op=dist.ReduceOp.MAX)  # (meta on some rank: a held model's, whole on its holder)
        (holder,) = holders
        joined = [(p, holder, alike.get(holder, False)) for p, m in zip(loose, meta.tolist()) if m]
    else:
        joined = []
    kept = {id(p) for p, _, _ in joined}
    if any(p.is_meta and id(p) not in kept for p in loose):
        raise RuntimeError(
            "GatheredParameters: this parameter is on the meta device, no fxzero engine holds it and it "
            "was not built under fxzero.zero.Init, so it has no values to gather. Build the model under "
            "zero.Init (its own init then gives them), give it values first "
            "(module.load_state_dict(state, assign=True)), or gather it after fxzero.initialize")
    return joined


def _held_records() -> list[InitRecord]:
    """The records of the live models built under `Init` that a rank holds whole."""
    roots = {id(r): r for r in (ref() for _, ref in _BUILT_IN.values()) if r is not None}
    return [rec for rec in map(init_record, roots.values()) if rec is not None and rec.held_by is not None]


def _flat(params: Any) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if p is not None] if params is not None else []


class GatheredParameters:
    """DeepSpeed's `zero.GatheredParameters`: inside the block the parameters hold their full
    values on every rank. With `modifier_rank`, for writing there, the fp32 masters, and at the
    block's end the modifier's values are written into every rank's shards (the fp32 master, the
    compute-dtype copy and any tier); with `modifier_rank=None`, for reading, the values the
    model computes with (the compute dtype under mixed precision, as DeepSpeed's are), and
    changes are dropped. A collective: every rank enters it
    with the same parameters. Parameters fxzero does not manage (built eagerly and not compiled)
    are left as they are, as DeepSpeed leaves non-ZeRO parameters.

    Args:
        params: a parameter or an iterable of them.
        modifier_rank: the rank whose values are kept, or None.
        fwd_module: DeepSpeed registers external parameters with it; not needed by fxzero.
        enabled: False: the block does nothing.
    """

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor]], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[nn.Module] = None, enabled: bool = True) -> None:
        self.params = _flat(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> "GatheredParameters":
        by_binding: dict[int, tuple[Any, list[str]]] = {}
        unsharded: dict[int, list[torch.Tensor]] = {}  # of models built under Init, before initialize, by holder
        alike: dict[int, bool] = {}  # holder -> whether its models' ranks drew alike ([Note: parameters made beside ...])
        loose: list[torch.Tensor] = []  # neither an engine's nor built under Init
        for p in self.params:
            found = binding_of(p)
            root = _built_under_init(p) if found is None else None
            if root is not None:  # ([Note: gathering before initialize])
                holder = _holder(root, self.modifier_rank)
                _join(unsharded.setdefault(holder, []), p)
                alike[holder] = alike.get(holder, False) or init_record(root).rng_alike
            elif found is None:
                if p.is_meta and _OPEN_BLOCKS:
                    raise RuntimeError(
                        "GatheredParameters inside a zero.Init block: fxzero builds the model on the meta device "
                        "and gives it its values at the block's end (its own init replayed), so there is nothing "
                        "to gather yet. Set the values in the module's reset_parameters() or the model's "
                        "_init_weights(module), or gather them after the block")
                loose.append(p)
            else:
                binding, fqn = found
                by_binding.setdefault(id(binding), (binding, []))[1].append(fqn)
        for p, holder, rng_alike in _loose_on_holder(loose, unsharded, alike):
            _join(unsharded.setdefault(holder, []), p)
            alike[holder] = alike.get(holder, False) or rng_alike
        stack = contextlib.ExitStack()
        for binding, fqns in by_binding.values():
            if self.modifier_rank is not None and not 0 <= self.modifier_rank < binding.comm.world_size:
                raise ValueError(f"[rank {binding.comm.rank}] GatheredParameters(modifier_rank={self.modifier_rank})"
                                 f": ranks are 0..{binding.comm.world_size - 1}")
            stack.enter_context(binding.gathered(list(dict.fromkeys(fqns)), self.modifier_rank))
        for holder, params in unsharded.items():
            stack.enter_context(_whole_from_holder(params, holder, self.modifier_rank, alike.get(holder, False)))
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)


@contextlib.contextmanager
@torch.no_grad()
def _whole_from_holder(params: list[torch.Tensor], holder: int, modifier_rank: Optional[int], rng_alike: bool):
    """GatheredParameters for parameters of a model not yet sharded ([Note: gathering before
    initialize]): whole on every rank for the block, from the holder (a collective); at its end
    the modifier's values to the holder, or, with no modifier, the holder's from before put back;
    the other ranks' copies dropped; with `rng_alike`, their RNG put where the holder's is."""
    import torch.distributed as dist

    rank, world = _rank_and_world()
    if modifier_rank is not None and not 0 <= modifier_rank < world:
        raise ValueError(f"[rank {rank}] GatheredParameters(modifier_rank={modifier_rank}): ranks are 0..{world - 1}")
    borrowed = [p for p in params if rank != holder and p.is_meta]
    for p in borrowed:
        _swap_in(p, torch.empty(p.shape, dtype=p.dtype))
    for p in params if world > 1 else ():
        dist.broadcast(p.data, src=holder)
    marked = [p for p in params if "ds_status" in p.__dict__]  # (alike on every rank: [Note: the DeepSpeed ...])
    for p in marked:
        p.ds_status = ZeroParamStatus.AVAILABLE
    before = [p.detach().clone() for p in params] if modifier_rank is None and rank == holder else None
    try:
        yield
    finally:
        if before is not None:
            for p, value in zip(params, before):
                p.copy_(value)
        elif modifier_rank is not None and modifier_rank != holder:
            for p in params:
                dist.broadcast(p.data, src=modifier_rank)
        for p in borrowed:
            _swap_in(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        for p in marked:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        if rng_alike:
            rng_from(holder)


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """DeepSpeed's `deepspeed.runtime.zero.unwrap_model_for_generation(engine)`: inside the block
    every parameter is whole (`GatheredParameters` over them all) and the direct-call hooks are
    removed, so `model.generate(...)` runs on the whole model without a gather per call; they are
    registered again when the block ends (also on an exception, where DeepSpeed leaves them off).
    Yields `model`. Below ZeRO-3 there are no hooks and nothing to gather: the block just runs."""
    optimizer = getattr(model, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None)
    with GatheredParameters(list(model.parameters())):
        if offload is not None:
            for hook in offload.forward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield model
        finally:
            if offload is not None:
                offload._register_deepspeed_module(offload.module)

"""Every private PyTorch API fxzero touches, in one place.

A torch upgrade that moves one of these should only need a change here.
"""

import torch.utils._pytree as pytree  # noqa: F401  (tree_flatten, tree_map, TreeSpec)
from torch._decomp import get_decompositions  # noqa: F401
from torch._ops import OpOverload  # noqa: F401
from torch._subclasses.fake_tensor import (  # noqa: F401
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import (  # noqa: F401
    SYMPY_INTERP,
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
    free_unbacked_symbols,
)
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

__all__ = ["SYMPY_INTERP", "DataDependentOutputException", "DimDynamic", "DynamicOutputShapeException", "FakeTensor",
           "FakeTensorMode", "GuardOnDataDependentSymNode", "OpOverload", "ShapeEnv", "StatelessSymbolicContext",
           "TorchDispatchMode", "backed_hints", "dynamic_dims_of", "free_unbacked_symbols", "get_decompositions",
           "local_source", "make_fx", "maybe_mark_dynamic", "pytree", "size_like_symbols", "upper_bound",
           "where_fixed"]

# torch.optim's functional updates (each module's `foreach=False` path is its single-tensor
# implementation) and the dtype torch keeps an optimizer's per-parameter numbers in: the
# arithmetic fxzero runs on shards for the optimizers it does not write itself
# (fxzero/runtime/torch_updates.py).
from torch.optim.adadelta import adadelta as adadelta_update  # noqa: F401
from torch.optim.adam import adam as adam_update  # noqa: F401
from torch.optim.adamax import adamax as adamax_update  # noqa: F401
from torch.optim.asgd import asgd as asgd_update  # noqa: F401
from torch.optim.nadam import nadam as nadam_update  # noqa: F401
from torch.optim.optimizer import _get_scalar_dtype as optimizer_scalar_dtype  # noqa: F401
from torch.optim.radam import radam as radam_update  # noqa: F401
from torch.optim.rmsprop import rmsprop as rmsprop_update  # noqa: F401
from torch.optim.rprop import rprop as rprop_update  # noqa: F401
from torch.optim.sgd import sgd as sgd_update  # noqa: F401

LR_SCHEDULER_TRACKS_STEP = "_wrapped_by_lr_sched"
"""The attribute torch's LR schedulers put on an optimizer's wrapped `step` (lr_scheduler.py)."""
LR_SCHEDULER_SAW_STEP = "_opt_called"
"""The attribute that wrapped `step` sets on the optimizer, read by the scheduler's order check."""

__all__ += ["LR_SCHEDULER_SAW_STEP", "LR_SCHEDULER_TRACKS_STEP", "adadelta_update", "adam_update", "adamax_update",
            "asgd_update", "nadam_update", "optimizer_scalar_dtype", "radam_update", "rmsprop_update", "rprop_update",
            "sgd_update"]


def local_source(name: str):
    """torch's name for a traced function's argument (`L['name']` in guard expressions)."""
    from torch._dynamo.source import LocalSource  # (torch._dynamo costs a second to import: only when tracing dynamic)

    return LocalSource(name)


def maybe_mark_dynamic(t, dims) -> None:
    """Ask the tracer to trace these dims of `t` symbolically, without insisting: a dim the model
    needs at one size is specialized (torch._dynamo.maybe_mark_dynamic)."""
    import torch._dynamo

    for d in dims:
        torch._dynamo.maybe_mark_dynamic(t, d)


def dynamic_dims_of(t) -> frozenset:
    """The dims of `t` marked dynamic, by torch._dynamo.mark_dynamic or maybe_mark_dynamic."""
    return frozenset(getattr(t, "_dynamo_dynamic_indices", ())) | frozenset(getattr(t, "_dynamo_weak_dynamic_indices", ()))


def backed_hints(shape_env) -> dict:
    """The example's value of each size symbol created from an input (sympy symbol -> int)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    if values is None:  # torch < 2.10
        values = shape_env.var_to_val
    return {s: int(v) for s, v in values.items()}


def size_like_symbols(shape_env) -> frozenset:
    """The unbacked symbols that are sizes an operator made from the data (nonzero's count), as
    opposed to values read with `.item()`."""
    return frozenset(shape_env.size_like)


def upper_bound(shape_env, symbol):
    """The largest value the ShapeEnv allows `symbol`, or None if it has no finite bound."""
    bounds = shape_env.var_to_range.get(symbol)
    upper = bounds.upper if bounds is not None else None
    return int(upper) if upper is not None and upper.is_finite else None


def where_fixed(shape_env, source: str):
    """Where the trace fixed the size named `source` (`L['t0'].size()[1]`) to one value: the code
    that equated its symbol, or one it was equated to, with a number (None: it was not fixed)."""
    def name(x):
        return x.name() if callable(x.name) else x.name

    for symbol in [s for s, sources in shape_env.var_to_sources.items() if any(name(x) == source for x in sources)]:
        while symbol in shape_env.replacements:
            target = shape_env.replacements[symbol]
            if not getattr(target, "is_symbol", False):
                where = shape_env.replacements_slocs.get(symbol)
                return str(where).strip("()") if where is not None else "an unknown place"
            symbol = target
    return None


def all_gather_single(out, shard, *, group, async_op: bool):
    """Every rank's `shard` gathered into the flat `out`: `dist.all_gather_single` where torch has
    it (2.13), `dist.all_gather_into_tensor` before (2.11, 2.12: the same collective, older name)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, shard, group=group, async_op=async_op)


def reduce_scatter_single(out, flat, *, op, group, async_op: bool):
    """`flat` reduced over ranks, this rank's slice into `out`: `dist.reduce_scatter_single` where
    torch has it (2.13), `dist.reduce_scatter_tensor` before (2.11, 2.12)."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, flat, op=op, group=group, async_op=async_op)


__all__ += ["all_gather_single", "reduce_scatter_single"]


def checkpoint_regions(enter, leave):
    """A context in which every `torch.utils.checkpoint.checkpoint` call runs its function plainly
    between `enter()` and `leave()`, both checkpointing paths (torch's non-reentrant generator and
    its reentrant `CheckpointFunction`, which checkpoint() looks up at each call), so a tracer sees
    one region per call instead of checkpoint's own saved-tensor hooks and recompute."""
    import contextlib

    import torch.utils.checkpoint as checkpoint_module

    def generator(*args, **kwargs):
        enter()
        try:
            yield
        finally:
            leave()

    class Reentrant:
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            enter()
            try:
                return function(*args)
            finally:
                leave()

    @contextlib.contextmanager
    def patched():
        saved = checkpoint_module._checkpoint_without_reentrant_generator, checkpoint_module.CheckpointFunction
        checkpoint_module._checkpoint_without_reentrant_generator = generator
        checkpoint_module.CheckpointFunction = Reentrant
        try:
            yield
        finally:
            checkpoint_module._checkpoint_without_reentrant_generator, checkpoint_module.CheckpointFunction = saved

    return patched()


__all__ += ["checkpoint_regions"]

"""The `fxzero::` operators: the IR the passes insert into the traced ATen graph.

Each op has an eager kernel (used by a world of one and by anyone running a rewritten graph
directly) and a fake kernel, so rewritten graphs still trace under FakeTensorMode. The runtime
does not call the collective kernels: it recognizes these nodes and issues asynchronous
collectives instead (see `fxzero/runtime/executor.py`).

Ops that change a buffer in place declare it in `mutates_args` (`free`, `optim_step`,
`all_gather_into`, `cast_into`): their schema is then mutable, so `Graph.eliminate_dead_code` keeps them, and
the schedule orders every other reader of that buffer around them ([Note: ordered by
mutation] in `fxzero/schedule/build.py`).
"""

from typing import Optional

import torch

__all__ = ["OPS", "all_gather", "all_gather_into", "cast_into", "check_finite", "fetch", "flatten_grads", "free", "offload",
           "optim_step", "reduce_scatter", "wait"]

_lib = "fxzero"


@torch.library.custom_op(f"{_lib}::all_gather", mutates_args=())
def all_gather(shard: torch.Tensor, unit: str, world_size: int) -> torch.Tensor:
    """Start gathering `unit`'s flat parameter buffer from every rank's shard.

    The result may only be read after the matching `fxzero::wait`.
    """
    if world_size != 1:
        raise RuntimeError(
            "fxzero::all_gather ran eagerly with world_size > 1; rewritten graphs must run "
            "through fxzero's runtime, which issues the collective"
        )
    return shard.clone()


@all_gather.register_fake
def _(shard: torch.Tensor, unit: str, world_size: int) -> torch.Tensor:
    return shard.new_empty(shard.numel() * world_size)


@torch.library.custom_op(f"{_lib}::reduce_scatter", mutates_args=())
def reduce_scatter(flat: torch.Tensor, unit: str, world_size: int, keep_full: bool) -> torch.Tensor:
    """Start reduce-scattering (averaging) `unit`'s flat gradient; this rank keeps its shard.

    With `keep_full` (ZeRO-1), the averaged shard is written into this rank's slice of `flat`,
    and the result is that slice: the full gradient buffer stays allocated.
    """
    if world_size != 1:
        raise RuntimeError(
            "fxzero::reduce_scatter ran eagerly with world_size > 1; rewritten graphs must run "
            "through fxzero's runtime, which issues the collective"
        )
    return flat.clone()


@reduce_scatter.register_fake
def _(flat: torch.Tensor, unit: str, world_size: int, keep_full: bool) -> torch.Tensor:
    return flat.new_empty(flat.numel() // world_size)


@torch.library.custom_op(f"{_lib}::wait", mutates_args=())
def wait(t: torch.Tensor) -> torch.Tensor:
    """Block until the collective that produced `t` has completed; returns its result."""
    return t.clone()


@wait.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


@torch.library.custom_op(f"{_lib}::free", mutates_args=("buffer",))
def free(buffer: torch.Tensor) -> None:
    """Release a gathered buffer: its storage is resized to zero, so any later use fails loudly."""
    buffer.untyped_storage().resize_(0)


@free.register_fake
def _(buffer: torch.Tensor) -> None:
    return None


@torch.library.custom_op(f"{_lib}::flatten_grads", mutates_args=())
def flatten_grads(
    grads: list[Optional[torch.Tensor]], numels: list[int], padded_numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """Concatenate a unit's gradients into one zero-padded flat buffer (the unit's layout).

    A missing gradient (a parameter the loss does not depend on) stays zero.
    """
    out = torch.empty(padded_numel, dtype=dtype)
    offset = 0
    for g, n in zip(grads, numels):
        if g is None:
            out[offset : offset + n].zero_()
        else:
            out[offset : offset + n].copy_(g.reshape(-1))
        offset += n
    out[offset:].zero_()  # padding
    return out


@flatten_grads.register_fake
def _(
    grads: list[Optional[torch.Tensor]], numels: list[int], padded_numel: int, dtype: torch.dtype
) -> torch.Tensor:
    return torch.empty(padded_numel, dtype=dtype)


@torch.library.custom_op(f"{_lib}::fetch", mutates_args=())
def fetch(unit: str, state: str, numel: int, dtype: torch.dtype, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Start reading `unit`'s `state` ("param", "grad", an optimizer state such as "exp_avg")
    shard, `numel` elements of `dtype`, from the storage tier it is offloaded to. `after`: the
    receipt of the write this reads (a saved activation's: which of its writes, and written first).

    The result may only be read after the matching `fxzero::wait`. Only the runtime knows the
    tiers, so there is no eager kernel.
    """
    raise RuntimeError(
        "fxzero::fetch ran eagerly; the offloaded state lives in the engine's storage tiers: run the "
        "rewritten graph through fxzero's runtime"
    )


@fetch.register_fake
def _(unit: str, state: str, numel: int, dtype: torch.dtype, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


@torch.library.custom_op(f"{_lib}::offload", mutates_args=())
def offload(value: torch.Tensor, unit: str, state: str) -> torch.Tensor:
    """Start writing `value` as `unit`'s `state` ("grad", ...) to the tier it is offloaded to.

    The result is an empty token: after its `fxzero::wait` the write is complete and the tier
    holds the value; `value` must not change before then.
    """
    return value.new_empty(0)


@offload.register_fake
def _(value: torch.Tensor, unit: str, state: str) -> torch.Tensor:
    return value.new_empty(0)


@torch.library.custom_op(f"{_lib}::optim_step", mutates_args=("param", "states"))
def optim_step(param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], unit: str) -> None:
    """One optimizer update of `unit`'s shard, in place: `param` and every tensor of `states`
    change (`states`: the optimizer's per-element states, in the order its policy declares them:
    AdamW's exp_avg and exp_avg_sq, Adagrad's sum; [Note: optimizer states] in
    `fxzero/config/policies.py`).

    `param` is this rank's shard, or, for a unit held whole (ZeRO-1/2, persistent units), the
    unit's full flat buffer, of which this rank's slice is updated. The runtime supplies the
    optimizer's settings and step count, which only it knows, so there is no eager kernel.
    """
    raise RuntimeError(
        "fxzero::optim_step ran eagerly; it needs the engine's optimizer state: run the rewritten "
        "graph through fxzero's runtime"
    )


@optim_step.register_fake
def _(param, grad, states, unit):
    return None


@torch.library.custom_op(f"{_lib}::all_gather_into", mutates_args=("full",))
def all_gather_into(full: torch.Tensor, unit: str, world_size: int) -> torch.Tensor:
    """Start gathering, into `full` (a unit's whole flat buffer, held for the whole step), every
    rank's slice of it: this rank's slice is current (it was just updated), the others' are not.

    The result is an empty token; after its `fxzero::wait`, `full` is current everywhere.
    """
    if world_size != 1:
        raise RuntimeError(
            "fxzero::all_gather_into ran eagerly with world_size > 1; rewritten graphs must run "
            "through fxzero's runtime, which issues the collective"
        )
    return full.new_empty(0)


@all_gather_into.register_fake
def _(full: torch.Tensor, unit: str, world_size: int) -> torch.Tensor:
    return full.new_empty(0)


@torch.library.custom_op(f"{_lib}::cast_into", mutates_args=("low",))
def cast_into(low: torch.Tensor, master: torch.Tensor, unit: str) -> None:
    """Mixed precision: `low`, the low-precision copy of `unit`'s parameters that the all-gather
    moves, takes the values of `master`, this rank's fp32 master shard, cast to its dtype.

    `low` is this rank's shard, or, for a unit held whole, the unit's full flat buffer, of which
    this rank's slice is written (the others come from the all_gather_into that follows).
    """
    if low.numel() != master.numel():
        raise RuntimeError(
            "fxzero::cast_into ran eagerly on a unit held whole; it needs this rank's slice: run the "
            "rewritten graph through fxzero's runtime"
        )
    low.copy_(master)


@cast_into.register_fake
def _(low, master, unit):
    return None


@torch.library.custom_op(f"{_lib}::check_finite", mutates_args=())
def check_finite(grad: torch.Tensor, unit: str) -> torch.Tensor:
    """Whether `unit`'s gradient shard holds only finite values: a 1-element flag the runtime
    records for the step's agreement on overflow (float16 loss scaling; [Note: one flag per
    step] in fxzero/runtime/loss_scale.py). The result is an empty token."""
    return grad.new_empty(0)


@check_finite.register_fake
def _(grad: torch.Tensor, unit: str) -> torch.Tensor:
    return grad.new_empty(0)


OPS = {
    "all_gather": torch.ops.fxzero.all_gather.default,
    "reduce_scatter": torch.ops.fxzero.reduce_scatter.default,
    "wait": torch.ops.fxzero.wait.default,
    "free": torch.ops.fxzero.free.default,
    "flatten_grads": torch.ops.fxzero.flatten_grads.default,
    "fetch": torch.ops.fxzero.fetch.default,
    "offload": torch.ops.fxzero.offload.default,
    "optim_step": torch.ops.fxzero.optim_step.default,
    "all_gather_into": torch.ops.fxzero.all_gather_into.default,
    "cast_into": torch.ops.fxzero.cast_into.default,
    "check_finite": torch.ops.fxzero.check_finite.default,
}

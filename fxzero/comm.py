"""DeepSpeed's communication API (`deepspeed.comm`) over torch.distributed.

    import fxzero.comm as dist          # DeepSpeed: import deepspeed.comm as dist
    dist.init_distributed()
    if dist.get_rank() == 0: ...
    dist.all_reduce(t); dist.barrier()

The same functions as torch.distributed, with DeepSpeed's extra keyword arguments accepted:
`prof`, `log_name` and `debug` feed DeepSpeed's comms logger, which fxzero does not have, so
`prof=True` is named once in an `IneffectiveSetting` warning (`engine.comm_report()` counts what
fxzero's own collectives move). After `init_distributed()` a process group always exists, a
world of one included, as under DeepSpeed, so a script's own `get_rank()` works everywhere.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch
import torch.distributed as _dist

from fxzero.config.notices import warn_ineffective
from fxzero.deepspeed_api import init_distributed

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "destroy_process_group", "gather", "get_global_rank",
    "get_local_rank", "get_rank", "get_world_group", "get_world_size", "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor", "init_distributed", "irecv", "is_available", "is_initialized", "isend",
    "log_summary", "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "send",
]

ReduceOp = _dist.ReduceOp
_LOGGING = ("prof", "log_name", "debug")


def _collective(fn):
    """A torch.distributed function taking DeepSpeed's logging keywords as well."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any):
        logged = {k: kwargs.pop(k) for k in _LOGGING if k in kwargs}
        if logged.get("prof"):
            warn_ineffective([f"{fn.__name__}(prof=True) has no effect in fxzero: it has no comms logger "
                              "(engine.comm_report() counts what fxzero's collectives move)"])
        return fn(*args, **kwargs)

    return call


broadcast = _collective(_dist.broadcast)
broadcast_object_list = _collective(_dist.broadcast_object_list)
all_gather = _collective(_dist.all_gather)
all_gather_object = _collective(_dist.all_gather_object)


def _flat_when_counts_agree(big: torch.Tensor, small: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """NCCL's rule for the tensor collectives on every backend: only the element counts must agree
    (the big tensor world times the small), whatever the shapes; gloo also wants the big one to be
    the small ones stacked along dim 0, so give it both flat (views: the result lands in place)."""
    world = _dist.get_world_size(group)
    if big.is_contiguous() and big.numel() == world * small.numel() and (
            big.dim() == 0 or small.dim() == 0 or big.shape[1:] != small.shape[1:] or big.shape[0] != world * small.shape[0]):
        return big.view(-1), small.reshape(-1)
    return big, small


@_collective
def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    """torch.distributed's, taking any shapes whose element counts agree, as NCCL does."""
    output_tensor, input_tensor = _flat_when_counts_agree(output_tensor, input_tensor, group)
    return _dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@_collective
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = _dist.ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Any:
    """torch.distributed's, taking any shapes whose element counts agree, as NCCL does."""
    input, output = _flat_when_counts_agree(input, output, group)
    return _dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


reduce_scatter = _collective(_dist.reduce_scatter)
all_reduce = _collective(_dist.all_reduce)
reduce = _collective(_dist.reduce)
all_to_all_single = _collective(_dist.all_to_all_single)
gather = _collective(_dist.gather)
scatter = _collective(_dist.scatter)
send = _collective(_dist.send)
recv = _collective(_dist.recv)
isend = _collective(_dist.isend)
irecv = _collective(_dist.irecv)
barrier = _collective(_dist.barrier)
monitored_barrier = _collective(_dist.monitored_barrier)
new_group = _dist.new_group
destroy_process_group = _dist.destroy_process_group


def is_available() -> bool:
    return _dist.is_available()


def is_initialized() -> bool:
    return _dist.is_initialized()


def _require(what: str) -> None:
    if not _dist.is_initialized():
        raise RuntimeError(f"{what}: no process group yet; call fxzero.init_distributed() (DeepSpeed's "
                           "deepspeed.init_distributed()) first, or fxzero.initialize(), which calls it")


def get_rank(group: Any = None) -> int:
    _require("get_rank()")
    return _dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    _require("get_world_size()")
    return _dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node (the launcher's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return _dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group():
    return _dist.group.WORLD


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return _dist.get_process_group_ranks(group or _dist.group.WORLD)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Optional[dict]:
    """DeepSpeed prints its comms logger's table here; fxzero has none (`engine.comm_report()`)."""
    warn_ineffective(["fxzero.comm.log_summary() has no effect: fxzero has no comms logger "
                      "(engine.comm_report() counts what fxzero's collectives move)"])
    return {} if return_dict else None


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> Any:
    return _dist.all_reduce(tensor, op=op, group=group)

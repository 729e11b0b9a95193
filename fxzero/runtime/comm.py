"""Collectives: asynchronous all-gather and reduce-scatter on flat buffers, with byte counters.

`Comm` wraps torch.distributed (gloo on CPU, NCCL on CUDA); `LocalComm` is a world of one with
no process group, where a gather is a copy and a reduce-scatter is the identity. Both count
what each collective kind moves, for `Engine.comm_report()`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = ["Comm", "LocalComm", "Pending", "make_comm"]


@dataclasses.dataclass
class Traffic:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


class Pending(NamedTuple):
    """An in-flight collective: its work handle, its result, and what to do once it completes."""

    work: Optional[dist.Work]
    result: torch.Tensor
    finish: Optional[Callable[[], torch.Tensor]]
    """Runs after the wait (e.g. average, copy into place); returns the final value."""
    keep_alive: tuple = ()
    """Buffers the collective reads, held until it completes."""

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish() if self.finish is not None else self.result


class Comm:
    """Collectives over a torch.distributed process group."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.traffic: dict[str, Traffic] = collections.defaultdict(Traffic)

    def _count(self, kind: str, t: torch.Tensor) -> None:
        c = self.traffic[kind]
        c.calls += 1
        c.elements += t.numel()
        c.bytes += t.numel() * t.element_size()

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, count: bool = True) -> Pending:
        """Gather every rank's `shard` into `out` (length world_size * shard length)."""
        if count:
            self._count("all_gather", out)
        work = dist.all_gather_single(out, shard, group=self.group, async_op=True)
        return Pending(work, out, None, (shard,))

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> Pending:
        """Sum `flat` over ranks and keep this rank's slice in `out`; averaged on completion."""
        self._count("reduce_scatter", flat)
        work = dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return Pending(work, out, lambda: out.div_(self.world_size), (flat,))

    def all_gather_object(self, obj) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def report(self, reset: bool = False) -> dict[str, dict[str, int]]:
        out = {k: dataclasses.asdict(v) for k, v in sorted(self.traffic.items())}
        if reset:
            self.traffic.clear()
        return out


class LocalComm(Comm):
    """A world of one: no process group, collectives are local copies."""

    def __init__(self) -> None:
        self.group = None
        self.rank = 0
        self.world_size = 1
        self.traffic = collections.defaultdict(Traffic)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, count: bool = True) -> Pending:
        if count:
            self._count("all_gather", out)
        out.copy_(shard)
        return Pending(None, out, None)

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> Pending:
        self._count("reduce_scatter", flat)
        out.copy_(flat)
        return Pending(None, out, None)

    def all_gather_object(self, obj) -> list:
        return [obj]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


def make_comm() -> Comm:
    """The Comm for this process: the default process group if there is one, else a world of one."""
    if dist.is_available() and dist.is_initialized():
        return Comm()
    return LocalComm()

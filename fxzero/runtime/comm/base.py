"""Collectives: asynchronous all-gather, reduce-scatter and all-reduce on flat buffers.

`Comm` wraps torch.distributed (gloo on CPU, NCCL on CUDA); `LocalComm` is a world of one with
no process group, where a gather is a copy and a reduction the identity. Both count what each
logical collective moves, for `Engine.comm_report()`, and both can emulate a slower link
(`fxzero.runtime.comm.link`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from fxzero._compat import all_gather_single, reduce_scatter_single
from fxzero.config import LinkEmulation
from fxzero.runtime.comm.link import EmulatedLink

__all__ = ["Comm", "LocalComm", "Pending", "Traffic"]


@dataclasses.dataclass
class Traffic:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    via_all_reduce: int = 0
    """Calls of a logical reduce-scatter carried out as an all-reduce (see the schedule)."""


class Pending(NamedTuple):
    """An in-flight collective: its work handle, its result, and what to do once it completes."""

    work: Optional[dist.Work]
    result: torch.Tensor
    finish: Optional[Callable[[], torch.Tensor]] = None
    """Runs after the wait (e.g. average, copy into place); returns the final value."""
    keep_alive: tuple = ()
    """Buffers the collective reads, held until it completes."""
    deadline: float = 0.0
    """Emulated completion time (time.monotonic()); 0 without link emulation."""

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        if self.deadline:
            remaining = self.deadline - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
        return self.finish() if self.finish is not None else self.result


class Comm:
    """Collectives over a torch.distributed process group.

    [Note: a group per kind]
    NCCL runs the collectives of one process group in issue order on one stream, so a
    reduce-scatter issued behind an all-gather waits for it even where the two could overlap.
    Where the backend is NCCL, the reductions (reduce-scatters, all-reduces) therefore go over a
    second group of the same ranks, `reduce_group`, as SimpleFSDP does; every rank issues each
    group's collectives in the schedule's order, so neither group can pair mismatched calls.
    Gathers and object exchanges stay on `group`."""

    mapped_bytes = 0
    """Shared memory this rank maps to move collectives' data (memory_report's `transport`)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, link: Optional[LinkEmulation] = None,
                 reduce_group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.reduce_group = reduce_group if reduce_group is not None else group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.traffic: dict[str, Traffic] = collections.defaultdict(Traffic)
        self.link = EmulatedLink(link, self.world_size) if link is not None else None

    def _count(self, kind: str, t: torch.Tensor) -> None:
        c = self.traffic[kind]
        c.calls += 1
        c.elements += t.numel()
        c.bytes += t.numel() * t.element_size()

    def _deadline(self, t: torch.Tensor, passes: int = 1) -> float:
        return self.link.deadline(t.numel() * t.element_size(), passes) if self.link else 0.0

    # Each collective: count, then issue. Overridden by LocalComm for a world of one.
    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Optional[dist.Work]:
        return all_gather_single(out, shard, group=self.group, async_op=True)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> Optional[dist.Work]:
        return reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.reduce_group, async_op=True)

    def _all_reduce(self, flat: torch.Tensor) -> Optional[dist.Work]:
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.reduce_group, async_op=True)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, count: bool = True) -> Pending:
        """Gather every rank's `shard` into `out` (length world_size * shard length)."""
        if count:
            self._count("all_gather", out)
        work = self._all_gather(out, shard)
        return Pending(work, out, keep_alive=(shard,), deadline=self._deadline(out))

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, *, count: bool = True,
                       via_all_reduce: bool = False, divide_before: bool = False) -> Pending:
        """Average `flat` over ranks; `out` receives this rank's slice.

        With `via_all_reduce`, `flat` itself is all-reduced in place and sliced: on backends
        without a native reduce-scatter (gloo) that can be the faster way; `flat` is clobbered.
        With `divide_before`, each rank's `flat` is divided by the world size in place before the
        sum (`Config.gradient_division`), else the sum is divided.
        """
        if count:
            self._count("reduce_scatter", flat)
        n = out.numel()
        if divide_before:
            flat.div_(self.world_size)
        after = (lambda t: t) if divide_before else (lambda t: t.div_(self.world_size))
        if via_all_reduce:
            if count:
                self.traffic["reduce_scatter"].via_all_reduce += 1
            work = self._all_reduce(flat)
            mine = flat[self.rank * n : (self.rank + 1) * n]

            def finish() -> torch.Tensor:
                return after(out.copy_(mine))

            # An all-reduce moves the buffer twice (reduce-scatter, then all-gather).
            return Pending(work, out, finish, (flat,), self._deadline(flat, passes=2))
        work = self._reduce_scatter(out, flat)
        return Pending(work, out, lambda: after(out), (flat,), self._deadline(flat))

    def all_reduce(self, flat: torch.Tensor, *, count: bool = True) -> Pending:
        """Sum `flat` over ranks, in place."""
        if count:
            self._count("all_reduce", flat)
        return Pending(self._all_reduce(flat), flat, deadline=self._deadline(flat, passes=2))

    def all_gather_object(self, obj) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def report(self, reset: bool = False) -> dict[str, dict[str, int]]:
        out = {k: dataclasses.asdict(v) for k, v in sorted(self.traffic.items())}
        if reset:
            self.traffic.clear()
        return out


class LocalComm(Comm):
    """A world of one: no process group, collectives are local copies."""

    def __init__(self, link: Optional[LinkEmulation] = None) -> None:
        self.group = self.reduce_group = None
        self.rank = 0
        self.world_size = 1
        self.traffic = collections.defaultdict(Traffic)
        self.link = EmulatedLink(link, 1) if link is not None else None

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        out.copy_(shard)

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        out.copy_(flat)

    def _all_reduce(self, flat: torch.Tensor) -> None:
        return None

    def all_gather_object(self, obj) -> list:
        return [obj]

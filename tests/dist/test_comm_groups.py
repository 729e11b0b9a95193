"""[Note: a group per kind] (fxzero/runtime/comm/base.py): where the backend is NCCL, reductions
go over a process group of their own beside the gathers'. Here on gloo, 2 ranks: a Comm given a
reduction group sends every reduce-scatter and all-reduce through it and every all-gather through
the other, with the right results; and on gloo `make_comm` keeps one group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _ranks(rank: int, world_size: int) -> dict:
    import fxzero.runtime.comm.base as base
    from fxzero.runtime.comm import make_comm, reductions_apart

    reduce_group = dist.new_group()
    used: list[tuple[str, object]] = []
    for name in ("all_gather_single", "reduce_scatter_single"):
        real = getattr(base, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            used.append((_name, kwargs["group"]))
            return _real(*args, **kwargs)

        setattr(base, name, wrapped)
    comm = base.Comm(None, reduce_group=reduce_group)
    shard = torch.full((3,), float(rank + 1))
    gathered = comm.all_gather(torch.empty(6), shard).wait()
    reduced = comm.reduce_scatter(torch.empty(3), torch.arange(6.0) * (rank + 1)).wait()
    summed = comm.all_reduce(torch.tensor([float(rank)])).wait()
    default = make_comm(transport="process_group")
    return {"gathered": gathered, "reduced": reduced, "summed": summed,
            "groups": [(name, group is reduce_group) for name, group in used],
            "apart": reductions_apart(), "one_group_on_gloo": default.reduce_group is default.group}


def test_reductions_go_over_their_own_group():
    for rank, got in enumerate(run_ranks(_ranks, 2)):
        assert torch.equal(got["gathered"], torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0]))
        # (the mean of rank 1's and rank 2's multiples of arange, this rank's half)
        assert torch.equal(got["reduced"], (torch.arange(6.0) * 1.5)[3 * rank : 3 * rank + 3])
        assert torch.equal(got["summed"], torch.tensor([1.0]))
        assert got["groups"] == [("all_gather_single", False), ("reduce_scatter_single", True)]
        assert got["apart"] is False and got["one_group_on_gloo"] is True

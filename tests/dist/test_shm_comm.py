"""Shared-memory collectives (fxzero/runtime/comm/shm.py) against the process group's, on real ranks."""

from __future__ import annotations

import os

import pytest
import torch

import fxzero
from fxzero import zoo
from fxzero.runtime.comm import shm
from fxzero.runtime.comm import Comm, make_comm
from tests.dist.harness import run_ranks

# A tiny chunk, so every collective below runs many steps (both halves, boundaries mid-buffer).
CHUNK = 4096


def _data(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    # Small integers: every sum is exact in any order, so results must match bit for bit.
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-8, 8, (n,), generator=g).to(dtype)


def _against_gloo(rank: int, world_size: int) -> dict:
    ours, gloo = shm.ShmComm(chunk_bytes=CHUNK), Comm()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1023, 5000):  # shard lengths: below, across and many chunks
            shard = _data(rank, n, dtype, 1)
            flat = _data(rank, world_size * n, dtype, 2)
            # Several collectives in flight before the first wait: they complete in issue order.
            a_ours, a_gloo = torch.empty(world_size * n, dtype=dtype), torch.empty(world_size * n, dtype=dtype)
            r_ours, r_gloo = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            v_ours, v_gloo = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            s_ours, s_gloo = flat.clone(), flat.clone()
            pending = [
                ours.all_gather(a_ours, shard),
                ours.reduce_scatter(r_ours, flat.clone()),
                ours.reduce_scatter(v_ours, flat.clone(), via_all_reduce=True),
                ours.all_reduce(s_ours),
            ]
            results = [p.wait() for p in pending]
            gloo.all_gather(a_gloo, shard).wait()
            gloo.reduce_scatter(r_gloo, flat.clone()).wait()
            gloo.reduce_scatter(v_gloo, flat.clone(), via_all_reduce=True).wait()
            gloo.all_reduce(s_gloo).wait()
            out[(str(dtype), n)] = [torch.equal(x, y) for x, y in zip(results, (a_gloo, r_gloo, v_gloo, s_gloo))]
    # (this group's own segments: another test's ranks may be making theirs in the other worker)
    out["files_left"] = [p for p in ours._transport.paths if os.path.exists(p)]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_the_process_group(world_size):
    for rank, out in enumerate(run_ranks(_against_gloo, world_size)):
        assert out.pop("files_left") == [], "segments must be unlinked once every rank mapped them"
        for case, same in out.items():
            assert same == [True] * 4, f"rank {rank} {case}: all_gather, reduce_scatter, via all_reduce, all_reduce"


def _all_reduce_random(rank: int, world_size: int) -> list[torch.Tensor]:
    comm = shm.ShmComm(chunk_bytes=CHUNK)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(rank))
    comm.all_reduce(x).wait()
    return comm.all_gather_object(x)


def test_all_reduce_gives_every_rank_the_same_bits():
    # Rounding depends on the order of the sum: every rank must add in the same order.
    gathered = run_ranks(_all_reduce_random, 3)[0]
    assert all(torch.equal(gathered[0], g) for g in gathered[1:])


def _choose(rank: int, world_size: int) -> dict:
    out = {"auto": type(make_comm()).__name__, "process_group": type(make_comm(transport="process_group")).__name__}
    with torch.device("meta"):
        model = zoo.gpt("tiny")
    out["engine"] = type(fxzero.compile(model, fxzero.Config(cost_model=None)).comm).__name__
    shm.SHM_DIR = "/nonexistent-fxzero-shm"
    out["auto_without_shm"] = type(make_comm()).__name__
    try:
        make_comm(transport="shared_memory")
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_auto_uses_shared_memory_and_falls_back_when_it_cannot():
    for rank, out in enumerate(run_ranks(_choose, 2)):
        assert out["auto"] == out["engine"] == "ShmComm"
        assert out["process_group"] == out["auto_without_shm"] == "Comm"
        assert out["error"] is not None
        assert out["error"].startswith(f"[rank {rank}] Config(transport='shared_memory')")
        assert "/dev/shm" in out["error"] or "nonexistent" in out["error"]
        assert "transport='auto'" in out["error"]


def test_config_rejects_an_unknown_transport():
    with pytest.raises(ValueError, match=r"Config.transport must be one of .*'nccl'"):
        fxzero.Config(transport="nccl")

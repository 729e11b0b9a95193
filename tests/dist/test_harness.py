"""Tests of the multi-process harness itself: results, collectives, failures and timeouts."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks


# Rank functions live at module level: spawned ranks import them by name.


def _whoami(rank: int, world_size: int, tag: str) -> dict:
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "initialized": dist.is_available() and dist.is_initialized(),
        "env_rank": os.environ.get("RANK"),
        "tensor": torch.full((2,), float(rank)),
    }


def _all_reduce(rank: int, world_size: int) -> torch.Tensor:
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    dist.all_reduce(t)
    return t


def _raise_in_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("boom from rank one")
    return rank


def _sleep_in_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


def _exit_silently(rank: int, world_size: int) -> None:
    os._exit(3)


def test_world_of_one_has_no_process_group():
    (out,) = run_ranks(_whoami, 1, "solo", timeout_s=60)
    assert out["rank"] == 0 and out["world_size"] == 1 and out["tag"] == "solo"
    assert not out["initialized"], "a world of one must run without a process group"
    assert out["env_rank"] is None
    torch.testing.assert_close(out["tensor"], torch.zeros(2))


def test_results_come_back_in_rank_order():
    outs = run_ranks(_whoami, 2, "pair", timeout_s=60)
    assert [o["rank"] for o in outs] == [0, 1]
    assert all(o["world_size"] == 2 and o["initialized"] for o in outs)
    assert [o["env_rank"] for o in outs] == ["0", "1"]
    torch.testing.assert_close(outs[1]["tensor"], torch.ones(2))


def test_all_reduce_on_two_ranks():
    outs = run_ranks(_all_reduce, 2, timeout_s=60)
    for t in outs:
        torch.testing.assert_close(t, torch.tensor([3.0, 30.0]))


def test_exception_in_a_rank_surfaces_with_its_traceback():
    with pytest.raises(AssertionError, match=r"rank 1 of 2 failed") as info:
        run_ranks(_raise_in_rank_1, 2, timeout_s=60)
    message = str(info.value)
    assert "RuntimeError: boom from rank one" in message
    assert "_raise_in_rank_1" in message, "the rank's traceback should be in the message"


def test_a_rank_past_the_timeout_is_killed_and_reported():
    # Rank 0 may also still be starting on a loaded machine, hence the optional "0, ".
    with pytest.raises(AssertionError, match=r"timed out after 5s .* running \[(0, )?1\] were killed"):
        run_ranks(_sleep_in_rank_1, 2, timeout_s=5)
    assert not multiprocessing.active_children(), "every rank must be dead when run_ranks raises"


def test_a_rank_that_exits_without_reporting_is_reported():
    with pytest.raises(AssertionError, match=r"rank 0 exited with code 3 without reporting"):
        run_ranks(_exit_silently, 1, timeout_s=60)


def test_local_functions_are_refused_with_a_clear_error():
    def local(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="module-level function"):
        run_ranks(local, 1)

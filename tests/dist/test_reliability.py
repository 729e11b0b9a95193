"""No hang on a shape or program mismatch; a collective that waits too long is an error naming
where it waited. 2 gloo ranks, the tiny GPT at stage 3, cost model pinned to None.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero import zoo
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.reference import assert_losses_close, assert_state_close, clone_state_dict, lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(300)

ROWS = [(4, 2), (2, 4), (4, 2), (4, 4)]  # each step's rows on rank 0 and rank 1


def _problem():
    torch.manual_seed(0)
    state = clone_state_dict(zoo.build("gpt-tiny"))
    batches = make_gpt_batches(zoo.GPT_SIZES["tiny"], len(ROWS), 8, seed=5)
    return state, batches


def _rows(x, step: int, rank: int):
    n0, n1 = ROWS[step]
    return x[:n0] if rank == 0 else x[4 : 4 + n1]


def _train_with_uneven_shapes(rank: int, world_size: int):
    state, batches = _problem()
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None),
                            state_dict=state)
    losses = []
    for step, (x, y) in enumerate(batches):
        loss = lm_loss(engine(_rows(x, step, rank)), _rows(y, step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked)
    full = engine.full_state_dict()
    return {"losses": (stacked / world_size).tolist(), "programs": len(engine._cache),
            "state_dict": {k: v.clone() for k, v in full.items()}}


def test_ranks_with_different_shapes_in_one_step_train():
    """Rank 0 compiles a program at a step where rank 1 reuses its own (and back): the collectives
    are the same, so they train, as DDP does: the mean of the ranks' mean losses."""
    ranks = run_ranks(_train_with_uneven_shapes, 2, timeout_s=240)
    state, batches = _problem()
    model = zoo.build("gpt-tiny")
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    want = []
    for step, (x, y) in enumerate(batches):
        loss = (lm_loss(model(_rows(x, step, 0)), _rows(y, step, 0)) + lm_loss(model(_rows(x, step, 1)),
                                                                              _rows(y, step, 1))) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert [r["programs"] for r in ranks] == [2, 2]  # each rank compiled the shapes it saw
    assert_losses_close(ranks[0]["losses"], want, "uneven shapes: per-step losses")
    assert_state_close(ranks[0]["state_dict"], clone_state_dict(model), "uneven shapes")


class _Branchy(nn.Module):
    """Takes an extra layer for batches of more than 2 rows: a Python branch on a shape."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        x = self.layers[0](x)
        if x.shape[0] > 2:
            x = self.layers[1](x)
        return self.layers[2](x)


def _branch_on_shape(rank: int, world_size: int):
    engine = fxzero.compile(_Branchy(), fxzero.Config(stage=3, cost_model=None))
    engine(torch.randn(2, 8)).sum().backward()  # the same program on both ranks
    engine.step()
    start = time.monotonic()
    try:
        engine(torch.randn(4 if rank == 0 else 2, 8))
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


def test_a_program_whose_collectives_differ_is_an_error_on_every_rank():
    ranks = run_ranks(_branch_on_shape, 2, timeout_s=120)
    for rank, got in enumerate(ranks):
        assert got["error"] is not None and got["error"].startswith(f"[rank {rank}] the ranks' programs would issue "
                                                                    "different collectives"), got
        assert "at collective 1, ranks [0] issue forward: all_gather of layers.1" in got["error"], got["error"]
        assert "ranks [1] issue forward: all_gather of layers.2" in got["error"], got["error"]
        assert got["seconds"] < 30


def _one_rank_stalls(rank: int, world_size: int, where: str):
    engine = fxzero.compile(zoo.build("gpt-tiny"), fxzero.Config(stage=3, cost_model=None, collective_timeout=3))
    x = torch.randint(0, 96, (2, 16))
    start = time.monotonic()
    if where == "program":  # rank 1's forward's first all-gather starts 6 s late
        issue, calls = engine.comm.all_gather, []

        def late(out, shard, **kw):
            nonlocal start
            calls.append(1)
            if len(calls) == 2:  # (the first is the digest all-gather before the forward)
                start = time.monotonic()  # (timed from here: compiling the program is not waiting)
                if rank == 1:
                    time.sleep(6)
            return issue(out, shard, **kw)

        engine.comm.all_gather = late
    try:
        loss = engine(x).sum()
        if rank == 1 and where == "agreement":  # never joins the backward's collectives
            time.sleep(6)
            return {"error": None}
        engine.backward(loss)
        engine.step()  # (the last reduce-scatters are waited for in the step program)
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "type": type(e).__name__}
    return {"error": None}


def test_a_collective_that_waits_too_long_in_a_program_names_the_instruction_and_unit():
    got = run_ranks(_one_rank_stalls, 2, "program", timeout_s=60)[0]
    assert got["type"] == "CollectiveTimeout", got
    assert re.match(r"\[rank 0\] a collective timed out in the forward program at instruction \d+ "
                    r"\(wait \S+ of \S+, unit root\)", got["error"]), got
    assert 3 <= got["seconds"] < 9  # Config.collective_timeout=3, not gloo's 30 minutes


def test_a_step_collective_that_waits_too_long_names_what_it_agrees_on():
    got = run_ranks(_one_rank_stalls, 2, "agreement", timeout_s=60)[0]
    assert got["type"] == "CollectiveTimeout", got
    # The first collective rank 1 never joined: the loss-finiteness flag the backward reduces ahead
    # of its own collectives, waited for at the step.
    assert got["error"].startswith("[rank 0] a collective timed out in step 1's agreement (the loss-finiteness "
                                   "flag"), got
    assert 3 <= got["seconds"] < 9


def _nan_on_one_rank(rank: int, world_size: int):
    import warnings

    state, batches = _problem()
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    cfg = fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None, nonfinite="skip")
    engine = fxzero.compile(model, cfg, state_dict=state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(batches):
            logits = engine(x[4 * rank : 4 * rank + 4])
            loss = lm_loss(logits, y[4 * rank : 4 * rank + 4])
            if step == 1 and rank == 1:
                loss = loss * float("nan")
            if step == 2 and rank == 0:  # a finite loss (+ 0) whose gradient is NaN: d sqrt(x) / dx at 0
                loss = loss + (logits * 0).sum().sqrt()
            engine.backward(loss)
            engine.step()
    full = engine.full_state_dict()
    out = {"skipped": engine.skipped_steps, "steps": engine.global_steps,
           "warnings": [str(w.message) for w in caught if "skipped on every rank" in str(w.message)],
           "state_dict": {k: v.clone() for k, v in full.items()}}
    engine = fxzero.compile(zoo.build("gpt-tiny"), fxzero.Config(stage=3, cost_model=None))  # nonfinite="error"
    logits = engine(batches[0][0][4 * rank : 4 * rank + 4])
    loss = lm_loss(logits, batches[0][1][4 * rank : 4 * rank + 4]) + (logits * 0).sum().sqrt() * (rank == 1)
    engine.backward(loss)
    try:
        engine.step()
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def test_a_nonfinite_loss_skips_the_step_on_every_rank_when_asked():
    """Config(nonfinite="skip"): rank 1's NaN loss at step 2 and rank 0's NaN gradient (from a
    finite loss) at step 3 skip those updates everywhere; the other steps train as eager AdamW on
    the batches that were not skipped. Without "skip", the NaN gradient is an error on every rank."""
    ranks = run_ranks(_nan_on_one_rank, 2, timeout_s=240)
    state, batches = _problem()
    model = zoo.build("gpt-tiny")
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step, (x, y) in enumerate(batches):
        if step not in (1, 2):
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for rank, got in enumerate(ranks):
        assert (got["skipped"], got["steps"]) == (2, len(ROWS))
        assert len(got["warnings"]) == 2, got["warnings"]
        assert got["warnings"][0].startswith(f"[rank {rank}] step 2: the loss is not finite on some rank")
        assert got["warnings"][1].startswith(f"[rank {rank}] step 3: a gradient is not finite on some rank")
        assert got["error"].startswith(f"[rank {rank}] step 1: a gradient is not finite on some rank"), got["error"]
    assert_state_close(ranks[0]["state_dict"], clone_state_dict(model), "skipped NaN step")


def _nvme_ranks(rank: int, world_size: int, path: str):
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # as each of two torchrun "nodes" of one rank on one host says
    engine = fxzero.compile(zoo.build("gpt-tiny"), fxzero.Config(
        cost_model=None, offload=fxzero.Offload(optimizer=fxzero.Nvme(path=path))))
    counted = engine.store.local_ranks
    engine.close()
    return counted


def test_ranks_sharing_a_disk_are_counted_by_host_not_by_the_launchers_local_world(tmp_path):
    """The NVMe space check reserves room for every rank of this machine: two ranks on one host
    whose launchers each say LOCAL_WORLD_SIZE=1 still share the disk."""
    assert run_ranks(_nvme_ranks, 2, str(tmp_path), timeout_s=120) == [2, 2]

"""fxzero on the torch versions it supports (2.11 to 2.13), here where only 2.13 is installed.

torch 2.13 added `dist.all_gather_single` and `dist.reduce_scatter_single`; 2.11 and 2.12, which
the GPU machines this project is checked on run, have only `all_gather_into_tensor` and
`reduce_scatter_tensor`. `fxzero/_compat.py` takes whichever the running torch has. Each rank
hides the newer two, as 2.11 lacks them, and trains a GPT at ZeRO-3 on 2 ranks over gloo (the
process group, which a GPU run's NCCL takes the place of): the losses and the trained
parameters equal those of the same run with them, bit for bit, and the collectives were the
older ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero import zoo
from tests.dist.harness import run_ranks, train
from tests.dist.reference import lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(300)

WORLD = 2
STEPS = 3


def _run(rank: int, world_size: int, batches) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = zoo.build("gpt-tiny", n_blocks=2)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, seed=0, transport="process_group"))
    losses = train(engine, batches, lm_loss, rank, world_size)
    return losses, engine.full_state_dict(), engine.comm_report()


def _ranks(rank: int, world_size: int, batches) -> dict:
    newer = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    older = {"all_gather_into_tensor": dist.all_gather_into_tensor, "reduce_scatter_tensor": dist.reduce_scatter_tensor}
    calls = {name: 0 for name in older}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return older[name](*args, **kwargs)
        return call

    for name in newer:
        delattr(dist, name)  # as torch 2.11 is
    for name in older:
        setattr(dist, name, counting(name))
    try:
        as_211 = _run(rank, world_size, batches)
    finally:
        for name, fn in {**newer, **older}.items():
            setattr(dist, name, fn)
    as_213 = _run(rank, world_size, batches)
    return {"as_211": as_211, "as_213": as_213, "calls": calls}


def test_collectives_fall_back_to_the_names_torch_2_11_has():
    batches = make_gpt_batches(zoo.GPT_SIZES["tiny"], STEPS, 4, seed=3)
    results = run_ranks(_ranks, WORLD, batches)
    for r in results:
        losses, state, traffic = r["as_211"]
        losses13, state13, traffic13 = r["as_213"]
        assert losses == losses13
        assert state.keys() == state13.keys()
        assert all(torch.equal(state[k], state13[k]) for k in state)
        assert traffic == traffic13
        # (full_state_dict's gathers are not the step's traffic: more calls than counted)
        assert r["calls"]["all_gather_into_tensor"] >= traffic["all_gather"]["calls"] > 0
        assert r["calls"]["reduce_scatter_tensor"] == traffic["reduce_scatter"]["calls"] > 0

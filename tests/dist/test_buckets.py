"""Bucketing on 2 gloo ranks: merged units train exactly like separate ones, with fewer calls.

The engine pins `cost_model=None` (native reduce-scatters), so no timing measurement decides
how the buckets are reduced.
"""

from __future__ import annotations

import functools

import torch

import fxzero
from fxzero import zoo
from fxzero.units import bucket_units, plan_units
from tests.dist.harness import ADAMW, run_ranks, train
from tests.dist.reference import eager_gpt_reference, lm_loss, make_gpt_batches


def _gpt():
    return zoo.build("gpt-tiny")


@functools.cache
def _initial():
    torch.manual_seed(0)
    return _gpt().state_dict()


def _block_bytes() -> int:
    with torch.device("meta"):
        layouts = plan_units(_gpt(), fxzero.UnitsPolicy(), 2)
    return max(u.numel * u.itemsize for u in layouts if u.name.startswith("blocks."))


def _train(rank: int, world_size: int, max_bytes: int, batches, initial):
    with torch.device("meta"):
        model = _gpt()
    config = fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW), bucket=fxzero.Bucket(max_bytes=max_bytes),
                           cost_model=None)
    engine = fxzero.compile(model, config, state_dict=initial)
    losses = train(engine, batches, lm_loss, rank, world_size, mean_over_ranks=True)
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "units": [u.name for u in engine.layouts],
        "comm": engine.comm_report(),
    }


def test_bucketed_units_train_like_eager_with_fewer_collectives():
    batches = make_gpt_batches(zoo.GPT_SIZES["tiny"], steps=3, global_batch=8, seed=7)
    # Two blocks per bucket; the (smaller) root joins block 0, the tail (final norm) block 3.
    max_bytes = 2 * _block_bytes() + 1
    ranks = run_ranks(_train, 2, max_bytes, batches, _initial(), timeout_s=300)
    got = ranks[0]
    assert got["units"] == ["root+blocks.0", "blocks.1+blocks.2", "blocks.3+root:tail"], got["units"]
    ref = eager_gpt_reference(_gpt, _initial(), batches, ADAMW)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for key, want in ref["state_dict"].items():
        torch.testing.assert_close(got["state"][key], want, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    # 3 buckets instead of 6 units: 3 reduce-scatters per step instead of 6.
    assert got["comm"]["reduce_scatter"]["calls"] == 3 * len(batches)


def test_bucket_units_keeps_order_and_kind():
    with torch.device("meta"):
        model = _gpt()
        model.blocks[2].requires_grad_(False)
        layouts = plan_units(model, fxzero.UnitsPolicy(), 2)
    merged = bucket_units(layouts, max_bytes=10**9)
    # A frozen unit ends a run of trained ones: buckets are wholly trained or wholly frozen.
    assert [u.name for u in merged] == ["root+blocks.0+blocks.1", "blocks.2:frozen", "blocks.3+root:tail"]
    fqns = [s.fqn for u in layouts for s in u.slots]
    assert [s.fqn for u in merged for s in u.slots] == fqns, "parameters keep their order"
    for u in merged:
        assert sum(s.numel for s in u.slots) == u.numel
        offsets = [s.offset for s in u.slots]
        assert offsets == sorted(offsets) and offsets[0] == 0
    assert bucket_units(layouts, max_bytes=1) == layouts, "nothing is small enough to merge"

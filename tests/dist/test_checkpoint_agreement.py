"""Every rank saves into one checkpoint and loads the same one, or none does (2 ranks).

A rank's tag used to be ignored on save (every shard went under rank 0's tag, silently), and on
load each rank read the checkpoint its own tag named: ranks given different tags, or reading a
`latest` another job rewrote between them, trained on mismatched states without a word. Now both
are errors on every rank before anything is written or replaced (DeepSpeed's
`checkpoint.tag_validation` "Fail", which fxzero always applies).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.runtime.checkpoint import CheckpointError
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

DS = {"train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _mismatched_tags(rank: int, world_size: int, root: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    engine, _, _, _ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=DS)

    def step() -> None:
        engine.backward(engine(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))).square().mean())
        engine.step()

    step()
    engine.save_checkpoint(root, tag="a")
    step()
    engine.save_checkpoint(root, tag="b")
    out = {}
    try:
        engine.save_checkpoint(root, tag=f"mine-{rank}")
    except CheckpointError as e:
        out["save"] = str(e)
    out["dirs"] = sorted(os.listdir(root))
    before = engine.full_state_dict()
    try:
        engine.load_checkpoint(root, tag="a" if rank == 0 else "b")
    except CheckpointError as e:
        out["load"] = str(e)
    after = engine.full_state_dict()
    out["untouched"] = list(before) == list(after) and all(torch.equal(before[k], after[k]) for k in before)
    step()  # (the engine trains on)
    path, _ = engine.load_checkpoint(root, tag="a")
    out["loaded"] = os.path.basename(path)
    return out


def test_ranks_given_different_tags_neither_save_nor_load(tmp_path):
    ranks = run_ranks(_mismatched_tags, 2, str(tmp_path), timeout_s=240)
    for rank, r in enumerate(ranks):
        assert "the ranks passed different tags (rank 0 'mine-0', rank 1 'mine-1')" in r["save"]
        assert r["save"].startswith(f"[rank {rank}]") and "nothing was written" in r["save"]
        assert r["dirs"] == ["a", "b", "latest"]  # (no temporary directory left behind)
        assert "different checkpoints to load (rank 0 'a', rank 1 'b')" in r["load"]
        assert r["untouched"] and r["loaded"] == "a"

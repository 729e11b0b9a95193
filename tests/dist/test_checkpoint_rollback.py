"""Loading a checkpoint into an engine that has trained on (a rollback after a loss spike, as
DeepSpeed users do with `load_checkpoint`), parameters and optimizer states on NVMe, 2 ranks at
ZeRO-3: the steps after the load equal the steps after the save, bit for bit.

Before, the load wrote the NVMe files directly while the write-behind still held a copy of each
unit's last written parameter shard (kept for the next forward's read): the next forward read
those copies, the values from before the load, and trained on them without a word.
"""

from __future__ import annotations

import os

import pytest
import torch

import fxzero
from tests.dist.harness import run_ranks
from tests.dist.test_module_writes import _batch, _net

pytestmark = pytest.mark.timeout(300)


def _steps(engine, rank: int, first: int, n: int) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + n):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return losses


def _run(rank: int, world_size: int, where: str, mixed: bool) -> dict:
    nvme = fxzero.Nvme(path=where)
    config = fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-2), offload=fxzero.Offload(params=nvme, optimizer=nvme),
                           mixed_precision=fxzero.MixedPrecision() if mixed else None, cost_model=None)
    engine = fxzero.compile(_net(0), config)
    _steps(engine, rank, 0, 1)
    engine.save_checkpoint(os.path.join(where, "ck"), tag="s1")
    after_save = _steps(engine, rank, 1, 2)
    engine.load_checkpoint(os.path.join(where, "ck"), tag="s1")
    after_load = _steps(engine, rank, 1, 2)
    engine.close()
    return {"after_save": torch.stack(after_save), "after_load": torch.stack(after_load)}


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_steps_after_loading_into_a_trained_engine_equal_those_after_the_save(tmp_path, mixed):
    for rank, got in enumerate(run_ranks(_run, 2, str(tmp_path), mixed, timeout_s=240)):
        assert torch.equal(got["after_load"], got["after_save"]), (rank, got)

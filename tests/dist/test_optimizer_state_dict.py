"""`engine.optimizer.state_dict()` / `load_state_dict()` on 2 ranks: a torch-style save and resume
(`torch.save({"model": ..., "optimizer": optimizer.state_dict()})` on every rank, then a fresh
engine loading both) continues bit for bit as the run that was not interrupted ([Note: the
optimizer's own state dict] in `fxzero/runtime/optimizer_state.py`).

Before, the optimizer's state dict was torch's of an optimizer holding no states: no moments, no
step counts; the resume restarted AdamW from zero moments and step 1 without a word.
"""

from __future__ import annotations

import io

import pytest
import torch

import fxzero
from tests.dist.harness import run_ranks
from tests.dist.test_module_writes import _batch, _net

pytestmark = pytest.mark.timeout(300)

CASES = {
    "stage1-fp32": dict(stage=1),
    "stage2-bf16": dict(stage=2, mixed_precision=fxzero.MixedPrecision()),
    "stage3-fp32": dict(stage=3),
    "stage3-fp16-nvme": dict(stage=3, mixed_precision=fxzero.MixedPrecision(param_dtype=torch.float16),
                             offload="nvme"),
}


def _config(case: str, where: str) -> fxzero.Config:
    options = dict(CASES[case])
    if options.pop("offload", None):
        options["offload"] = fxzero.Offload(optimizer=fxzero.Nvme(path=where))
    return fxzero.Config(optimizer=fxzero.AdamW(lr=1e-2, weight_decay=0.1), cost_model=None, **options)


def _steps(engine, rank: int, steps: range) -> torch.Tensor:
    losses = []
    for step in steps:
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def _run(rank: int, world_size: int, case: str, where: str) -> dict:
    config = _config(case, where)
    engine = fxzero.compile(_net(0), config)
    _steps(engine, rank, range(3))
    engine.optimizer.param_groups[0]["lr"] = 5e-3  # (a hyperparameter the resume must take back too)
    saved = io.BytesIO()
    torch.save({"model": engine.full_state_dict(), "optimizer": engine.optimizer.state_dict()}, saved)
    want = _steps(engine, rank, range(3, 6))
    model = _net(0)
    resumed = fxzero.compile(model, config)
    saved.seek(0)
    checkpoint = torch.load(saved)
    model.load_state_dict(checkpoint["model"])
    resumed.optimizer.load_state_dict(checkpoint["optimizer"])
    got = _steps(resumed, rank, range(3, 6))
    out = {"want": want, "got": got, "state": resumed.full_state_dict(), "reference": engine.full_state_dict()}
    other = [None]
    if world_size > 1:  # (every rank's dict on every rank: rank 0 tries rank 1's)
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, checkpoint["optimizer"])
        other = gathered[1 - rank]
        resumed.optimizer.load_state_dict(gathered)  # (every rank's, as DeepSpeed's load_state_dict takes them)
        loaded, mine = resumed.optimizer.state_dict()["state"], checkpoint["optimizer"]["state"]
        out["list_is_mine"] = all(loaded[u]["step"] == mine[u]["step"] and all(
            torch.equal(loaded[u][k], v) for k, v in mine[u].items() if k != "step") for u in mine)
    for name, wrong in (("other_rank", other),
                        ("torch", torch.optim.AdamW(_net(0).parameters()).state_dict())):
        try:
            resumed.optimizer.load_state_dict(wrong)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    engine.close()
    resumed.close()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_torch_style_resume_continues_as_the_uninterrupted_run(case, tmp_path):
    for rank, got in enumerate(run_ranks(_run, 2, case, str(tmp_path), timeout_s=240)):
        assert torch.equal(got["got"], got["want"]), (rank, got["got"], got["want"])
        for key, value in got["reference"].items():
            assert torch.equal(got["state"][key], value), (rank, key)
        assert "another rank's or another run's shards (rank: saved" in got["other_rank"], got["other_rank"]
        assert "engine.load_checkpoint" in got["other_rank"]
        assert "not a state dict fxzero's optimizer.state_dict() gave" in got["torch"], got["torch"]
        assert got["list_is_mine"], rank  # (a list of every rank's dicts gave this rank's)

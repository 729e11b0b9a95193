"""Checkpoints on real ranks: exact resume, resume on other world sizes and stages, and a rank
killed in the middle of a save. The tiny GPT, trained through `fxzero.initialize`'s data loader
(so its position is part of what resumes), AdamW under a warmup schedule, cost model pinned.

One module fixture runs the whole story in a few spawns, in order: 2 ranks train 10 steps, and
train 5 and save, for each configuration (fp32 on the device, fp32 with parameters and optimizer
on NVMe, bfloat16); 4 ranks resume the fp32 checkpoint and save their own; three runs resume and
are killed (kill -9) at a different point of their next save; then fresh 2-rank processes resume
every checkpoint and train the remaining steps.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

import fxzero
from fxzero import zoo
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.reference import assert_losses_close

pytestmark = pytest.mark.timeout(600)

STEPS, SPLIT, GLOBAL_BATCH = 10, 5, 8
CFG = zoo.GPT_SIZES["tiny"]


def _dataset():
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randint(0, CFG.vocab_size, (STEPS * GLOBAL_BATCH, CFG.seq_len + 1),
                                                        generator=g))


def _engine(world_size: int, kind: str, nvme: str = ""):
    torch.manual_seed(0)  # every rank builds the same model (rank 0's is broadcast anyway)
    model = zoo.build("gpt-tiny")
    options = dict(stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None,
                   train_micro_batch_size_per_gpu=GLOBAL_BATCH // world_size,
                   lr_schedule=fxzero.WarmupLR(warmup_num_steps=4, warmup_type="linear"))
    if kind == "nvme":
        options["offload"] = fxzero.Offload(params=fxzero.Nvme(path=nvme), optimizer=fxzero.Nvme(path=nvme))
    elif kind == "bf16":
        options["mixed_precision"] = fxzero.MixedPrecision(param_dtype=torch.bfloat16)
    elif kind == "stage1":
        options["stage"] = 1
    engine, _, loader, _ = fxzero.initialize(model=model, config=fxzero.Config(**options), training_data=_dataset())
    return engine, loader


def _train(engine, batches, steps: int) -> list[float]:
    """`steps` steps from `batches` (the loader: a new pass; an iterator: where it is), each the
    mean over ranks of the ranks' losses."""
    losses = []
    it = iter(batches)
    for _ in range(steps):
        (tokens,) = next(it)
        loss = torch.nn.functional.cross_entropy(engine(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    if engine.world_size > 1:
        torch.distributed.all_reduce(stacked)
    return (stacked / engine.world_size).tolist()


def _first_runs(rank: int, world_size: int, root: str):
    """10 steps of each configuration, saved after the 5th (a save reads and never perturbs)."""
    out = {}
    for kind in ("fp32", "nvme", "bf16"):
        engine, loader = _engine(world_size, kind, os.path.join(root, "nvme"))
        batches = iter(loader)
        out[f"{kind}/first"] = _train(engine, batches, SPLIT)
        torch.manual_seed(100 + rank)
        torch.rand(3)  # (a generator state of this rank's own, to be restored)
        out[f"{kind}/rng"] = torch.get_rng_state()
        engine.save_checkpoint(os.path.join(root, kind), client_state={"note": kind, "rank": rank})
        if kind != "nvme":  # (NVMe computes what the device does: its resume is held to the fp32 run)
            out[f"{kind}/continuous"] = out[f"{kind}/first"] + _train(engine, batches, STEPS - SPLIT)
        engine.close()
    return out


def _four_ranks(rank: int, world_size: int, root: str):
    engine, loader = _engine(world_size, "fp32")
    first = _train(engine, loader, SPLIT)
    engine.save_checkpoint(os.path.join(root, "four"))
    path, client = engine.load_checkpoint(os.path.join(root, "fp32"))  # (one engine loads another's state whole)
    resumed = _train(engine, loader, STEPS - SPLIT)
    return {"resumed": resumed, "first": first, "client": client, "path": path}


KILL_POINTS = {
    "rank 1 while writing its shards": (1, "append", 3),
    "rank 0 before the manifest": (0, "replace_file", 1),
    "rank 0 after the rename, before latest": (0, "replace_file", 2),
}


def _killed_save(rank: int, world_size: int, save_dir: str, point: str):
    from fxzero.runtime.checkpoint import save

    victim, what, nth = KILL_POINTS[point]
    engine, loader = _engine(world_size, "fp32")
    engine.load_checkpoint(save_dir)
    _train(engine, loader, 1)
    if rank == victim:
        calls = [0]

        def dying(original):
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)
            return call

        if what == "append":
            save.ChecksumWriter.append = dying(save.ChecksumWriter.append)
        else:
            save.replace_file = dying(save.replace_file)
    engine.save_checkpoint(save_dir)


def _resumes(rank: int, world_size: int, root: str, dirs: list[str]):
    """Fresh processes: each configuration's engine loads its checkpoints in turn and trains on."""
    out = {}
    for kind, names in (("fp32", ("fp32", "four", *dirs)), ("nvme", ("nvme",)), ("bf16", ("bf16",)),
                        ("stage1", ("stage1",))):
        engine, loader = _engine(world_size, kind, os.path.join(root, "nvme"))
        for name in names:
            path, client = engine.load_checkpoint(os.path.join(root, "fp32" if name == "stage1" else name))
            out[f"{name}/rng"] = torch.get_rng_state()
            out[f"{name}/client"] = client
            out[f"{name}/path"] = os.path.basename(path)
            out[name] = _train(engine, loader, STEPS - SPLIT)
        engine.close()
    return out


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    os.makedirs(os.path.join(root, "nvme"))
    first = run_ranks(_first_runs, 2, root, timeout_s=300)
    four = run_ranks(_four_ranks, 4, root, timeout_s=300)
    killed = {}
    for i, point in enumerate(KILL_POINTS):
        save_dir = os.path.join(root, f"killed{i}")
        shutil.copytree(os.path.join(root, "fp32"), save_dir)
        with pytest.raises(AssertionError) as failure:
            run_ranks(_killed_save, 2, save_dir, point, timeout_s=240)
        killed[f"killed{i}"] = (point, str(failure.value), sorted(os.listdir(save_dir)))
    resumed = run_ranks(_resumes, 2, root, sorted(killed), timeout_s=300)
    return {"first": first, "four": four, "killed": killed, "resumed": resumed, "root": root}


def test_resume_on_the_same_world_is_bit_identical(story):
    """10 steps == 5 steps, save, load in fresh processes, 5 steps: losses bit-identical (fp32 on
    the device, fp32 with parameters and AdamW states on NVMe, bfloat16), and each rank's RNG and
    client_state restored."""
    first, resumed = story["first"], story["resumed"][0]
    for kind in ("fp32", "nvme", "bf16"):
        reference = first[0][f"{'fp32' if kind == 'nvme' else kind}/continuous"]
        assert first[0][f"{kind}/first"] + resumed[kind] == reference, kind
    for rank in (0, 1):
        for kind in ("fp32", "nvme", "bf16"):
            assert torch.equal(story["resumed"][rank][f"{kind}/rng"], first[rank][f"{kind}/rng"])
        assert story["resumed"][rank]["fp32/client"] == {"note": "fp32", "rank": 0}  # (rank 0's, as DeepSpeed)


def test_resume_on_other_world_sizes_and_stages(story):
    """2 -> 4, 4 -> 2 and 2 -> 1 ranks, stage 3 -> stage 1: within rtol 1e-5 of the uninterrupted run."""
    reference = story["first"][0]["fp32/continuous"]
    engine, loader = _engine(1, "fp32")  # a world of one, in this process
    engine.load_checkpoint(os.path.join(story["root"], "fp32"))
    assert_losses_close(story["first"][0]["fp32/first"] + _train(engine, loader, STEPS - SPLIT), reference, "2 -> 1")
    assert_losses_close(story["first"][0]["fp32/first"] + story["four"][0]["resumed"], reference, "2 -> 4 ranks")
    assert_losses_close(story["four"][0]["first"] + story["resumed"][0]["four"], reference, "4 -> 2 ranks")
    assert_losses_close(story["first"][0]["fp32/first"] + story["resumed"][0]["stage1"], reference, "stage 3 -> 1")


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(story):
    """kill -9 at three points of a save: `latest` still names the previous checkpoint, which
    resumes with identical losses; the next save removes the uncommitted directory."""
    reference = story["first"][0]["fp32/continuous"]
    for name, (point, failure, listing) in story["killed"].items():
        assert "died" in failure or "signal" in failure or "exit" in failure, (point, failure)
        with open(os.path.join(story["root"], name, "latest")) as f:
            assert f.read() == f"global_step{SPLIT}", point
        assert story["resumed"][0][f"{name}/path"] == f"global_step{SPLIT}", point
        assert story["first"][0]["fp32/first"] + story["resumed"][0][name] == reference, point
    listings = {point: listing for point, _, listing in story["killed"].values()}
    assert any(n.startswith(f"global_step{SPLIT + 1}.tmp-") for n in listings["rank 1 while writing its shards"])
    assert f"global_step{SPLIT + 1}" in listings["rank 0 after the rename, before latest"]

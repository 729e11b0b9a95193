"""Checkpoints in a world of one: the chunk boxes, torch's own tools reading the format, and every
way a save or a load can go wrong (a damaged file, another model, a full disk, a save between
accumulation boundaries). Multi-rank resume and kill -9 are in tests/dist/test_checkpoint.py.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import warnings

import pytest
import torch

import fxzero
from fxzero import zoo
from fxzero.runtime.checkpoint import CheckpointError, save
from fxzero.runtime.checkpoint.chunks import box_range, flat_boxes
from tests.dist.reference import lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(120)


def test_flat_boxes_are_the_range_cut_into_contiguous_boxes():
    for shape in [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)]:
        numel = math.prod(shape)
        for lo, hi in itertools.combinations(range(numel + 1), 2):
            boxes = flat_boxes(shape, lo, hi)
            assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1)
            covered = torch.zeros(numel, dtype=torch.int64)
            for offsets, sizes in boxes:
                view = covered.view(shape) if shape else covered.view(())
                for dim, (o, s) in enumerate(zip(offsets, sizes)):
                    view = view.narrow(dim, o, s)
                view += 1
                start, end = box_range(shape, offsets, sizes)
                assert covered[start:end].min() >= 1 and end - start == math.prod(sizes)
            want = torch.zeros(numel, dtype=torch.int64)
            want[lo:hi] = 1
            assert torch.equal(covered, want), (shape, lo, hi, boxes)
    assert box_range((4, 6), (0, 2), (2, 3)) is None  # a column block is not one flat range


def _engine(**options):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny", **options.pop("model", {}))
    torch.manual_seed(0)
    state = zoo.build("gpt-tiny").state_dict() if not options.pop("fresh", False) else None
    config = fxzero.Config(**{"stage": 3, "optimizer": fxzero.AdamW(lr=1e-3), "cost_model": None, **options})
    return fxzero.compile(model, config, state_dict=state)


def _train(engine, steps: int, seed: int = 5) -> list[float]:
    losses = []
    for x, y in make_gpt_batches(zoo.GPT_SIZES["tiny"], steps, 2, seed=seed):
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A world-of-one checkpoint after 2 steps, and the engine's full state then."""
    save_dir = str(tmp_path_factory.mktemp("saved"))
    engine = _engine()
    _train(engine, 2)
    path = engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    return save_dir, path, engine.full_state_dict(), {k: v.clone() for k, v in engine.state.optimizer_states["blocks.0"].items()}


def test_torch_tools_read_the_checkpoint(saved, tmp_path):
    """dcp_to_torch_save and dcp.load read it: the model's FQNs, fp32 masters, AdamW states by FQN."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, path, full, _ = saved
    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)  # (tensors and plain data only)
    assert set(full) - set(whole["model"]) == {"lm_head.weight"}  # tied to wte.weight: saved once, as HF does
    for fqn, value in whole["model"].items():
        assert torch.equal(full[fqn], value), fqn
    state = whole["optim"]["state"]["blocks.0.attn.qkv.weight"]
    assert set(state) == {"exp_avg", "exp_avg_sq", "step"} and float(state["step"]) == 2.0
    assert whole["optim"]["param_groups"][0]["lr"] == 1e-3
    target = {"model": {fqn: torch.empty_like(v) for fqn, v in full.items() if fqn != "lm_head.weight"}}
    dcp.load(target, checkpoint_id=path)
    assert all(torch.equal(v, full[k]) for k, v in target["model"].items())


def test_load_returns_client_state_and_resumes(saved):
    save_dir, path, full, states = saved
    engine = _engine()
    assert engine.load_checkpoint(save_dir) == (path, {"epoch": 3})
    assert all(torch.equal(v, full[k]) for k, v in engine.full_state_dict().items())
    assert engine.global_steps == 2 and engine.state.steps["blocks.0"] == 2
    for kind, value in states.items():
        assert torch.equal(engine.state.optimizer_states["blocks.0"][kind], value)


def _copy(saved, tmp_path) -> str:
    import shutil

    shutil.copytree(saved[0], tmp_path / "copy")
    return str(tmp_path / "copy")


def test_a_truncated_or_changed_file_is_an_error_naming_it(saved, tmp_path):
    save_dir = _copy(saved, tmp_path)
    data = os.path.join(save_dir, "global_step2", "__0_0.distcp")
    with open(data, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*does not match its checksum"):
        engine.load_checkpoint(save_dir)
    with pytest.raises(RuntimeError, match="partly replaced"):  # a load that failed part-way leaves no engine to train
        engine(torch.zeros(1, 8, dtype=torch.long))
    os.truncate(data, os.path.getsize(data) - 10)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: .* bytes, the manifest says .*truncated"):
        _engine().load_checkpoint(save_dir)
    os.remove(os.path.join(save_dir, "global_step2", "fxzero.json"))
    with pytest.raises(CheckpointError, match=r"fxzero\.json: missing"):
        _engine().load_checkpoint(save_dir)


def test_a_checkpoint_of_another_model_is_an_error(saved):
    with pytest.raises(CheckpointError, match=r"fxzero\.json: a checkpoint of another model.*lacks"):
        _engine(model={"n_blocks": 3}).load_checkpoint(saved[0])
    with pytest.raises(CheckpointError, match=r"AdamW's states .* load_optimizer_states=False"):
        _engine(optimizer=fxzero.Adagrad(lr=1e-2)).load_checkpoint(saved[0])
    engine = _engine(optimizer=fxzero.Adagrad(lr=1e-2))
    engine.load_checkpoint(saved[0], load_optimizer_states=False)
    assert engine.global_steps == 2


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    save_dir = _copy(saved, tmp_path)
    engine = _engine()
    engine.load_checkpoint(save_dir)
    _train(engine, 1, seed=9)
    written = [0]
    append = save.ChecksumWriter.append

    def filling(self, blob):
        written[0] += 1
        if written[0] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return append(self, blob)

    monkeypatch.setattr(save.ChecksumWriter, "append", filling)
    with pytest.raises(CheckpointError, match=r"filled while writing checkpoint 'global_step3'.*previous checkpoint"):
        engine.save_checkpoint(save_dir)
    assert sorted(os.listdir(save_dir)) == ["global_step2", "latest"]  # the temporary directory is gone
    assert _engine().load_checkpoint(save_dir)[0].endswith("global_step2")
    monkeypatch.setattr(save.shutil, "disk_usage", lambda path: type("u", (), {"free": 1000})())
    with pytest.raises(CheckpointError, match=r"not enough room .* bytes needed, 1000 free"):
        engine.save_checkpoint(save_dir)
    assert sorted(os.listdir(save_dir)) == ["global_step2", "latest"]


def test_leftovers_and_a_repeated_tag(saved, tmp_path):
    save_dir = _copy(saved, tmp_path)
    os.makedirs(os.path.join(save_dir, "global_step9.tmp-deadbeef"))
    engine = _engine()
    engine.load_checkpoint(save_dir)
    with pytest.warns(UserWarning, match="uncommitted checkpoint"):
        engine.save_checkpoint(save_dir, tag="global_step2")  # the same tag again: replaced whole
    assert sorted(os.listdir(save_dir)) == ["global_step2", "latest"]
    assert _engine().load_checkpoint(save_dir)[1] == {}
    # Killed between moving the previous checkpoint of a tag aside and renaming the new one in:
    # `latest` names the tag, and the one moved aside is what it resolves to.
    os.rename(os.path.join(save_dir, "global_step2"), os.path.join(save_dir, "global_step2.old-0123abcd"))
    assert _engine().load_checkpoint(save_dir)[0].endswith("global_step2.old-0123abcd")


def test_save_after_an_odd_number_of_updates_with_the_boundary_set_by_the_caller(tmp_path):
    """accelerate sets the boundary before every backward and calls step() at boundaries only, so
    the engine's count of step() calls is the updates', not the accumulation's position: after 3
    updates of 2 micro-batches each the count is odd and nothing is pending (the check read the
    count and refused the save; accelerate's save_state after an odd number of updates stopped)."""
    engine = _engine(gradient_accumulation_steps=2)
    batches = make_gpt_batches(zoo.GPT_SIZES["tiny"], 6, 2, seed=1)
    for i, (x, y) in enumerate(batches):
        engine.set_gradient_accumulation_boundary(i % 2 == 1)
        engine.backward(lm_loss(engine(x), y))
        if i % 2 == 1:
            engine.step()
        if i == 2:  # (a backward of the next accumulation: its gradients wait for the boundary)
            with pytest.raises(CheckpointError, match=r"a backward not yet followed by the boundary's step\(\)"):
                engine.save_checkpoint(str(tmp_path))
    assert engine.global_steps == 3
    engine.save_checkpoint(str(tmp_path))
    assert os.path.isdir(tmp_path / "global_step3")
    # Resumed by a loop that lets the engine count (step() after every backward): a checkpoint is
    # saved at a boundary, so the next update comes after a whole accumulation, as in DeepSpeed
    # (whose count starts again at 0), not after the one micro-batch the odd count would leave.
    resumed = _engine(gradient_accumulation_steps=2)
    resumed.load_checkpoint(str(tmp_path))
    for i, (x, y) in enumerate(make_gpt_batches(zoo.GPT_SIZES["tiny"], 2, 2, seed=2)):
        resumed.backward(lm_loss(resumed(x), y))
        resumed.step()
        assert resumed.global_steps == 3 + i, "an update after one micro-batch of an accumulation of 2"


def test_save_between_boundaries_and_bad_tags_are_errors(tmp_path):
    engine = _engine(gradient_accumulation_steps=2)
    x, y = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, 2, seed=1)[0]
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    with pytest.raises(CheckpointError, match="micro-step 1 of an accumulation of 2"):
        engine.save_checkpoint(str(tmp_path))
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    with pytest.raises(CheckpointError, match="a tag names one directory"):
        engine.save_checkpoint(str(tmp_path), tag="a/b")
    assert os.listdir(tmp_path) == []
    with pytest.warns(UserWarning, match=r"no .*latest file, so no checkpoint was loaded"):
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        engine.load_checkpoint(str(tmp_path), tag="nope")


# float16: the loss scaler resumes where it was ------------------------------------------------

FP16_STEPS = 10
OVERFLOWS = {0, 1, 7, 8}
"""Steps whose loss is made infinite. With hysteresis 2 and window 3 the scale (from 16) has one
overflow left after step 0 and halves at step 1; the good steps 2-6 double it once (after 3 or
4 of them: DeepSpeed counts the first good step after an overflow as 0); step 7 leaves one
overflow and step 8 halves it. Saved after step 2 (scale 8, one good step counted) the growth to
come tests the scale and the count of good steps; saved after step 7 (one overflow left, where
a fresh scaler has 2) the halving at step 8 tests the hysteresis."""
SAVED_AFTER = (2, 7)


def _fp16_engine():
    from fxzero.config.effects import SlowSetting

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    policy = fxzero.LossScale(initial_scale_power=4, hysteresis=2, window=3)
    config = fxzero.Config(optimizer=fxzero.AdamW(lr=1e-2), cost_model=None,
                           mixed_precision=fxzero.MixedPrecision(param_dtype=torch.float16, loss_scale=policy))
    with warnings.catch_warnings():  # (float16 matmuls are slow on a CPU: said once per process)
        warnings.simplefilter("ignore", SlowSetting)
        return fxzero.compile(model, config)


def _fp16_steps(engine, first: int, save_dir: str | None = None) -> tuple[list[tuple], dict]:
    """Steps first..FP16_STEPS-1: each step's (loss, loss scale, skipped steps); with `save_dir`,
    a checkpoint after each step of SAVED_AFTER and the scaler's state then."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(FP16_STEPS)]
    out, scalers = [], {}
    for i in range(first, FP16_STEPS):
        x, y = batches[i]
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss * float("inf") if i in OVERFLOWS else loss)
        engine.step()
        out.append((loss.item(), engine.loss_scale, engine.skipped_steps))
        if save_dir is not None and i in SAVED_AFTER:
            engine.save_checkpoint(save_dir, tag=f"after{i}")
            scalers[i] = engine.control.scaler.state_dict()
    return out, scalers


def test_the_fp16_loss_scaler_resumes_as_an_uninterrupted_run(tmp_path):
    engine = _fp16_engine()
    uninterrupted, scalers = _fp16_steps(engine, 0, str(tmp_path))
    fresh = _fp16_engine().control.scaler.state_dict()
    scales = [scale for _, scale, _ in uninterrupted]
    # The story the docstring tells, so that a scaler not restored would show:
    assert scalers[2]["scale"] != fresh["scale"] and scalers[2]["clean"] != fresh["clean"]
    assert max(scales[3:7]) == 2 * scales[2] and uninterrupted[2][2] == 2  # a growth before the next overflow
    assert scalers[7]["hysteresis"] != fresh["hysteresis"] and scales[8] == scales[7] / 2
    final = engine.full_state_dict()
    for saved_after in SAVED_AFTER:
        resumed = _fp16_engine()
        resumed.load_checkpoint(str(tmp_path), tag=f"after{saved_after}")
        assert (resumed.loss_scale, resumed.skipped_steps) == uninterrupted[saved_after][1:]
        steps, _ = _fp16_steps(resumed, saved_after + 1)
        assert steps == uninterrupted[saved_after + 1:], f"saved after step {saved_after}"
        assert all(torch.equal(v, final[k]) for k, v in resumed.full_state_dict().items())

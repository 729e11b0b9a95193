"""An engine with offloaded states fails clearly on a bad disk, before training or at the bad read.

One process (a world of one): nvme_path missing, not writable, or on a disk too small for the
states is a ValueError from `fxzero.compile` naming the path and the bytes; a state file
truncated, changed or deleted underneath is an IOError at its next read naming the key and the
file, raised before any value from it reaches the model. A disk that fills during training is a
DiskFull error at the failed write's next wait, and the state it lost is never read as zeros.
"""

from __future__ import annotations

import errno
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import fxzero
from fxzero import zoo
from fxzero.runtime.storage.aligned import ALIGN


def _nvme_config(path, write_behind_bytes: int = 0, **kw) -> fxzero.Config:
    # Write-behind off by default here: reads then always come from the files these tests damage.
    # Small blocks: every shard spans several, so damage past the first block is seen too.
    place = fxzero.Nvme(path=str(path), write_behind_bytes=write_behind_bytes, block_bytes=4096)
    return fxzero.Config(offload=fxzero.Offload(params=place, optimizer=place, **kw), cost_model=None)


def _engine(config: fxzero.Config):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    return fxzero.compile(model, config), model.example_inputs()


def _train_step(engine, inputs) -> float:
    logits = engine(*inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), inputs[0].flatten())
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_missing_nvme_path(tmp_path):
    with pytest.raises(ValueError, match=r"\[rank 0\] Nvme\(path=.*nope.*\): no such directory; create it"):
        _engine(_nvme_config(tmp_path / "nope"))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a filesystem where no one can create directories")
def test_unwritable_nvme_path():
    # /proc refuses new directories even to root (which chmod would not stop).
    with pytest.raises(ValueError, match=r"\[rank 0\] Nvme\(path='/proc'\).*(cannot create|not writable)"):
        _engine(_nvme_config("/proc"))


def test_disk_too_small_is_refused_before_training(tmp_path, monkeypatch):
    real = shutil.disk_usage

    def tiny(path):
        return real(path)._replace(free=100_000)

    monkeypatch.setattr(shutil, "disk_usage", tiny)
    with pytest.raises(ValueError) as info:
        _engine(_nvme_config(tmp_path))
    msg = str(info.value)
    assert "[rank 0] not enough room" in msg and "only 100000 free" in msg, msg
    # gpt-tiny: parameters, gradients and both moments of 54,080 fp32 parameters in 5 units,
    # each file a 4096-byte header plus data padded to 4096.
    needed = int(re.search(r"(\d+) bytes needed", msg).group(1))
    assert needed > 4 * 54_080 * 4, msg
    assert os.listdir(tmp_path) == [], "nothing may be written when the states do not fit"


@pytest.mark.parametrize("how", ["truncate", "flip", "flip_last", "delete"])
def test_state_changed_underneath_is_detected(tmp_path, how):
    engine, inputs = _engine(_nvme_config(tmp_path))
    _train_step(engine, inputs)
    steps_before = dict(engine.state.steps)
    (rank_dir,) = os.listdir(tmp_path)
    victim = os.path.join(tmp_path, rank_dir, "param%2Fblocks.1.fxz")
    assert os.path.exists(victim), os.listdir(os.path.join(tmp_path, rank_dir))
    if how == "truncate":
        os.truncate(victim, os.path.getsize(victim) - ALIGN)
    elif how in ("flip", "flip_last"):
        # The first block's sixth byte, or the last byte of data (the file's last block).
        nbytes = engine.store.tier("param").nbytes("param/blocks.1")
        where = ALIGN + (5 if how == "flip" else nbytes - 1)
        with open(victim, "r+b") as f:
            f.seek(where)
            b = f.read(1)
            f.seek(where)
            f.write(bytes([b[0] ^ 0x01]))
    else:
        os.unlink(victim)
    expected = {"truncate": "expected .* bytes on disk", "flip": "checksum mismatch", "flip_last": "checksum mismatch",
                "delete": "file is missing"}[how]
    with pytest.raises(IOError, match=rf"NvmeTier key 'param/blocks.1', file .*: {expected}"):
        _train_step(engine, inputs)
    # The bad read stopped the forward: no unit took another optimizer step.
    assert dict(engine.state.steps) == steps_before == {
        unit: 1 for unit in steps_before
    }
    engine.close()


def test_with_write_behind_a_changed_file_is_caught_at_its_next_read_from_disk(tmp_path):
    # The next forward reads blocks.1's shard from the copy in memory (what the file should
    # hold); the file itself is read, and found changed, before any value from it is used.
    engine, inputs = _engine(_nvme_config(tmp_path, write_behind_bytes=64 << 20))
    _train_step(engine, inputs)
    engine.store.drain()
    (rank_dir,) = os.listdir(tmp_path)
    victim = os.path.join(tmp_path, rank_dir, "param%2Fblocks.1.fxz")
    with open(victim, "r+b") as f:
        f.seek(ALIGN + 5)
        b = f.read(1)
        f.seek(ALIGN + 5)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(IOError, match=r"NvmeTier key 'param/blocks.1', file .*: checksum mismatch"):
        for _ in range(3):
            _train_step(engine, inputs)
    assert engine.store.report()["nvme"]["write_behind_hits"] > 0
    engine.close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds the file a write goes to in /proc/self/fd")
@pytest.mark.parametrize("write_behind_bytes", [0, 64 << 20], ids=["direct_writes", "write_behind"])
def test_disk_full_mid_training_is_an_error_and_never_a_zeroed_state(tmp_path, monkeypatch, write_behind_bytes):
    """The disk fills after the start-up check: writing exp_avg/blocks.3 fails with ENOSPC in an
    I/O worker. step() raises DiskFull naming the path, key, bytes and the way out; once the space is
    back, the lost moment is still an error, never read back as zeros or as its old value."""
    from fxzero.runtime.storage.nvme import DiskFull

    config = fxzero.Config(cost_model=None, offload=fxzero.Offload(
        optimizer=fxzero.Nvme(path=str(tmp_path), write_behind_bytes=write_behind_bytes)))
    engine, inputs = _engine(config)
    _train_step(engine, inputs)
    real = os.pwrite

    def pwrite(fd, buf, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("exp_avg%2Fblocks.3.fxz"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(DiskFull) as info:
        _train_step(engine, inputs)
        engine.store.drain()  # with write-behind the error may come at the next store call
    msg = str(info.value)
    assert re.fullmatch(r"\[rank 0\] NvmeTier '.*fxzero-rank0-\d+': the disk is full \(No space left on device\): "
                        r"writing key 'exp_avg/blocks.3' \(50432 bytes, 57344 on disk\) failed, and \d+ bytes are "
                        r"free there now .*Free space on that filesystem, or point Nvme\(path=\.\.\.\) at a disk "
                        r"with room, and restart from the last checkpoint", msg), msg
    monkeypatch.undo()  # the space is back
    stepped = engine.state.steps["blocks.3"]
    with pytest.raises(OSError, match=r"\[rank 0\] NvmeTier .*'exp_avg/blocks.3'"):
        _train_step(engine, inputs)
    assert engine.state.steps["blocks.3"] == stepped  # it never stepped on a zeroed moment
    engine.close()
    assert os.listdir(tmp_path) == []


def test_close_removes_files(tmp_path):
    engine, inputs = _engine(_nvme_config(tmp_path))
    _train_step(engine, inputs)
    assert len(os.listdir(tmp_path)) == 1
    engine.close()
    assert os.listdir(tmp_path) == []


def test_params_offload_needs_stage3(tmp_path):
    with pytest.raises(ValueError, match="needs stage=3"):
        fxzero.Config(stage=2, offload=fxzero.Offload(params=fxzero.Cpu()))


def test_deepspeed_offload_keys(tmp_path):
    ds = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        }
    }
    cfg = fxzero.Config.from_deepspeed(ds)
    assert cfg.offload.params == fxzero.Nvme(path=str(tmp_path), threads=5)
    assert cfg.offload.optimizer == fxzero.Cpu(pin_memory=True)
    assert cfg.offload.grads_placement == fxzero.Cpu(pin_memory=True)
    with pytest.raises(ValueError, match='needs "nvme_path"'):
        fxzero.Config.from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(ValueError, match='must be "none", "cpu" or "nvme"'):
        fxzero.Config.from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})


def test_checkpoint_on_disk_materializes_into_the_tier(tmp_path):
    """A checkpoint opened with mmap=True is read parameter by parameter into the NVMe tier."""
    torch.manual_seed(3)
    eager = zoo.build("gpt-tiny")
    path = tmp_path / "ckpt.pt"
    torch.save(eager.state_dict(), path)
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    engine = fxzero.compile(model, _nvme_config(nvme_dir), state_dict=torch.load(path, mmap=True))
    assert engine.memory_report()["param_shards"] == 0
    got = engine.full_state_dict()
    for key, want in eager.state_dict().items():
        assert torch.equal(got[key], want), key
    engine.close()


@pytest.mark.timeout(120)
def test_a_killed_ranks_nvme_folder_is_removed_at_the_next_start(tmp_path):
    """kill -9 leaves the rank's folder; the next engine on that disk removes it, and only it."""
    import json
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, sys, torch, fxzero
        from fxzero import zoo
        engine = fxzero.compile(zoo.build("gpt-tiny"), fxzero.Config(cost_model=None,
            offload=fxzero.Offload(optimizer=fxzero.Nvme(path={str(tmp_path)!r}))))
        x = torch.randint(0, 96, (2, 16))
        engine.backward(engine(x).sum()); engine.step()
        print("ready", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        (left,) = os.listdir(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.listdir(tmp_path) == [left]  # killed: nothing removed it
    from fxzero.runtime.storage.offload_store import _host

    alive = tmp_path / f"fxzero-rank3-{os.getpid()}"  # this test's own process: alive, never removed
    alive.mkdir()
    (alive / "owner.json").write_text(json.dumps({"host": _host(), "pid": os.getpid()}))
    foreign = tmp_path / "fxzero-rank1-1"
    foreign.mkdir()
    (foreign / "owner.json").write_text(json.dumps({"host": "another-host/boot", "pid": 1}))
    with pytest.warns(UserWarning, match=rf"removed .*{left} \(\d+ bytes\): the offloaded states of process "
                                         rf"{proc.pid}, which is no longer running"):
        engine, _ = _engine(_nvme_config(tmp_path))
    kept = sorted(os.listdir(tmp_path))
    assert left not in kept and alive.name in kept and foreign.name in kept  # only the dead local one
    engine.close()


def test_deepspeeds_usual_config_one_nvme_path_for_params_and_optimizer(tmp_path):
    """DeepSpeed configs point offload_param and offload_optimizer at one nvme_path with other
    buffer counts: two placements on one disk, each with a directory of its own (the second was a
    'File exists' error), both removed at close."""
    section = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = fxzero.Config.from_deepspeed({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {**section, "buffer_count": 5},
                              "offload_optimizer": {**section, "buffer_count": 4}}})
    params, optimizer = config.offload.params, config.offload.optimizer
    assert params != optimizer and params.path == optimizer.path
    engine, inputs = _engine(config)
    assert len(os.listdir(tmp_path)) == 2
    assert _train_step(engine, inputs) > 0
    engine.close()
    assert os.listdir(tmp_path) == []


def test_two_engines_of_one_process_on_one_nvme_path(tmp_path):
    """Two engines alive in one process on one nvme_path (DeepSpeed-Chat's actor and critic, or
    initialize run twice in a notebook) each get directories of their own: the second was a
    'File exists' error telling the user to choose another directory. Each trains and removes
    only its own at close."""
    section = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = fxzero.Config.from_deepspeed({
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": section, "offload_optimizer": section}})
    first, inputs = _engine(config)
    first_dirs = set(os.listdir(tmp_path))
    second, _ = _engine(config)
    second_dirs = set(os.listdir(tmp_path)) - first_dirs
    assert len(first_dirs) == len(second_dirs) == 2
    assert _train_step(first, inputs) == _train_step(second, inputs) > 0
    first.close()
    assert set(os.listdir(tmp_path)) == second_dirs
    second.close()
    assert os.listdir(tmp_path) == []

"""Storage tiers: round trips, concurrency, counters, integrity and the errors before use."""

import errno
import os
import shutil
import threading

import pytest
import torch

from fxzero.runtime.storage import nvme as nvme_module
from fxzero.runtime.storage.aligned import ALIGN, aligned_buffer
from fxzero.runtime.storage.memory import CpuTier, DeviceTier
from fxzero.runtime.storage.nvme import NvmeTier

# Sizes around the alignment and the staging block (block_bytes=8192 below): empty, one element,
# not a multiple of 4096, exactly one block, and several blocks with a ragged tail.
SIZES = [0, 1, 1000, 1023, 2048, 5000, 3 * 4096 + 7]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def _tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 100, (numel,), generator=g).to(dtype)


def _tiers(tmp_path, **nvme):
    return {
        "device": DeviceTier(),
        "cpu": CpuTier(),
        "nvme": NvmeTier(tmp_path, threads=4, block_bytes=8192, **nvme),
    }


@pytest.fixture
def nvme(tmp_path):
    with NvmeTier(tmp_path, threads=4, block_bytes=8192) as tier:
        yield tier


def _corrupt(tier: NvmeTier, key: str, how: str) -> None:
    path = tier.file(key)
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) - ALIGN)
    elif how in ("flip", "flip_last"):
        # A byte of the first block, or the very last byte of data (in the last block).
        where = ALIGN + (17 if how == "flip" else tier.nbytes(key) - 1)
        with open(path, "r+b") as f:
            f.seek(where)
            b = f.read(1)
            f.seek(where)
            f.write(bytes([b[0] ^ 0x40]))
    elif how == "delete":
        os.unlink(path)


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["device", "cpu", "nvme"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip(tmp_path, which, dtype):
    tier = _tiers(tmp_path)[which]
    try:
        for i, numel in enumerate(SIZES):
            x = _tensor(numel, dtype, seed=i)
            key = f"optim/blocks.{i}/exp_avg"
            assert tier.write(key, x).wait() is x
            assert tier.nbytes(key) == numel * x.element_size()
            got = tier.read(key).wait()
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got.cpu(), x)
            out = torch.full_like(x, 7)
            assert tier.read(key, out).wait() is out
            assert torch.equal(out, x)
    finally:
        tier.close()


@pytest.mark.parametrize("which", ["device", "cpu", "nvme"])
def test_shape_kept_overwrite_and_delete(tmp_path, which):
    tier = _tiers(tmp_path)[which]
    x = _tensor(6 * 7, torch.float32).view(6, 7)
    tier.write("w", x).wait()
    assert tier.read("w").wait().shape == (6, 7)
    y = _tensor(100, torch.bfloat16, seed=3)
    tier.write("w", y).wait()  # a key rewritten with another size and dtype
    assert torch.equal(tier.read("w").wait().cpu(), y)
    tier.delete("w")
    assert "w" not in tier
    with pytest.raises(KeyError, match="no key 'w'"):
        tier.read("w")
    if which == "nvme":
        assert not os.path.exists(tier.file("w"))
    tier.close()


def test_read_out_mismatch_is_a_value_error(nvme):
    nvme.write("k", torch.zeros(10)).wait()
    with pytest.raises(ValueError, match="out is torch.float32 with 9 elements"):
        nvme.read("k", torch.empty(9)).wait()


def test_keys_map_to_distinct_files(nvme):
    a, b = nvme.file("a/b"), nvme.file("a%2Fb")
    assert a != b and os.path.dirname(a) == nvme.path
    nvme.write("a/b", torch.ones(3)).wait()
    nvme.write("a%2Fb", torch.zeros(3)).wait()
    assert torch.equal(nvme.read("a/b").wait(), torch.ones(3))


# -- concurrency and ordering --------------------------------------------------------------------


def test_many_in_flight(tmp_path):
    with NvmeTier(tmp_path, threads=4, block_bytes=8192) as tier:
        xs = {f"p/{i}": _tensor(1000 + 997 * i, torch.float32, seed=i) for i in range(32)}
        writes = [tier.write(k, x) for k, x in xs.items()]
        # Reads issued before the writes finish still see the written value (ordering per key).
        reads = {k: tier.read(k) for k in xs}
        for w in writes:
            w.wait()
        for k, r in reads.items():
            assert torch.equal(r.wait(), xs[k])


def test_same_key_operations_run_in_order(nvme):
    pendings = []
    for i in range(10):
        pendings.append(nvme.write("k", torch.full((5000,), float(i))))
        pendings.append(nvme.read("k"))
    for i in range(10):
        pendings[2 * i].wait()
        assert torch.equal(pendings[2 * i + 1].wait(), torch.full((5000,), float(i)))


# -- counters ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["device", "cpu", "nvme"])
def test_report_counts_bytes(tmp_path, which):
    tier = _tiers(tmp_path)[which]
    x, y = _tensor(1000, torch.float32), _tensor(5000, torch.bfloat16)
    tier.write("x", x).wait()
    tier.write("y", y).wait()
    tier.read("x").wait()
    r = tier.report(reset=True)
    assert r["tier"] == which
    assert r["write"]["calls"] == 2 and r["write"]["bytes"] == 4000 + 10000
    assert r["read"]["calls"] == 1 and r["read"]["bytes"] == 4000
    assert r["write"]["seconds"] > 0 and r["write"]["GBps"] > 0
    assert tier.report()["read"] == {"calls": 0, "bytes": 0, "seconds": 0.0, "GBps": 0.0}
    tier.close()


# -- integrity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", ["auto", False])
@pytest.mark.parametrize("how,match", [
    ("truncate", r"expected \d+ bytes on disk .*got \d+"),
    ("flip", r"checksum mismatch: expected xxh3 0x[0-9a-f]{16}, got 0x[0-9a-f]{16}"),
    ("flip_last", r"checksum mismatch: expected xxh3 0x[0-9a-f]{16}, got 0x[0-9a-f]{16}"),
    ("delete", "file is missing"),
])
def test_corruption_is_detected(tmp_path, direct, how, match):
    with NvmeTier(tmp_path, block_bytes=8192, direct=direct) as tier:
        tier.write("optim/blocks.3/exp_avg", _tensor(5000, torch.float32)).wait()
        _corrupt(tier, "optim/blocks.3/exp_avg", how)
        with pytest.raises(IOError, match=match) as info:
            tier.read("optim/blocks.3/exp_avg").wait()
        msg = str(info.value)
        assert "'optim/blocks.3/exp_avg'" in msg and tier.file("optim/blocks.3/exp_avg") in msg
        assert msg.startswith("[rank 0]")


@pytest.mark.parametrize("how", ["flip", "flip_last"])
def test_without_xxhash_the_tier_checks_crc32(tmp_path, monkeypatch, how):
    """Where xxhash is not installed, the tier's files carry zlib's CRC-32: a round trip is exact
    and a flipped byte is still found."""
    import zlib

    import fxzero.runtime.storage.nvme as nvme_module

    monkeypatch.setattr(nvme_module, "_checksum", nvme_module._Crc32)
    monkeypatch.setattr(nvme_module, "CHECKSUM", "crc32")
    value = _tensor(5000, torch.float32)
    with NvmeTier(tmp_path, block_bytes=8192) as tier:
        tier.write("k", value).wait()
        assert torch.equal(tier.read("k").wait(), value)
        assert tier._record("k").checksum == zlib.crc32(value.numpy().tobytes())
        _corrupt(tier, "k", how)
        with pytest.raises(IOError, match=r"checksum mismatch: expected crc32 0x[0-9a-f]{16}, got"):
            tier.read("k").wait()


def test_rewritten_header_is_detected(nvme):
    # Same size on disk, but another key's file copied over this one: the header disagrees.
    nvme.write("a", _tensor(100, torch.float32, seed=1)).wait()
    nvme.write("b", _tensor(100, torch.float32, seed=2)).wait()
    shutil.copyfile(nvme.file("b"), nvme.file("a"))
    with pytest.raises(IOError, match="key 'a'.*header says float32, 400 bytes"):
        nvme.read("a").wait()


# -- errors before use ---------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist; create it"):
        NvmeTier(tmp_path / "nope")


def test_not_a_directory(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a directory"):
        NvmeTier(tmp_path / "f")


def test_unwritable_directory(tmp_path, monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    # The probe file is created with open() inside the module; refuse it as a read-only dir would.
    monkeypatch.setattr(nvme_module, "open", refuse, raising=False)
    with pytest.raises(ValueError, match=r"is not writable \(Permission denied\); fix its permissions"):
        NvmeTier(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_unwritable_directory_for_real(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="is not writable"):
            NvmeTier(ro)
    finally:
        ro.chmod(0o700)


def test_impossible_reserve(nvme):
    free = shutil.disk_usage(nvme.path).free
    nvme.reserve(1 << 20)
    with pytest.raises(ValueError) as info:
        nvme.reserve(free * 2 + (1 << 40))
    msg = str(info.value)
    assert nvme.path in msg and str(free * 2 + (1 << 40)) in msg and "free" in msg
    assert "larger disk" in msg


def test_memory_tier_reserve():
    CpuTier().reserve(1)
    with pytest.raises(ValueError, match="bytes needed on cpu"):
        CpuTier().reserve(1 << 60)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="block_bytes=1000"):
        NvmeTier(tmp_path, block_bytes=1000)
    with pytest.raises(ValueError, match="threads=0"):
        NvmeTier(tmp_path, threads=0)
    with pytest.raises(ValueError, match="direct='yes'"):
        NvmeTier(tmp_path, direct="yes")


# -- O_DIRECT and its fallback -------------------------------------------------------------------


def _refuse_direct(monkeypatch):
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def test_direct_false_is_buffered(tmp_path):
    with NvmeTier(tmp_path, direct=False) as tier:
        assert tier.direct is False and tier.direct_fallback is None
        x = _tensor(5000, torch.bfloat16)
        tier.write("k", x).wait()
        assert torch.equal(tier.read("k").wait(), x)
        assert tier.report()["direct"] is False


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_auto_falls_back_when_filesystem_refuses(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)
    with NvmeTier(tmp_path, block_bytes=8192) as tier:
        assert tier.direct is False
        assert "O_DIRECT refused" in tier.direct_fallback and "Invalid argument" in tier.direct_fallback
        assert tier.report()["direct_fallback"] == tier.direct_fallback
        x = _tensor(3 * 4096 + 7, torch.float32)
        tier.write("k", x).wait()
        assert torch.equal(tier.read("k").wait(), x)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_direct_true_refused_is_an_error(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)
    with pytest.raises(ValueError, match="direct=True.*use direct='auto'"):
        NvmeTier(tmp_path, direct=True)


def test_files_are_padded_to_the_alignment(nvme):
    nvme.write("k", torch.zeros(1001, dtype=torch.uint8)).wait()
    assert os.path.getsize(nvme.file("k")) == ALIGN + ALIGN  # header block + one padded data block
    assert nvme.nbytes("k") == 1001


def test_auto_says_whether_direct_is_used(nvme):
    # Either O_DIRECT is on, or the reason it is not is recorded (tmpfs refuses it, ext4 takes it).
    assert nvme.direct is True and nvme.direct_fallback is None or (
        nvme.direct is False and nvme.direct_fallback)


def test_staging_buffers_are_aligned():
    buf = aligned_buffer(8192)
    assert buf.tensor.data_ptr() % ALIGN == 0 and len(buf.view) == 8192


def test_a_key_whose_write_failed_reads_as_an_error(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with NvmeTier(d, direct=False) as tier:
        tier.write("k", torch.ones(10)).wait()
        shutil.rmtree(d)  # the disk went away underneath
        with pytest.raises(FileNotFoundError):
            tier.write("k", torch.zeros(10)).wait()
        # Neither the old value nor "never written" (which the store answers with zeros).
        assert "k" in tier
        with pytest.raises(IOError, match=r"\[rank 0\] NvmeTier key 'k', .*its last write failed \(FileNotFoundError"):
            tier.read("k")


def _full_disk_after(monkeypatch, calls: int, gate=None) -> None:
    """os.pwrite succeeds `calls` times, then fails as a full disk does (after `gate` is set)."""
    real, left = os.pwrite, [calls]

    def pwrite(fd, buf, offset):
        if left[0] > 0:
            left[0] -= 1
            return real(fd, buf, offset)
        if gate is not None:
            assert gate.wait(10)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", pwrite)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [False, "auto"])
def test_disk_full_mid_write_is_a_clear_error_at_its_wait(tmp_path, monkeypatch, direct):
    """ENOSPC in an I/O worker, after the first block went to disk: DiskFull at the write's wait,
    naming the path, key and bytes and the way out; the old value is never read back."""
    with NvmeTier(tmp_path, threads=2, block_bytes=8192, direct=direct) as tier:
        key = "exp_avg/blocks.3"
        tier.write(key, torch.ones(5000)).wait()
        tier.write("exp_avg/blocks.2", torch.full((10,), 2.0)).wait()
        _full_disk_after(monkeypatch, calls=1)
        pending = tier.write(key, torch.zeros(5000))  # 20000 bytes: three 8192-byte blocks
        with pytest.raises(nvme_module.DiskFull) as info:
            pending.wait()
        msg = str(info.value)
        assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
        assert msg.startswith(f"[rank 0] NvmeTier {tier.path!r}: the disk is full (No space left on device): "
                              f"writing key 'exp_avg/blocks.3' (20000 bytes, 24576 on disk) failed"), msg
        assert "Free space on that filesystem, or point Nvme(path=...) at a disk with room" in msg, msg
        monkeypatch.undo()  # space freed: the lost value stays an error until rewritten
        lost = r"NvmeTier key 'exp_avg/blocks.3', .*its last write failed \(the disk was full\).*refusing"
        assert key in tier
        for _ in range(2):
            with pytest.raises(IOError, match=lost):
                tier.read(key)
        assert torch.equal(tier.read("exp_avg/blocks.2").wait(), torch.full((10,), 2.0))  # others untouched
        tier.write(key, torch.full((5000,), 3.0)).wait()
        assert torch.equal(tier.read(key).wait(), torch.full((5000,), 3.0))


@pytest.mark.timeout(60)
def test_a_read_after_a_failed_write_raises_before_the_writes_callback_has_run(tmp_path, monkeypatch):
    """The failed write's future stays in the tier's per-key record until its done-callback runs,
    which may come after `wait()` has returned: the read must still raise at once (it raced once
    in this session's suite runs, in the test above). The callback is held off here, so the test
    does not race."""
    with NvmeTier(tmp_path, threads=2, block_bytes=8192, direct=False) as tier:
        tier.write("k", torch.ones(100)).wait()
        monkeypatch.setattr(tier, "_forget", lambda key, fut: None)  # (the callback, not yet run)
        _full_disk_after(monkeypatch, calls=0)
        with pytest.raises(nvme_module.DiskFull):
            tier.write("k", torch.zeros(100)).wait()
        with pytest.raises(IOError, match=r"its last write failed \(the disk was full\)"):
            tier.read("k")


@pytest.mark.timeout(60)
def test_a_read_queued_behind_a_write_that_finds_the_disk_full_fails_too(tmp_path, monkeypatch):
    with NvmeTier(tmp_path, threads=2, block_bytes=8192, direct=False) as tier:
        tier.write("k", torch.ones(100)).wait()
        gate = threading.Event()
        _full_disk_after(monkeypatch, calls=0, gate=gate)
        write = tier.write("k", torch.zeros(100))
        read = tier.read("k")  # issued while the write runs: it waits for it ([Note: ordering per key])
        gate.set()
        with pytest.raises(nvme_module.DiskFull, match="writing key 'k' \\(400 bytes"):
            write.wait()
        with pytest.raises(IOError, match="its last write failed"):
            read.wait()
        tier.delete("k")  # a lost key can still be deleted
        assert "k" not in tier and not os.path.exists(tier.file("k"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_through_every_tier(tmp_path):
    assert DeviceTier().device.type == "cuda"
    assert CpuTier().pin is True
    for name, tier in _tiers(tmp_path).items():
        x = _tensor(3 * 4096 + 7, torch.bfloat16).cuda()
        tier.write("k", x).wait()
        out = torch.empty_like(x)
        assert torch.equal(tier.read("k", out).wait(), x), name
        if name == "cpu":
            assert tier._store["k"].is_pinned()
        if name == "device":
            assert tier.read("k").wait().is_cuda
        tier.close()


# -- in place: aligned tensors skip the staging copy ----------------------------------------------


@pytest.mark.parametrize("numel", SIZES)
def test_reads_are_aligned_and_aligned_tensors_round_trip_in_place(nvme, numel):
    from fxzero.runtime.storage.aligned import direct_view, aligned_empty

    x = aligned_empty(numel, torch.float32)
    x.copy_(_tensor(numel, torch.float32, seed=numel))
    assert numel == 0 or (x.data_ptr() % ALIGN == 0 and direct_view(x) is not None)
    nvme.write("k", x).wait()
    got = nvme.read("k").wait()
    assert torch.equal(got, x)
    if numel:
        assert got.data_ptr() % ALIGN == 0, "reads without out= come back aligned for in-place reuse"
        got.mul_(2)  # updated in place, written back straight from its memory
        nvme.write("k", got).wait()
        assert torch.equal(nvme.read("k").wait(), x * 2)
    if numel * 4 > 17:  # _corrupt flips data byte 17
        _corrupt(nvme, "k", "flip")
        with pytest.raises(IOError, match="checksum mismatch"):
            nvme.read("k").wait()


def test_unaligned_views_are_staged(nvme):
    from fxzero.runtime.storage.aligned import direct_view, aligned_empty

    base = aligned_empty(5000, torch.float32).copy_(torch.arange(5000.0))  # not garbage: NaN != NaN
    assert direct_view(base[1:]) is None  # data not on a 4096 boundary
    assert direct_view(base[: 1024 + 1][:1025]) is not None
    tight = torch.empty(1024 + 1)  # storage may end before the padded length
    if tight.data_ptr() % ALIGN == 0:
        assert direct_view(tight) is None or tight.untyped_storage().nbytes() >= 8192
    nvme.write("v", base[1:]).wait()
    assert torch.equal(nvme.read("v").wait(), base[1:])


def test_reads_go_before_queued_writes_but_after_writes_of_their_key(tmp_path, monkeypatch):
    # [Note: reads first]: one worker, busy with a write while three more and two reads queue.
    import threading

    tier = NvmeTier(str(tmp_path), threads=1)
    tier.write("r", torch.ones(10)).wait()
    order, busy, gate = [], threading.Event(), threading.Event()
    real_write, real_read = tier._write_file, tier._read

    def write(key, src, tensor):
        if key == "a":
            busy.set()
            gate.wait()
        order.append(f"write {key}")
        return real_write(key, src, tensor)

    def read(key, out):
        order.append(f"read {key}")
        return real_read(key, out)

    monkeypatch.setattr(tier, "_write_file", write)
    monkeypatch.setattr(tier, "_read", read)
    writes = [tier.write("a", torch.full((10,), 2.0))]
    busy.wait()  # the worker is inside write a
    writes += [tier.write(k, torch.full((10,), 2.0)) for k in ("b", "c")]
    reads = [tier.read("c"), tier.read("r")]  # "c" has a write queued: it must wait for it
    gate.set()
    assert torch.equal(reads[0].wait(), torch.full((10,), 2.0))
    assert torch.equal(reads[1].wait(), torch.ones(10))
    for w in writes:
        w.wait()
    assert order == ["write a", "read r", "write b", "write c", "read c"]
    tier.close()

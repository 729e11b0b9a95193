"""WriteBehind (fxzero/runtime/storage/write_behind.py): copies, budget, reads from memory, errors."""

from __future__ import annotations

import pytest
import torch

from fxzero.runtime.storage.nvme import NvmeTier
from fxzero.runtime.storage.write_behind import WriteBehind

MB = 1 << 20


def _tier(tmp_path) -> NvmeTier:
    return NvmeTier(str(tmp_path), threads=2)


def test_write_returns_at_once_and_the_caller_may_reuse_its_buffer(tmp_path):
    with _tier(tmp_path) as tier:
        behind = WriteBehind(tier, 8 * MB)
        value = torch.arange(1000, dtype=torch.float32)
        pending = behind.write("param/u", value, keep_until_read=True)
        assert pending.done()
        value.fill_(-1)  # the caller reuses its buffer: the copy is what gets written
        behind.drain()
        assert torch.equal(tier.read("param/u").wait(), torch.arange(1000, dtype=torch.float32))
        # The parameter shard stays in memory until read once, then goes.
        assert torch.equal(behind.lookup("param/u"), torch.arange(1000, dtype=torch.float32))
        behind.reclaim()
        assert "param/u" not in behind and behind.hits == 1


def test_other_states_leave_memory_once_written(tmp_path):
    with _tier(tmp_path) as tier:
        behind = WriteBehind(tier, 8 * MB)
        behind.write("exp_avg/u", torch.ones(100))
        behind.drain()
        assert "exp_avg/u" not in behind
        assert torch.equal(tier.read("exp_avg/u").wait(), torch.ones(100))


def test_the_latest_write_of_a_key_wins(tmp_path):
    with _tier(tmp_path) as tier:
        behind = WriteBehind(tier, 8 * MB)
        for i in range(5):
            behind.write("param/u", torch.full((10_000,), float(i)), keep_until_read=True)
        assert torch.equal(behind.lookup("param/u"), torch.full((10_000,), 4.0))
        behind.drain()
        assert torch.equal(tier.read("param/u").wait(), torch.full((10_000,), 4.0))


def test_copies_stay_within_the_budget_and_larger_writes_go_straight_to_the_tier(tmp_path):
    with _tier(tmp_path) as tier:
        behind = WriteBehind(tier, 3 * MB)
        quarter = torch.zeros(MB // 4 // 4 * 4)  # 1 MB of float32
        for i in range(6):
            behind.write(f"param/u{i}", quarter + i, keep_until_read=True)
            assert behind._held() <= 3 * MB
        big = torch.zeros(MB)  # 4 MB: over the budget, written directly (the caller waits)
        assert not behind.write("param/big", big).done() or "param/big" not in behind
        assert "param/big" not in behind
        behind.drain()
        for i in range(6):
            assert torch.equal(tier.read(f"param/u{i}").wait(), quarter + i)


def test_a_failed_write_is_raised_not_lost(tmp_path, monkeypatch):
    with _tier(tmp_path) as tier:
        behind = WriteBehind(tier, 8 * MB)

        def broken(key, src, tensor):
            raise OSError(f"disk failed writing {key}")

        monkeypatch.setattr(tier, "_write_file", broken)
        assert behind.write("param/u", torch.ones(10), keep_until_read=True).done()
        with pytest.raises(OSError, match="disk failed writing param/u"):
            behind.drain()
        # The value is not dropped with its failed write, and every later call says so.
        assert torch.equal(behind.lookup("param/u"), torch.ones(10))
        with pytest.raises(OSError, match="disk failed writing param/u"):
            behind.write("exp_avg/u", torch.ones(10))
        # Raising it does not drop it: the next calls raise again (no step goes on without it).
        for _ in range(2):
            with pytest.raises(OSError, match="disk failed writing param/u"):
                behind.reclaim()
        with pytest.raises(OSError, match="disk failed writing param/u"):
            behind.drain()
        assert "param/u" in behind


class _HeldTier:
    """A tier whose writes finish when the test says so (each write's future, by key and order)."""

    def __init__(self) -> None:
        import concurrent.futures

        self._future = concurrent.futures.Future
        self.writes: list[tuple[str, object]] = []

    def write(self, key, value):
        from fxzero.runtime.storage.tier import Pending

        future = self._future()
        self.writes.append((key, future))
        return Pending(future, value)


def test_copies_and_spare_buffers_are_told_apart_by_identity_not_by_value():
    """Two rewrites of keys in flight at once, of different sizes, the later finishing first:
    reclaiming it removed it from the retired list by `==`, which compared the buffers element
    by element ("The size of tensor a (40) must match the size of tensor b (27)": a second
    engine's NVMe step in one process). Spare buffers are dropped by identity too."""
    tier = _HeldTier()
    behind = WriteBehind(tier, 8 * MB)
    behind.write("exp_avg/a", torch.zeros(40))
    behind.write("exp_avg/b", torch.zeros(27))
    behind.write("exp_avg/a", torch.ones(40))  # the first copies retire, their writes in flight
    behind.write("exp_avg/b", torch.ones(27))
    for key, future in tier.writes:
        if future is tier.writes[1][1] or key == "exp_avg/b":  # b's first write ends first
            future.set_result(None)
    behind.reclaim()
    assert [c.buffer.numel() for c in behind._retired] == [40]
    for _, future in tier.writes:
        if not future.done():
            future.set_result(None)
    behind.reclaim()
    assert not behind._retired and not behind._copies and len(behind._spare) == 4
    small = WriteBehind(tier, 30 * 4 + 10)  # a copy of 30 elements reuses that spare, the other must go
    small._spare = [torch.zeros(30), torch.zeros(40)]
    assert small._make_room(30, torch.float32)
    assert [b.numel() for b in small._spare] == [30]


def test_a_write_straight_to_the_tier_drops_the_keys_older_copy(tmp_path):
    """A write over the budget goes to the tier directly: the key's copy of an earlier write (an
    unread parameter shard, kept for the next read) would otherwise answer the next lookup with the
    older value."""
    with _tier(tmp_path) as tier:
        behind = WriteBehind(tier, 3 * MB)
        behind.write("param/u", torch.zeros(1000), keep_until_read=True)
        behind.write("param/u", torch.ones(MB), keep_until_read=True)  # (4 MB: over the budget)
        assert behind.lookup("param/u") is None
        behind.drain()
        assert torch.equal(tier.read("param/u").wait(), torch.ones(MB))


def test_a_value_put_into_the_store_is_what_the_next_fetch_reads(tmp_path):
    """OffloadStore.put (a loaded checkpoint, a value set by the state APIs, a loaded state dict)
    writes the tier directly: before, the next forward's fetch read the write-behind copy of the
    step's last write, the value from before the put."""
    import fxzero
    from fxzero.runtime.storage.offload_store import OffloadStore

    store = OffloadStore(fxzero.Offload(params=fxzero.Nvme(path=str(tmp_path))), rank=0)
    try:
        store.write("param", "u", torch.zeros(1000)).wait()  # (a step's write: its copy kept until read)
        store.put("param", "u", torch.full((1000,), 3.0))
        assert torch.equal(store.fetch("param", "u", 1000, torch.float32).wait(), torch.full((1000,), 3.0))
    finally:
        store.close()

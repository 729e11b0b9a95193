"""BufferPool: large buffers come back for the next request of their size; the rest is freed."""

import torch

from fxzero.runtime.storage.pool import BufferPool
from fxzero.runtime.storage.aligned import ALIGN

BIG = 1 << 19  # 2 MiB of float32: pooled
SMALL = 1000  # under min_bytes: never pooled


def test_a_freed_buffer_is_handed_out_again_for_its_size():
    pool = BufferPool(per_size=2)
    a = pool.take(BIG, torch.float32)
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take(BIG, torch.float32)
    assert b.data_ptr() == ptr and pool.reused == 1
    c = pool.take(BIG, torch.float32)  # none left: a fresh one
    assert c.data_ptr() != ptr and pool.reused == 1
    other = pool.take(BIG + 1, torch.float32)  # another size never gets b's memory
    assert other.data_ptr() != ptr


def test_aligned_buffers_stay_aligned_and_separate():
    pool = BufferPool()
    a = pool.take(BIG, torch.float32, aligned=True)
    assert a.data_ptr() % ALIGN == 0
    pool.give(a)
    plain = pool.take(BIG, torch.float32)  # an unaligned request does not take it
    assert plain.data_ptr() != a.data_ptr()
    again = pool.take(BIG, torch.float32, aligned=True)
    assert again.data_ptr() == a.data_ptr()


def test_bounded_and_small_or_foreign_buffers_are_released():
    pool = BufferPool(per_size=1)
    a, b = pool.take(BIG, torch.float32), pool.take(BIG, torch.float32)
    pool.give(a)
    pool.give(b)  # over per_size: released now
    assert b.untyped_storage().nbytes() == 0 and a.untyped_storage().nbytes() > 0
    small = pool.take(SMALL, torch.float32)
    pool.give(small)  # small ones are freed as before, so a stray use fails loudly
    assert small.untyped_storage().nbytes() == 0
    base = torch.empty(2 * BIG)
    view = base[1:BIG + 1]
    pool.give(view)  # a view into something larger is not the pool's to keep
    assert base.untyped_storage().nbytes() == 0
    pool.clear()
    assert a.untyped_storage().nbytes() == 0


def test_total_kept_bytes_are_capped():
    nbytes = BIG * 4
    pool = BufferPool(per_size=4, max_bytes=2 * nbytes)
    bufs = [pool.take(BIG, torch.float32) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert pool.kept_bytes == 2 * nbytes
    assert [b.untyped_storage().nbytes() > 0 for b in bufs] == [True, True, False]
    pool.take(BIG, torch.float32)
    assert pool.kept_bytes == nbytes and pool.kept_peak == 2 * nbytes  # (memory_report's pooled, pooled_peak)


def test_memory_report_counts_the_buffers_the_pool_keeps_idle():
    """The executor's kept buffers are resident but belong to no other category: the report names
    them, at rest after a step of a model whose units are pooled sizes (gpt small: 8 MB units)."""
    import torch.nn.functional as F

    import fxzero
    from fxzero.zoo import gpt

    with torch.device("meta"):
        model = gpt("small", n_blocks=2, seq_len=8)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    ids = torch.randint(0, 8192, (1, 9))
    engine.backward(F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()))
    engine.step()
    report = engine.memory_report()
    assert report["pooled"] == engine._pool.kept_bytes > 0
    assert report["pooled_peak"] >= report["pooled"]
    assert report["gathered"] == 0  # (the same buffers, idle: not counted twice)
    engine.close()


def test_large_sizes_keep_fewer_buffers():
    nbytes = BIG * 4
    pool = BufferPool(per_size=8, size_bytes=3 * nbytes)  # room for 3 of this size
    bufs = [pool.take(BIG, torch.float32) for _ in range(5)]
    for b in bufs:
        pool.give(b)
    assert [b.untyped_storage().nbytes() > 0 for b in bufs] == [True] * 3 + [False] * 2
    pool = BufferPool(per_size=8, size_bytes=nbytes // 2)  # smaller than one: still 2 kept
    bufs = [pool.take(BIG, torch.float32) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    assert [b.untyped_storage().nbytes() > 0 for b in bufs] == [True, True, False]

"""The NVMe tier's I/O workers: threads that take early reads before everything else.

[Note: reads first]
A program waits for its reads soon (a parameter shard before its gather), and for its writes
late or not at all (write-behind), so the workers take reads before writes: a read issued while
writes are queued does not wait behind them. Only a read with no unfinished task on its key is
taken early; every other task is taken first-in first-out. That cannot deadlock: a task waits
only on an earlier task of its key, and that task is either an early read (which waits on
nothing, and was taken before any later task, since early reads go first) or was taken earlier
in first-in first-out order; either way a worker already holds it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading

from fxzero.runtime.storage.tier import rank_prefix

__all__ = ["IoPool"]


class IoPool:
    """Worker threads that take early reads before everything else ([Note: reads first])."""

    def __init__(self, threads: int, name: str) -> None:
        self._cond = threading.Condition()
        self._queues: tuple[collections.deque, collections.deque] = (collections.deque(), collections.deque())
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, early: bool, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{rank_prefix()} NvmeTier is closed: no more reads or writes")
            self._queues[0 if early else 1].append((future, fn, args))
            self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._queues[0] or self._queues[1] or self._closed):
                    self._cond.wait()
                queue_ = self._queues[0] if self._queues[0] else self._queues[1]
                if not queue_:
                    return  # closed, nothing left
                future, fn, args = queue_.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # delivered to whoever waits on the future
                future.set_exception(e)
            # Let go of the task before waiting for the next: its arguments hold the tensor it wrote
            # (a saved activation written to free its memory: fxzero/runtime/activation_store.py).
            del future, fn, args

    def shutdown(self) -> None:
        """Run what was submitted, then stop the workers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

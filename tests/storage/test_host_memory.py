"""A CPU engine hands the heap's freed pages back to the kernel after each of its programs
(`fxzero/runtime/host_memory.py`), so that resident memory follows the bytes in use.

Measured the way a user would see it: after two steps of the 25M zoo GPT (sequence 128) on one
rank, a `malloc_trim` of our own finds nothing left to return; the same steps with the engine's
trim turned off leave the heap holding well over 50 MB it no longer uses (213 MB here; the
control: the check can fail). Only glibc has `malloc_trim`; elsewhere there is nothing to check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxzero
from fxzero.runtime import host_memory
from fxzero.zoo import gpt

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(host_memory._libc() is None, reason="glibc's malloc_trim is not the allocator here")]


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def _left_in_the_heap(trim: bool) -> int:
    """Bytes a trim returns right after two steps (the engine's own trim on or off)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt("small", seq_len=128)
    engine = fxzero.compile(model, fxzero.Config(stage=3, seed=0, cost_model=None))
    assert engine._trim_host  # (a CPU engine without keep_host_memory)
    engine._trim_host = trim
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (4, 129))
        loss = F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
    before = _rss_anon()
    host_memory.release_freed_host_memory()
    return before - _rss_anon()


def test_a_cpu_engine_leaves_no_freed_heap_pages_resident_after_a_step():
    assert _left_in_the_heap(trim=False) > 50e6
    assert _left_in_the_heap(trim=True) < 4e6

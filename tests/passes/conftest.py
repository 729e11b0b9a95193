"""Fixtures for the single-process pass tests; the toy models live in toys.py."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    """These tests run in a world of one: no launcher variables, no process group but the one of
    one that `fxzero.initialize` makes as DeepSpeed's does (ended after the test)."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert not (dist.is_available() and dist.is_initialized()), "tests/passes must not join a process group"
    yield
    if dist.is_initialized():  # (tests/conftest.py ends a group of one)
        assert dist.get_world_size() == 1, "tests/passes must not join a process group of several ranks"

"""Fixtures for every test: the test process leaves no process group behind.

`fxzero.initialize` joins a process group of one in a world of one, as DeepSpeed's does (so a
script's own `dist.get_rank()` works); a test that calls it in the pytest process would otherwise
leave that group to every later test, which then runs as a member of a world it never joined.
"""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    yield
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()

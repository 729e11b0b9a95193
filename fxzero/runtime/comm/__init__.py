"""Collectives: the interface the executor calls, over a process group, shared memory or nothing.

- `base`: `Comm` (torch.distributed: gloo, NCCL), `LocalComm` (a world of one), `Pending`;
- `shm`: `ShmComm`, collectives through /dev/shm for ranks on one host;
- `link`: the link emulator (a slower link's timing on a fast one);
- `make_comm` here: the one for this process.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist

from fxzero.config import LinkEmulation
from fxzero.runtime.comm.base import Comm, LocalComm, Pending, Traffic
from fxzero.runtime.comm.shm import ShmComm, shared_memory_unavailable

__all__ = ["Comm", "LocalComm", "Pending", "ShmComm", "Traffic", "make_comm", "reductions_apart"]


_GROUPS: dict[tuple[Optional[float], str], dist.ProcessGroup] = {}
"""(collective timeout in seconds, purpose) -> fxzero's group over the default group's ranks."""


def _group(timeout_s: Optional[float], purpose: str = "") -> Optional[dist.ProcessGroup]:
    """A group of every rank whose collectives give up after `timeout_s` (the default group's
    timeout is the launcher's choice, 30 minutes for gloo); None: the default group. A `purpose`
    ("reduce") asks for a group of its own, beside the one for gathers."""
    if timeout_s is None and not purpose:
        return None
    key = (timeout_s, purpose)
    if key not in _GROUPS:
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        _GROUPS[key] = dist.new_group(timeout=timeout)
    return _GROUPS[key]


def reductions_apart() -> bool:
    """Whether reductions get a process group of their own ([Note: a group per kind] in `base.py`):
    where the default group's backend is NCCL, which runs each group's collectives in order on one
    stream; gloo's ranks keep one group (its collectives already run on their own threads)."""
    return "nccl" in str(dist.get_backend())


def make_comm(link: Optional[LinkEmulation] = None, transport: str = "auto",
              timeout_s: Optional[float] = None) -> Comm:
    """The Comm for this process: the default process group's ranks if there is one, else a
    world of one.

    `transport` (see `Config.transport`): "auto" moves the data of collectives on CPU buffers
    through shared memory when every rank runs on this host with gloo (`fxzero.runtime.shm`),
    "shared_memory" insists on it, "process_group" always uses torch.distributed. `timeout_s`
    (`Config.collective_timeout`): how long any collective waits for the other ranks before it
    is an error. Collective: every rank calls it.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return LocalComm(link=link)  # (a process group of one, as DeepSpeed makes, needs no collectives)
    group = _group(timeout_s)
    comm = Comm(group, link=link, reduce_group=_group(timeout_s, "reduce") if reductions_apart() else None)
    if transport == "process_group":
        return comm
    why = shared_memory_unavailable(comm)
    if why is None:
        return ShmComm(group, link=link, timeout_s=timeout_s)
    if transport == "shared_memory":
        raise ValueError(f"[rank {comm.rank}] Config(transport='shared_memory') needs every rank on one host "
                         f"with gloo and room in /dev/shm, but {why}; use transport='auto' (falls back to the "
                         f"process group) or 'process_group'")
    return comm

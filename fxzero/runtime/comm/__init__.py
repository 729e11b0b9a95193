"""Collectives: the interface the executor calls, over a process group, shared memory or nothing.

- `base`: `Comm` (torch.distributed: gloo, NCCL), `LocalComm` (a world of one), `Pending`;
- `shm`: `ShmComm`, collectives through /dev/shm for ranks on one host;
- `link`: the link emulator (a slower link's timing on a fast one);
- `make_comm` here: the one for this process.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from fxzero.config import LinkEmulation
from fxzero.runtime.comm.base import Comm, LocalComm, Pending, Traffic
from fxzero.runtime.comm.shm import ShmComm, shared_memory_unavailable

__all__ = ["Comm", "LocalComm", "Pending", "ShmComm", "Traffic", "make_comm"]


def make_comm(link: Optional[LinkEmulation] = None, transport: str = "auto") -> Comm:
    """The Comm for this process: the default process group if there is one, else a world of one.

    `transport` (see `Config.transport`): "auto" moves the data of collectives on CPU buffers
    through shared memory when every rank runs on this host with gloo (`fxzero.runtime.shm`),
    "shared_memory" insists on it, "process_group" always uses torch.distributed. Collective:
    every rank calls it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return LocalComm(link=link)
    comm = Comm(link=link)
    if transport == "process_group":
        return comm
    why = shared_memory_unavailable(comm)
    if why is None:
        return ShmComm(link=link)
    if transport == "shared_memory":
        raise ValueError(f"[rank {comm.rank}] Config(transport='shared_memory') needs every rank on one host "
                         f"with gloo and room in /dev/shm, but {why}; use transport='auto' (falls back to the "
                         f"process group) or 'process_group'")
    return comm

"""Memory tiers: tensors held on the device, or in host memory (pinned under CUDA)."""

from __future__ import annotations

import os
import time
from typing import Optional, Union

import torch

from fxzero.runtime.storage.tier import Pending, Record, StorageTier

__all__ = ["CpuTier", "DeviceTier"]


class _MemoryTier(StorageTier):
    """Tensors held in memory on one device; writes copy in, reads copy out."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        super().__init__()
        self.device = device
        self.pin = pin
        self._store: dict[str, torch.Tensor] = {}

    def write(self, key: str, tensor: torch.Tensor) -> Pending:
        start = time.perf_counter()
        flat = tensor.detach().reshape(-1)
        held = self._store.get(key)
        if held is None or held.dtype != flat.dtype or held.numel() != flat.numel():
            # A key rewritten with the same size reuses its buffer (pinned allocations are slow).
            held = torch.empty(flat.numel(), dtype=flat.dtype, device=self.device, pin_memory=self.pin)
        held.copy_(flat)
        nbytes = flat.numel() * flat.element_size()
        with self._lock:
            self._store[key] = held
            self._index[key] = Record(flat.dtype, tensor.shape, nbytes, 0)
        self._count("write", nbytes, time.perf_counter() - start)
        return Pending(None, tensor)

    def read(self, key: str, out: Optional[torch.Tensor] = None) -> Pending:
        start = time.perf_counter()
        rec = self._record(key)
        if out is None:
            out = torch.empty(rec.shape, dtype=rec.dtype, device=self.device)
        self._check_out(key, rec, out)
        out.view(-1).copy_(self._store[key])
        self._count("read", rec.nbytes, time.perf_counter() - start)
        return Pending(None, out)

    def delete(self, key: str) -> None:
        self._record(key)
        with self._lock:
            del self._index[key]
            del self._store[key]

    def _free_bytes(self) -> int:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def reserve(self, total_bytes: int) -> None:
        """Raise ValueError now if `total_bytes` more cannot fit, rather than fail mid-step."""
        free = self._free_bytes()
        if total_bytes > free:
            raise ValueError(f"{self.name} tier: {total_bytes} bytes needed on {self.device}, only {free} free; "
                             f"offload less to this tier (use a lower one) or free memory")


class DeviceTier(_MemoryTier):
    """Tensors in accelerator memory: the top tier, where a step's working set must fit."""

    name = "device"

    def __init__(self, device: Union[torch.device, str, None] = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(torch.device(device), pin=False)

    def _free_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return super()._free_bytes()


class CpuTier(_MemoryTier):
    """Tensors in host memory, pinned when CUDA is available (asynchronous host-device copies)."""

    name = "cpu"

    def __init__(self, *, pin: Optional[bool] = None) -> None:
        super().__init__(torch.device("cpu"), pin=torch.cuda.is_available() if pin is None else pin)

"""The device a rank computes on, and where each kind of buffer the runtime allocates lives.

[Note: buffer kinds]
One runtime serves CPU and CUDA ranks; what differs is where a buffer goes, decided by its kind
here rather than by `if cuda:` across the runtime:

- device memory: parameter shards and whole units, gathered buffers, flat gradients, optimizer
  states held on the rank, model buffers, flags and norms of the step (`DeviceLayer.empty`,
  `full`, `zeros`);
- host memory for copies to and from the device: the cpu tier and I/O staging (`host_empty`),
  pinned where the device has pinned memory (so copies are asynchronous DMA), pageable on CPU
  ranks, where pinning means nothing;
- control data (the agreement digest, checkpoint phases, object gathers) stays in host memory and
  travels over gloo: a CUDA rank's default process group is "cpu:gloo,cuda:nccl"
  (`process_group_backend`), so a host tensor's collective runs on gloo and a device tensor's on
  NCCL, on the same group.

Streams and events come from `torch.get_device_module(device)`; on the CPU they exist and do
nothing, so code that records an event or waits on a stream reads the same on both.
"""

from __future__ import annotations

import os
from typing import Sequence, Union

import torch

__all__ = ["DeviceLayer", "process_group_backend", "rank_device"]

Shape = Union[int, Sequence[int]]


def rank_device() -> torch.device:
    """This process's device: `cuda:LOCAL_RANK` (made current, so NCCL and every allocation
    without an index use it) where CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK={local} but this host has {torch.cuda.device_count()} CUDA devices: launch at "
                           "most one process per GPU (torchrun --nproc-per-node, fxzero run --num_gpus)")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def process_group_backend() -> str:
    """The default process group's backend: NCCL for device tensors with gloo beside it for host
    tensors on CUDA ranks ([Note: buffer kinds]), gloo on CPU ranks."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


class DeviceLayer:
    """Allocation by kind, streams and events, for one rank's device ([Note: buffer kinds])."""

    def __init__(self, device: Union[str, torch.device]) -> None:
        self.device = torch.device(device)
        self.accelerated = self.device.type not in ("cpu", "meta")
        """Whether host memory is a separate place the device copies from (pinned memory helps)."""
        self.module = torch.get_device_module(self.device) if self.device.type != "meta" else torch.cpu

    def __repr__(self) -> str:
        return f"DeviceLayer({str(self.device)!r})"

    # -- device memory ------------------------------------------------------------------------

    def empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def zeros(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def full(self, shape: Shape, value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape if not isinstance(shape, int) else (shape,), value, dtype=dtype, device=self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in device memory (itself where it already is)."""
        return t.to(self.device, non_blocking=t.is_pinned()) if t.device != self.device else t

    # -- host memory --------------------------------------------------------------------------

    def host_empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device copies to and from: pinned on an accelerator, pageable on CPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.accelerated)

    # -- streams and events -------------------------------------------------------------------

    def stream(self):
        """A new stream on the device (on the CPU, one that runs everything in order)."""
        return self.module.Stream()

    def current_stream(self):
        return self.module.current_stream()

    def event(self):
        """An event to record on one stream and wait for on another (no-op on the CPU)."""
        return torch.Event(self.device.type if self.device.type != "meta" else "cpu")

    def synchronize(self) -> None:
        if self.accelerated:
            self.module.synchronize(self.device)

    # -- accounting ---------------------------------------------------------------------------

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is in this device's memory (as opposed to host memory)."""
        return t.device.type == self.device.type

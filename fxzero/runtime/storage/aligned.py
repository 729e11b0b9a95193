"""Aligned host buffers: what O_DIRECT reads into and writes from without a staging copy.

[Note: in place]
A tensor whose data starts on a 4096-byte boundary, with its storage running on to the padded
length, is read into and written from directly (no staging copy; `direct_view`). Reads without
`out` allocate such tensors (`aligned_empty`), so a state fetched from this tier, updated in
place and written back never passes through a staging buffer. Other tensors are staged.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch

from fxzero.ir.sizes import round_up

__all__ = ["ALIGN", "Staging", "aligned_buffer", "aligned_empty", "as_bytes", "direct_view"]

ALIGN = 4096
"""Alignment of staging buffers, file offsets and write lengths (see [Note: O_DIRECT] in
`fxzero/runtime/storage/nvme.py`)."""


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage."""
    return t.reshape(-1).view(torch.uint8)


class Staging(NamedTuple):
    """One reused, ALIGN-aligned host buffer: a uint8 tensor view and a buffer for os.pread/pwrite."""

    tensor: torch.Tensor
    view: memoryview
    owner: torch.Tensor
    """The over-allocated tensor whose storage the aligned views point into."""


def aligned_buffer(nbytes: int) -> Staging:
    # Over-allocate by ALIGN and start at the first aligned address inside (no numpy needed).
    owner = torch.zeros(nbytes + ALIGN, dtype=torch.uint8)
    offset = -owner.data_ptr() % ALIGN
    tensor = owner[offset : offset + nbytes]
    view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    return Staging(tensor, view, owner)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized flat tensor whose data starts on an ALIGN boundary and whose storage
    extends to a multiple of ALIGN past it, so O_DIRECT can read and write it in place."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    owner = torch.empty(round_up(nbytes, ALIGN) + ALIGN, dtype=torch.uint8)
    offset = -owner.data_ptr() % ALIGN
    return owner[offset : offset + nbytes].view(dtype) if nbytes else torch.empty(0, dtype=dtype)


def direct_view(t: torch.Tensor) -> Optional[memoryview]:
    """A writable byte view of t's data padded to ALIGN, if t can be used for O_DIRECT in place
    (data aligned, and its storage extends to the padded length); else None."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % ALIGN:
        return None
    storage = t.untyped_storage()
    available = storage.data_ptr() + storage.nbytes() - t.data_ptr()
    padded = round_up(nbytes, ALIGN)
    if available < padded:
        return None
    return memoryview((ctypes.c_char * padded).from_address(t.data_ptr())).cast("B")

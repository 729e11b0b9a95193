"""A safetensors file written one tensor at a time, so writing it holds one tensor in memory.

[Note: why we write safetensors ourselves]
The safetensors library's writer (`safetensors.torch.save_file`) takes the whole state dict at
once: exporting a model would hold all of it in memory, 28 GB for a 7B model in fp32. The format
is simple enough to write as we go (the library still reads what we write, and the tests read
it with the library):

    8 bytes    N, the header's length: an unsigned 64-bit little-endian integer
    N bytes    the header, UTF-8 JSON: {name: {"dtype": "F32", "shape": [...],
               "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}, padded with
               spaces to a multiple of 8 bytes so the data starts 8-byte aligned
    the data   each tensor's elements, row-major and little-endian, at [begin, end) from
               the data's start; the tensors cover the data exactly, no gaps, no overlaps

Every name, dtype and shape is known before any value is read (a checkpoint's manifest, an
engine's unit layouts), so the header goes first and each tensor is written at its own offset
whenever it arrives, in any order. The tensors are laid out by decreasing element size (as the
library lays them out), so with the 8-byte aligned start every tensor is aligned to its own
element size and a reader may map it in place. The file is written under a temporary name and
renamed when every tensor is in: a file named `*.safetensors` is complete.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["DTYPE_NAMES", "SafetensorsWriter", "Entry"]

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""The safetensors spec's dtype names."""

_ALIGN = 8


class Entry(NamedTuple):
    """One tensor of the file: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _Placed(NamedTuple):
    entry: Entry
    begin: int  # from the start of the data
    end: int


def _layout(entries: Sequence[Entry]) -> list[_Placed]:
    """Each entry's byte range, the widest dtypes first (then in the order given)."""
    order = sorted(range(len(entries)), key=lambda i: -entries[i].dtype.itemsize)
    placed, offset = [], 0
    for i in order:
        e = entries[i]
        nbytes = math.prod(e.shape) * e.dtype.itemsize
        placed.append(_Placed(e, offset, offset + nbytes))
        offset += nbytes
    return placed


def _header(placed: Sequence[_Placed], metadata: Optional[dict[str, str]]) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for p in placed:
        header[p.entry.name] = {"dtype": DTYPE_NAMES[p.entry.dtype], "shape": list(p.entry.shape),
                                "data_offsets": [p.begin, p.end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    """Write `entries` to a safetensors file at `path`, one `write(name, tensor)` each.

    Use as a context manager: leaving it normally commits the file (every entry must have been
    written), leaving it by an exception removes the partial file.
    """

    def __init__(self, path: str, entries: Sequence[Entry], metadata: Optional[dict[str, str]] = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors stores little-endian data; this writer runs only on little-endian hosts")
        entries = [Entry(name, dtype, tuple(int(s) for s in shape)) for name, dtype, shape in entries]
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"{path}: a tensor name appears twice: "
                             f"{sorted({n for n in names if names.count(n) > 1})[:3]}")
        unsupported = [e for e in entries if e.dtype not in DTYPE_NAMES]
        if unsupported:
            raise TypeError(f"{path}: safetensors has no dtype for {unsupported[0].name!r} ({unsupported[0].dtype})")
        if "__metadata__" in names:
            raise ValueError(f"{path}: '__metadata__' is reserved for the header's metadata, not a tensor name")
        self.path = path
        self._placed = {p.entry.name: p for p in _layout(entries)}
        header = _header(list(self._placed.values()), metadata)
        self._data_start = len(header)
        self.size = self._data_start + max((p.end for p in self._placed.values()), default=0)
        self._written: set[str] = set()
        self._tmp = f"{path}.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")
        self._file.write(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the tensor `name` (its dtype and shape as declared)."""
        placed = self._placed.get(name)
        if placed is None:
            raise KeyError(f"{self.path}: {name!r} is not a tensor of this file's header")
        want = placed.entry
        if tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise ValueError(f"{self.path}: {name!r} was declared {want.dtype} {list(want.shape)}, "
                             f"written as {tensor.dtype} {list(tensor.shape)}")
        if name in self._written:
            raise ValueError(f"{self.path}: {name!r} written twice")
        if placed.end > placed.begin:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._file.seek(self._data_start + placed.begin)
            self._file.write(memoryview(data))
        self._written.add(name)

    def close(self) -> None:
        """Check every tensor was written, sync the file and give it its name."""
        missing = [name for name in self._placed if name not in self._written]
        if missing:
            self.abort()
            raise ValueError(f"{self.path}: {len(missing)} tensors were never written ({missing[:3]}); "
                             "nothing was committed")
        self._file.truncate(self.size)  # (already this size: a last empty tensor writes nothing)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

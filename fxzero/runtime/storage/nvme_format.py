"""The NVMe tier's file format: a header block, then the tensor's bytes, both 4096-aligned.

[Note: NVMe file layout] and
"""

from __future__ import annotations

import struct
import urllib.parse
from typing import NamedTuple

import torch

from fxzero.ir.sizes import round_up
from fxzero.runtime.storage.aligned import ALIGN

__all__ = ["HEADER_BYTES", "Header", "MAGIC", "SUFFIX", "VERSION", "data_bytes_on_disk", "file_name", "file_size",
           "pack_header", "unpack_header"]

MAGIC = b"FXZSTOR1"
VERSION = 2
SUFFIX = ".fxz"
_HEADER = struct.Struct("<8sI16sQQQ")  # magic, version, dtype name, numel, nbytes, xxh3_64 of the data
HEADER_BYTES = ALIGN
"""The header block: the data starts at this offset."""


class Header(NamedTuple):
    magic: bytes
    version: int
    dtype: str
    numel: int
    nbytes: int
    checksum: int


def file_name(key: str) -> str:
    """The file that holds `key`: the percent-quoted key (reversible, so two keys never share one)."""
    return urllib.parse.quote(key, safe="") + SUFFIX


def data_bytes_on_disk(nbytes: int) -> int:
    """Bytes the data of a tensor of `nbytes` takes in its file (zero-padded to ALIGN)."""
    return round_up(nbytes, ALIGN)


def file_size(nbytes: int) -> int:
    """The size of the file that holds a tensor of `nbytes`."""
    return HEADER_BYTES + data_bytes_on_disk(nbytes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_header(dtype: torch.dtype, numel: int, nbytes: int, checksum: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, dtype_name(dtype).encode(), numel, nbytes, checksum)


def unpack_header(raw: bytes) -> Header:
    """The header at the start of `raw` (at least `_HEADER.size` bytes)."""
    magic, version, name, numel, nbytes, checksum = _HEADER.unpack(raw[: _HEADER.size])
    return Header(magic, version, name.rstrip(b"\0").decode(errors="replace"), numel, nbytes, checksum)

"""Reading a checkpoint: the manifest and index checked first, then any flat range of any tensor.

`CheckpointReader(path)` reads `fxzero.json` and `.metadata`, checks every file's size (a
truncated file is an error naming it before anything is loaded) and the small files' checksums;
nothing it reads runs code from the file ([Note: loading runs no code] in `safe_load.py`);
`read_range(key, lo, hi)` assembles elements [lo, hi) of a tensor from the chunks that overlap
them, each chunk checked against its checksum as it is read. Used by `load_checkpoint` on every
rank (each reads the ranges of its new shards) and by `fxzero export` (whole tensors, one at a
time), so a checkpoint is re-sliced for any world size and stage by the same code.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Optional

import torch

from fxzero.runtime.checkpoint import format as fmt
from fxzero.runtime.checkpoint.chunks import box_range
from fxzero.runtime.checkpoint.files import CheckpointError, checksum_file, read_exact
from fxzero.runtime.checkpoint.safe_load import load_metadata, load_plain

__all__ = ["CheckpointReader"]

_SMALL = 64 << 20  # files up to this size are checksummed whole when opened


class CheckpointReader:
    def __init__(self, path: str, *, cache_blobs: int = 4) -> None:
        self.path = path
        manifest_path = os.path.join(path, fmt.MANIFEST)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint directory")
        try:
            with open(manifest_path) as f:
                self.manifest: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{manifest_path}: missing; {path} is not a complete fxzero checkpoint (a save "
                                  "that never committed leaves no manifest)") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{manifest_path}: unreadable ({e}); the checkpoint is damaged") from None
        if self.manifest.get("format") != fmt.FORMAT:
            raise CheckpointError(f"{manifest_path}: not an fxzero checkpoint manifest")
        if self.manifest.get("version", 0) > fmt.VERSION:
            raise CheckpointError(f"{manifest_path}: format version {self.manifest['version']} is newer than this "
                                  f"fxzero reads ({fmt.VERSION}); upgrade fxzero")
        self.files: dict[str, dict] = self.manifest["files"]
        for name, info in self.files.items():
            self._check_file(name, info)
        self.metadata = load_metadata(self._file(fmt.METADATA))
        self._chunks: dict[str, list[tuple[int, int, Any, tuple, tuple]]] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if hasattr(md, "chunks"):
                entries = [(*(box_range(md.size, c.offsets, c.sizes) or (-1, -1)), c, tuple(c.offsets),
                            tuple(c.sizes)) for c in md.chunks]
                self._chunks[key] = sorted(entries, key=lambda entry: (entry[0], entry[3]))
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_blobs = cache_blobs

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _check_file(self, name: str, info: dict) -> None:
        path = self._file(name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing (the manifest lists it); the checkpoint is incomplete")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {info['bytes']}: the file is "
                                  f"{'truncated' if size < info['bytes'] else 'changed'}; load another checkpoint")
        if size <= _SMALL and not name.endswith(".distcp") and checksum_file(path) != info["xxh3"]:
            raise CheckpointError(f"{path}: does not match its checksum in the manifest: the file was changed or "
                                  "damaged after it was written; load another checkpoint")

    # -- what it holds ------------------------------------------------------------------------

    def shape(self, key: str) -> Optional[tuple[int, ...]]:
        md = self.metadata.state_dict_metadata.get(key)
        return tuple(md.size) if md is not None and hasattr(md, "size") else None

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    def has(self, key: str) -> bool:
        return key in self.metadata.state_dict_metadata

    def load_file(self, name: str) -> Any:
        """A whole small file of fxzero's own (engine_state.pt, rank<N>_state.pt), checked."""
        info = self.files.get(name)
        if info is None:
            raise CheckpointError(f"{self._file(name)}: not in this checkpoint")
        data = read_exact(self._file(name), 0, info["bytes"], info["xxh3"], name)
        return load_plain(data, self._file(name), "the file")

    def read_bytes_item(self, key: str) -> Any:
        """A non-tensor item of the state dict (DCP's "bytes" item), e.g. `optim.param_groups`."""
        info = self.metadata.storage_data.get(_index(key))
        if info is None:
            raise CheckpointError(f"{self._file(fmt.METADATA)}: holds no item {key!r}")
        return load_plain(self._blob_bytes(info, key), self._file(info.relative_path), f"item {key!r}")

    # -- tensors ------------------------------------------------------------------------------

    def _blob_bytes(self, info, what: str):
        checksum = self.manifest["chunks"].get(f"{info.relative_path}@{info.offset}")
        return read_exact(self._file(info.relative_path), info.offset, info.length, checksum, what)

    def _chunk(self, key: str, offsets: tuple) -> torch.Tensor:
        where = (key, offsets)
        if where in self._cache:
            self._cache.move_to_end(where)
            return self._cache[where]
        info = self.metadata.storage_data[_index(key, offsets)]
        what = f"{key} chunk at {list(offsets)}"
        tensor = load_plain(self._blob_bytes(info, what), self._file(info.relative_path), what)
        if type(tensor) is not torch.Tensor:
            raise CheckpointError(f"{self._file(info.relative_path)}: {what} holds a {type(tensor).__name__}, not a "
                                  "tensor; the checkpoint is damaged")
        self._cache[where] = tensor
        while len(self._cache) > self._cache_blobs:
            self._cache.popitem(last=False)
        return tensor

    def read_range(self, key: str, lo: int, hi: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key`, flattened row-major (into `out` if given)."""
        if key not in self._chunks:
            raise CheckpointError(f"{self._file(fmt.METADATA)}: holds no tensor {key!r}")
        shape = tuple(self.metadata.state_dict_metadata[key].size)
        if out is None:
            out = torch.empty(hi - lo, dtype=self.dtype(key))
        covered = 0
        for start, end, chunk, offsets, sizes in self._chunks[key]:
            if start < 0:  # a box that is not one flat range (another writer's): read the whole tensor
                return self._read_boxes(key, shape, lo, hi, out)
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - lo : b - lo].copy_(self._chunk(key, offsets).reshape(-1)[a - start : b - start])
                covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"{self._file(fmt.METADATA)}: the chunks of {key!r} cover {covered} of elements "
                                  f"[{lo}, {hi}); the checkpoint is incomplete")
        return out

    def _read_boxes(self, key: str, shape: tuple, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        full = torch.empty(shape, dtype=self.dtype(key))
        for _, _, chunk, offsets, sizes in self._chunks[key]:
            view = full
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                view = view.narrow(dim, o, s)
            view.copy_(self._chunk(key, offsets))
        return out.copy_(full.reshape(-1)[lo:hi])

    def read_tensor(self, key: str) -> torch.Tensor:
        shape = self.shape(key)
        numel = 1
        for s in shape:
            numel *= s
        return self.read_range(key, 0, numel).view(shape)


def _index(key: str, offsets: Optional[tuple] = None):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(key, torch.Size(offsets) if offsets is not None else None)

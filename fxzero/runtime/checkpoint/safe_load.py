"""Reading a checkpoint's files without running code from them.

[Note: loading runs no code]
Unpickling calls whatever functions the file names (a `__reduce__` returning `os.system` and a
command), and a checkpoint is often someone else's. The checksums in fxzero.json do not help:
the manifest travels with the files, so whoever changed a file can change its checksum too. So
nothing fxzero reads from a checkpoint is unpickled as it stands:

- `.metadata`, DCP's pickled `Metadata`, is read by `MetadataUnpickler`: it finds only the
  classes a DCP `Metadata` is made of, each named below, and sets state only on their instances.
- `engine_state.pt`, `rank<N>_state.pt` and every blob of the `.distcp` files are read by
  `torch.load(weights_only=True)`. fxzero writes only tensors and plain data there (numbers,
  strings, None, lists, tuples, dicts): the RNG states too, Python's as its tuple of ints and
  NumPy's as its key list, so no allow-list of fxzero's own types is needed; `check_plain` holds
  every save to that (a file that cannot be loaded safely is never written).
- The user's own objects are the exception: a `client_state` value, or the state of an LR
  scheduler of the user's own, may be any Python object. Each `client_state` entry, and the
  scheduler's state, is saved as its own pickle (`pickled`: a uint8 tensor in engine_state.pt)
  and `unpickled` tries it with weights_only first (plain data needs nothing more); one that needs more (an instance of the user's class) loads only with
  `load_checkpoint(..., trust_client_state=True)`, and without it the load is an error naming
  the entry and what unpickling it would call, before any state is replaced.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

from fxzero.runtime.checkpoint.files import CheckpointError

__all__ = ["MetadataUnpickler", "TRUST", "check_plain", "load_metadata", "load_plain", "pickled", "unpickled"]

TRUST = "load_checkpoint(..., trust_client_state=True)"
"""The opt-in that lets the user's own objects be unpickled (named in every refusal)."""

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (list, tuple, dict)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_DCP = "torch.distributed.checkpoint"
_METADATA_CLASSES = frozenset({
    (f"{_DCP}.metadata", "Metadata"), (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"), (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"), (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "StorageMeta"), (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # TensorProperties.layout: a name looked up among torch's layouts
})
_BUILT = (dcp.Metadata, dcp.MetadataIndex, dcp.TensorStorageMetadata, dcp.BytesStorageMetadata,
          dcp.ChunkStorageMetadata, dcp.TensorProperties, dcp.StorageMeta, _StorageInfo)
"""What a BUILD may set state on: instances of DCP's Metadata classes (never a class or function)."""
_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))
"""torch.float32 and its kind pickle by name (TensorProperties.dtype)."""


def _refusal(path: str, what: str, calls: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {what} holds a pickled reference to {calls}, which is not a tensor or plain data: unpickling it "
        "would run code from the file, so it is refused. fxzero writes only tensors and plain data there, so this "
        "file was not written by fxzero or was changed after (its checksum in fxzero.json travels with it and "
        "proves nothing); load a checkpoint from a source you trust")


# -- what fxzero writes: tensors and plain data ---------------------------------------------------

def _first_unplain(obj: Any, where: str, depth: int = 0) -> tuple[str, str] | None:
    if type(obj) in _SCALARS or type(obj) in _TENSORS:
        return None
    if type(obj) in _CONTAINERS and depth < 100:
        if isinstance(obj, dict):
            for key, value in obj.items():
                found = _first_unplain(key, f"{where} key {key!r}", depth + 1) or _first_unplain(
                    value, f"{where}[{key!r}]", depth + 1)
                if found:
                    return found
            return None
        for i, value in enumerate(obj):
            if found := _first_unplain(value, f"{where}[{i}]", depth + 1):
                return found
        return None
    return where, f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_plain(obj: Any, where: str) -> None:
    """Raise naming the first value in `obj` that is not a tensor or plain data (numbers, strings,
    bytes, None, and lists, tuples and dicts of those), which weights_only could not load."""
    found = _first_unplain(obj, where)
    if found is not None:
        raise CheckpointError(f"{found[0]} is a {found[1]}: a checkpoint holds only tensors and plain data there "
                              "(numbers, strings, None, lists, tuples, dicts), so that loading it runs no code")


def load_plain(data: io.BytesIO, path: str, what: str) -> Any:
    """`torch.load(weights_only=True)` of `data`, a blob of file `path`; a pickle that would call
    anything is an error naming the file."""
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError:
        raise _refusal(path, what, _calls(data)) from None
    except Exception as e:  # not a torch.save blob at all
        raise CheckpointError(f"{path}: {what} is not a torch.save blob ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); the checkpoint is damaged") from None


def _calls(data: io.BytesIO) -> str:
    """The globals a refused pickle names (read, not run), for the message."""
    try:
        data.seek(0)
        names = torch.serialization.get_unsafe_globals_in_checkpoint(data)
    except Exception:
        names = []
    return ", ".join(names) if names else "something weights_only does not allow"


# -- the user's own objects ----------------------------------------------------------------------

def pickled(obj: Any) -> torch.Tensor:
    """`obj` as its own torch.save blob (a uint8 tensor), read back by `unpickled`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def unpickled(blob: Any, path: str, what: str, *, trust: bool, other_way: str = "") -> Any:
    """What `pickled` saved: loaded with weights_only; if it needs more, unpickled only when the
    user trusts the checkpoint (`trust`), else an error naming `what`, what unpickling it would
    call, and the opt-in (or `other_way` out)."""
    if not (isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 and blob.dim() == 1):
        raise CheckpointError(f"{path}: {what} is not a saved object (a {type(blob).__name__}); the file is damaged")
    data = io.BytesIO(blob.numpy().tobytes())
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError:
        if not trust:
            raise CheckpointError(
                f"{path}: {what} is not plain data: rebuilding it means unpickling {_calls(data)}, which runs code "
                f"from the file. If you trust where this checkpoint comes from, load it with {TRUST}{other_way}; "
                "plain data (tensors, numbers, strings, None, lists, tuples, dicts) loads without it") from None
    data.seek(0)
    return torch.load(data, weights_only=False)


# -- DCP's index ---------------------------------------------------------------------------------

class _Refused(pickle.UnpicklingError):
    """Something outside DCP's Metadata, named as the message says."""


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's `Metadata` and nothing else: `find_class` gives only the classes it is made
    of (`_METADATA_CLASSES`, torch's dtypes), so a pickle naming any other callable is refused
    before anything is called. The pure-Python unpickler, so that BUILD can be checked too: it
    sets state only on instances of those classes; C's would set attributes on an allowed class
    or function itself (`_get_layout.cache`), for the whole process. (About 0.45 s for an index
    of 6,000 chunks, against 0.04 s unrestricted: small beside reading the chunks.)"""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise _Refused(f"a pickled reference to {module}.{name}")

    def _load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in _BUILT:
            raise _Refused(f"state set on {getattr(target, '__qualname__', type(target).__qualname__)}, not on an "
                           "instance of DCP's Metadata classes")
        pickle._Unpickler.load_build(self)

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _load_build}


def load_metadata(path: str) -> Any:
    """DCP's `Metadata` from `path` (a `.metadata` file), unpickled by `MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f).load()
        except _Refused as e:
            raise CheckpointError(
                f"{path}: holds {e}, outside what DCP's Metadata is made of: unpickling it would run code from the "
                "file (or change torch's own classes), so it is refused. fxzero writes only DCP's Metadata classes there, so "
                "this file was not written by fxzero or was changed after (its checksum in "
                "fxzero.json travels with it and proves nothing); load a checkpoint from a source you trust") from None
        except Exception as e:
            raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata; the checkpoint is damaged")
    return metadata

"""Loading a checkpoint runs no code from it ([Note: loading runs no code] in
fxzero/runtime/checkpoint/safe_load.py).

A payload whose `__reduce__` calls `os.system` to create a marker file is planted in each file
fxzero reads (DCP's `.metadata`, `engine_state.pt`, `rank0_state.pt`, the param groups item in
`__0_0.distcp`), and the manifest's sizes and checksums are rewritten to match, as whoever
planted it would: the load is refused naming the file, the marker is never created, the engine
is left as it was, and plain unpickling of the same bytes does create the marker (the payload is
live). The user's own objects in `client_state` load only with the opt-in; plain data without.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shlex
import shutil

import numpy as np
import pytest
import torch
import xxhash

import fxzero
from fxzero import zoo
from fxzero.runtime import checkpoint
from fxzero.runtime.checkpoint import CheckpointError
from fxzero.runtime.checkpoint.safe_load import load_metadata
from tests.dist.reference import lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(120)

TAG = "global_step1"


class _Payload:
    """Unpickled, it runs a shell command that creates `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


class _Thing:
    """A client object of the user's own (module-level, so pickle finds it by name)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other) -> bool:
        return isinstance(other, _Thing) and other.n == self.n


def _engine():
    with torch.device("meta"):
        model = zoo.build("gpt-tiny", n_blocks=1)
    torch.manual_seed(0)
    state = zoo.build("gpt-tiny", n_blocks=1).state_dict()
    config = fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-3), cost_model=None)
    return fxzero.compile(model, config, state_dict=state)


def _step(engine, seed: int = 5) -> None:
    (x, y), = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, 2, seed=seed)
    engine.backward(lm_loss(engine(x), y))
    engine.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A checkpoint after one step, with plain client_state; its save_dir."""
    save_dir = str(tmp_path_factory.mktemp("saved"))
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(save_dir, client_state={"step": 5, "epoch": 1})
    return save_dir


def _copy(saved: str, tmp_path) -> tuple[str, str]:
    save_dir = str(tmp_path / "copy")
    shutil.copytree(saved, save_dir)
    return save_dir, os.path.join(save_dir, TAG)


def _resign(ckpt: str, chunk: tuple[str, int, bytes] | None = None) -> None:
    """Rewrite fxzero.json's sizes and checksums to match the files (and one chunk) as they are now."""
    path = os.path.join(ckpt, "fxzero.json")
    with open(path) as f:
        manifest = json.load(f)
    for name, info in manifest["files"].items():
        with open(os.path.join(ckpt, name), "rb") as f:
            data = f.read()
        info.update(bytes=len(data), xxh3=xxhash.xxh3_64_hexdigest(data))
    if chunk is not None:
        relpath, offset, blob = chunk
        manifest["chunks"][f"{relpath}@{offset}"] = xxhash.xxh3_64_hexdigest(blob)
    with open(path, "w") as f:
        json.dump(manifest, f)


def _saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _refused_untouched(save_dir: str, match: str, marker: str) -> None:
    """Loading is refused with `match`; no marker; the engine keeps its state and still trains."""
    engine = _engine()
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=match):
        engine.load_checkpoint(save_dir)
    assert not os.path.exists(marker), "loading the checkpoint ran the planted code"
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    _step(engine)  # not a partly replaced engine
    assert engine.global_steps == 1


def test_a_code_payload_in_the_dcp_metadata_is_refused(saved, tmp_path):
    save_dir, ckpt = _copy(saved, tmp_path)
    marker = str(tmp_path / "ran-metadata")
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # (the test's own checkpoint: trusted)
    metadata.planner_data["extra"] = _Payload(marker)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    _resign(ckpt)
    _refused_untouched(save_dir, r"\.metadata: holds a pickled reference to posix\.system, outside what DCP's "
                                 r"Metadata is made of: unpickling it would run code from the file",
                       marker)
    with open(path, "rb") as f:
        pickle.load(f)
    assert os.path.exists(marker)  # the payload is live: plain unpickling runs it


def test_a_code_payload_in_engine_state_is_refused(saved, tmp_path):
    save_dir, ckpt = _copy(saved, tmp_path)
    marker = str(tmp_path / "ran-engine")
    path = os.path.join(ckpt, "engine_state.pt")
    state = torch.load(path, weights_only=True)
    state["grad_norm"] = _Payload(marker)
    with open(path, "wb") as f:
        f.write(_saved_bytes(state))
    _resign(ckpt)
    _refused_untouched(save_dir, r"engine_state\.pt: the file holds a pickled reference to posix\.system, which is "
                                 r"not a tensor or plain data: unpickling it would run code from the file", marker)
    torch.load(path, weights_only=False)
    assert os.path.exists(marker)


def test_a_code_payload_in_a_rank_state_is_refused(saved, tmp_path):
    save_dir, ckpt = _copy(saved, tmp_path)
    marker = str(tmp_path / "ran-rank")
    path = os.path.join(ckpt, "rank0_state.pt")
    state = torch.load(path, weights_only=True)
    state["dataloader"] = _Payload(marker)
    with open(path, "wb") as f:
        f.write(_saved_bytes(state))
    _resign(ckpt)
    _refused_untouched(save_dir, r"rank0_state\.pt: the file holds a pickled reference to posix\.system, which is "
                                 r"not a tensor or plain data: unpickling it would run code from the file", marker)
    torch.load(path, weights_only=False)
    assert os.path.exists(marker)


def test_a_code_payload_in_a_distcp_bytes_item_is_refused(saved, tmp_path):
    """The param groups item, replaced by one carrying the payload, appended to the data file and
    pointed at by the index."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    save_dir, ckpt = _copy(saved, tmp_path)
    marker = str(tmp_path / "ran-item")
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    index = MetadataIndex("optim.param_groups")
    info = metadata.storage_data[index]
    data = os.path.join(ckpt, info.relative_path)
    with open(data, "rb") as f:
        f.seek(info.offset)
        groups = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    groups[0]["lr"] = _Payload(marker)
    blob = _saved_bytes(groups)
    offset = os.path.getsize(data)
    with open(data, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(blob))
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _resign(ckpt, (info.relative_path, offset, blob))
    _refused_untouched(save_dir, r"__0_0\.distcp: item 'optim\.param_groups' holds a pickled reference to "
                                 r"posix\.system, which is not a tensor or plain data: unpickling it would run code",
                       marker)
    torch.load(io.BytesIO(blob), weights_only=False)
    assert os.path.exists(marker)


def test_metadata_unpickler_sets_no_state_on_a_class_or_function(tmp_path):
    """BUILD onto an allowed class or function (not an instance) would change it for the whole
    process: a class attribute, or torch's own layout cache."""
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.serialization import _get_layout

    planted = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nStorageMeta\n"  # the class itself,
               b"N}\x8c\x07planted\x94K\x01s\x86b.")  # BUILD (None, {"planted": 1}): setattr on it
    cache = b"\x80\x04ctorch.serialization\n_get_layout\n}\x8c\x05cache\x94}sb."  # BUILD {"cache": {}}
    for crafted, name in ((planted, "StorageMeta"), (cache, "_get_layout")):
        path = tmp_path / name
        path.write_bytes(crafted)
        with pytest.raises(CheckpointError, match=f"holds state set on {name}, not on an instance of DCP's Metadata "
                                                  "classes, outside what DCP's Metadata is made of: unpickling it would run code"):
            load_metadata(str(path))
    assert not hasattr(StorageMeta, "planted") and _get_layout.cache
    pickle.loads(planted)  # the plain unpickler does it
    assert StorageMeta.planted == 1
    del StorageMeta.planted


def test_client_state_objects_need_the_opt_in_and_plain_data_does_not(tmp_path):
    engine = _engine()
    _step(engine)
    plain = {"step": 5, "epoch": 1, "best": torch.tensor([0.5]), "history": [1.0, None, "x", (2, {"a": b"b"})]}
    engine.save_checkpoint(str(tmp_path / "plain"), client_state=plain)
    path, got = _engine().load_checkpoint(str(tmp_path / "plain"))
    assert got.keys() == plain.keys() and torch.equal(got.pop("best"), plain["best"])
    assert got == {k: v for k, v in plain.items() if k != "best"}

    engine.save_checkpoint(str(tmp_path / "objects"), client_state={"step": 5, "thing": _Thing(3)})
    fresh = _engine()
    with pytest.raises(CheckpointError, match=r"engine_state\.pt: client_state\['thing'\] is not plain data: "
                                              r"rebuilding it means unpickling tests\.passes\.test_checkpoint_safety"
                                              r"\._Thing, which runs code from the file\. If you trust where this "
                                              r"checkpoint comes from, load it with load_checkpoint\(\.\.\., "
                                              r"trust_client_state=True\)"):
        fresh.load_checkpoint(str(tmp_path / "objects"))
    assert fresh.global_steps == 0  # refused before anything was replaced
    # (Engine.load_checkpoint does not pass the keyword yet: the checkpoint module's own call.)
    _, got = checkpoint.load_checkpoint(fresh, str(tmp_path / "objects"), trust_client_state=True)
    assert got == {"step": 5, "thing": _Thing(3)} and fresh.global_steps == 1


def test_a_save_that_could_not_load_safely_is_refused(tmp_path):
    """A param group holding an object (the DCP item must be plain data), client_state not a dict."""
    engine = _engine()
    _step(engine)
    with pytest.raises(TypeError, match=r"\[rank 0\] save_checkpoint\(client_state=...\) takes a dict .* got a list"):
        engine.save_checkpoint(str(tmp_path), client_state=[1])
    engine.optimizer.param_groups[0]["thing"] = _Thing(1)
    with pytest.raises(CheckpointError, match=r"\[rank 0\] the optimizer's param_groups\[0\]\['thing'\] is a "
                                              r"tests\.passes\.test_checkpoint_safety\._Thing: a checkpoint holds only "
                                              r"tensors and plain data there .*; keep only such values in a param group"):
        engine.save_checkpoint(str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing committed (the temporary directory removed)


class _Schedule:
    """An LR scheduler of the user's own whose state holds an object."""

    def __init__(self) -> None:
        self.state = {"thing": _Thing(7)}

    def step(self) -> None:
        pass

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_a_scheduler_state_that_is_not_plain_data_needs_the_opt_in(tmp_path):
    engine = _engine()
    engine.lr_scheduler = _Schedule()
    _step(engine)
    engine.save_checkpoint(str(tmp_path))
    fresh = _engine()
    fresh.lr_scheduler = _Schedule()
    fresh.lr_scheduler.state = {}
    with pytest.raises(CheckpointError, match=r"the LR scheduler's state is not plain data: .* trust_client_state=True\) "
                                              r"\(or skip it: load_lr_scheduler_states=False\)"):
        fresh.load_checkpoint(str(tmp_path))
    fresh.load_checkpoint(str(tmp_path), load_lr_scheduler_states=False)
    assert fresh.lr_scheduler.state == {}
    checkpoint.load_checkpoint(fresh, str(tmp_path), trust_client_state=True)
    assert fresh.lr_scheduler.state == {"thing": _Thing(7)}


def test_every_state_file_loads_with_weights_only_and_rng_states_round_trip(tmp_path):
    engine = _engine()
    _step(engine)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # (NumPy's cached Gaussian is part of its state)
    ckpt = engine.save_checkpoint(str(tmp_path))
    want = (random.random(), np.random.standard_normal(3), torch.rand(3))
    for name in ("engine_state.pt", "rank0_state.pt"):
        torch.load(os.path.join(ckpt, name), weights_only=True)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    _engine().load_checkpoint(str(tmp_path))
    got = (random.random(), np.random.standard_normal(3), torch.rand(3))
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_a_format_1_checkpoint_is_refused_naming_the_way_out(saved, tmp_path):
    save_dir, ckpt = _copy(saved, tmp_path)
    path = os.path.join(ckpt, "fxzero.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["version"] = 1
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match=r"fxzero\.json: format version 1, whose state files are pickled Python "
                                              r"objects .*\(`fxzero export`, which reads only tensors\)"):
        _engine().load_checkpoint(save_dir)
    checkpoint.export_checkpoint(ckpt, str(tmp_path / "export"))  # the way out named
    assert os.path.exists(tmp_path / "export" / "model.safetensors")

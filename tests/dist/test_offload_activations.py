"""`Activations(offload=Nvme(...))` on 2 ranks at ZeRO-3, fp32 ([Note: activations on a tier] in
`fxzero/passes/offload_activations.py`): a Hugging Face GPT-2 with its dropouts trains 10 steps
bit for bit as the resident run does, with recompute "none" and "unit", with the same
collectives; the bytes written to disk leave `memory_report()["activations"]` and show in
`activations_nvme`; every file is gone once read and at the step's end.
"""

from __future__ import annotations

import os

import pytest
import torch

import fxzero
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

CONFIG = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
STEPS = 10


def _files(engine) -> list[str]:
    """The activation files on this rank's directory now (`.fxz`: the NVMe store's)."""
    return sorted(f for f in os.listdir(engine._stash._dir) if f.endswith(".fxz"))


def _train(rank: int, recompute: str, nvme: str | None):
    torch.manual_seed(0)
    state = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG)).state_dict()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    offload = fxzero.Nvme(path=nvme) if nvme is not None else None
    # (offload_min_bytes=0: this model's tensors are 1-64 KiB, under the 1 MiB default)
    activations = fxzero.Activations(recompute=recompute, offload=offload, offload_min_bytes=0)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, activations=activations), state_dict=state)
    torch.manual_seed(100 + rank)  # (each rank's dropout masks, alike in both runs)
    losses, after_forward, files = [], [], []
    for step in range(STEPS):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        after_forward.append({k: v for k, v in engine.memory_report().items() if k.startswith("activations")})
        if offload is not None:
            files.append(len(_files(engine)))
        engine.backward(out.loss)
        if offload is not None:
            files.append(len(_files(engine)))
        engine.step()
        losses.append(out.loss.item())
    moved = {}
    if offload is not None:
        forward = engine.schedule.program("forward").instructions
        moved = {"written": sum(i.bytes for i in forward if i.kind == "offload" and i.state == "activation"),
                 "io": engine.io_report()["activations"]}
    result = losses, engine.full_state_dict(), engine.comm_report(), after_forward, files, moved
    engine.close()
    return result


def _runs(rank: int, world_size: int, nvme: str):
    return {(recompute, on): _train(rank, recompute, nvme if on else None)
            for recompute in ("none", "unit") for on in (False, True)}


def test_nvme_activation_offload_trains_as_the_resident_run_on_two_ranks(tmp_path):
    for rank, runs in enumerate(run_ranks(_runs, 2, str(tmp_path))):
        for recompute in ("none", "unit"):
            want, expected, traffic, resident, _, _ = runs[(recompute, False)]
            got, state, offloaded_traffic, offloaded, files, moved = runs[(recompute, True)]
            assert got == want, (rank, recompute)
            assert all(torch.equal(state[k], expected[k]) for k in expected), (rank, recompute)
            assert offloaded_traffic["all_gather"] == traffic["all_gather"]
            assert offloaded_traffic == traffic
            # After each forward: what went to disk is off the resident count, byte for byte.
            for r, o in zip(resident, offloaded):
                assert r["activations_nvme"] == 0 and o["activations_nvme"] == moved["written"] > 0
                assert o["activations"] == r["activations"] - moved["written"], (rank, recompute)
            # One file per offloaded tensor after the forward, none after the backward.
            assert files[0::2] == [files[0]] * STEPS and files[0] > 0 and files[1::2] == [0] * STEPS
            io = moved["io"]
            assert io["write"]["bytes"] == io["read"]["bytes"] == STEPS * moved["written"]


def _lifecycle(rank: int, world_size: int, nvme: str) -> dict:
    """A world of one: what happens to the files when a forward's backward never runs, when step()
    comes between a forward and its backward, and when a file changes on disk."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    activations = fxzero.Activations(offload=fxzero.Nvme(path=nvme), offload_min_bytes=0)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, activations=activations))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    seen = {}
    out = engine(input_ids=ids, labels=ids, use_cache=False)
    seen["written"] = len(_files(engine))
    del out  # autograd drops the forward: its receipts die, and their files with them
    seen["after_drop"] = (len(_files(engine)), engine.memory_report()["activations_nvme"])
    out = engine(input_ids=ids, labels=ids, use_cache=False)
    try:
        engine.step()
    except RuntimeError as e:
        seen["step"] = str(e)
    seen["after_step"] = len(_files(engine))
    try:
        engine.backward(out.loss)
    except RuntimeError as e:
        seen["backward_after_step"] = str(e)
    out = engine(input_ids=ids, labels=ids, use_cache=False)
    name = _files(engine)[0]
    with open(os.path.join(engine._stash._dir, name), "r+b") as f:  # one byte of its data changed
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        engine.backward(out.loss)
    except Exception as e:  # noqa: BLE001 (what the read raised, whatever its type)
        seen["changed_file"] = f"{type(e).__name__}: {e}"
    engine.close()
    return seen


def test_files_go_when_a_forward_is_dropped_at_the_step_and_a_changed_file_is_an_error(tmp_path):
    (seen,) = run_ranks(_lifecycle, 1, str(tmp_path))
    assert seen["written"] > 0 and seen["after_drop"] == (0, 0)
    assert "no gradient" in seen["step"] and seen["after_step"] == 0
    assert "no longer on the nvme tier" in seen["backward_after_step"]
    assert "run the backward before step()" in seen["backward_after_step"]
    assert "checksum mismatch" in seen["changed_file"], seen["changed_file"]


def _zoo_gpt(rank: int, world_size: int, nvme: str | None) -> tuple:
    """The zoo GPT (scaled-dot-product attention, whose output is transposed) on one rank."""
    import torch.nn.functional as F

    from fxzero.zoo import gpt

    torch.manual_seed(0)
    model = gpt("tiny")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    offload = fxzero.Nvme(path=nvme) if nvme is not None else None
    activations = fxzero.Activations(offload=offload, offload_min_bytes=0)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, activations=activations), state_dict=state)
    losses = []
    for step in range(4):
        ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(step))
        loss = F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    forward = engine.schedule.program("forward")
    graph = {n.name: n for n in engine.program.programs["forward"].gm.graph.nodes}
    transposed = [i.reads[0] for i in forward.instructions if i.kind == "offload" and i.state == "activation"
                  and not graph[i.reads[0]].meta["val"].is_contiguous()]
    result = losses, engine.full_state_dict(), transposed
    engine.close()
    return result


def test_a_transposed_tensor_comes_back_in_its_layout(tmp_path):
    (resident,), (offloaded,) = run_ranks(_zoo_gpt, 1, None), run_ranks(_zoo_gpt, 1, str(tmp_path))
    assert offloaded[2]  # (the attention outputs: offloaded in their transposed layout)
    assert offloaded[0] == resident[0]
    assert all(torch.equal(offloaded[1][k], resident[1][k]) for k in resident[1])

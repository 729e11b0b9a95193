"""`Tiling` on 2 ranks at ZeRO-3, fp32: a model with a wide Linear (4096 x 1024, 16 MiB) under
`Tiling(max_bytes=2 MiB)` trains as the untiled run does, within 1e-6 (SGD: AdamW's update
divides by each gradient's own scale, so it turns the input gradient's reordered sum, 1e-7
relative, into parameter differences of 2.4e-5 after 5 steps at lr 1e-3 where a gradient is near
zero; the losses are compared under AdamW too), with every gathered
buffer within max_bytes plus the largest other unit; its parameter keeps its name and shape in
the state dict and the module ([Note: tiling] in `fxzero/passes/tile.py`). tools/tiling.py runs
the full shape (32768 x 4096, 512 MiB, max_bytes 64 MiB) and times it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import fxzero
from tests.dist.harness import run_ranks, train

pytestmark = pytest.mark.timeout(300)

D_IN, HIDDEN, OUT = 64, 1024, 4096
MAX_BYTES = 2 << 20
STEPS = 5


class WideHead(nn.Module):
    """A small trunk and a wide output Linear: the head is 16 MiB, every other weight under 1 MiB."""

    def __init__(self, d_in: int = D_IN, hidden: int = HIDDEN, out: int = OUT) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 64), nn.GELU(), nn.Linear(64, hidden))
                                    for _ in range(2))
        self.head = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, D_IN, generator=g), torch.randint(0, OUT, (4, 8), generator=g)) for _ in range(STEPS)]


def _run(rank: int, world_size: int, tiling, optimizer):
    torch.manual_seed(0)
    model = WideHead()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = fxzero.compile(model, fxzero.Config(stage=3, tiling=tiling, optimizer=optimizer, cost_model=None), state_dict=state)
    losses = train(engine, _batches(), _loss, rank, world_size)
    units = {u.name: u.padded_numel * u.itemsize for u in engine.layouts}
    report = engine.memory_report()
    full = engine.full_state_dict()
    module_state = engine.module.state_dict()
    return losses, full, module_state, report["gathered_peak"], units


def _both(rank: int, world_size: int, optimizer):
    return _run(rank, world_size, None, optimizer), _run(rank, world_size, fxzero.Tiling(max_bytes=MAX_BYTES), optimizer)


def test_tiled_head_losses_under_adamw_equal_untiled_within_1e_6():
    for rank, (plain, tiled) in enumerate(run_ranks(_both, 2, fxzero.AdamW(lr=1e-3))):
        torch.testing.assert_close(torch.tensor(tiled[0]), torch.tensor(plain[0]), rtol=1e-6, atol=0)


def test_tiled_head_trains_as_untiled_on_two_ranks_within_its_bound():
    for rank, (plain, tiled) in enumerate(run_ranks(_both, 2, fxzero.SGD(lr=0.1))):
        losses, full, _, peak, _ = plain
        t_losses, t_full, t_module_state, t_peak, t_units = tiled
        # The head's weight is 16 tiles of 256 rows (1 MiB each: max_bytes // 2), each its own unit.
        tiles = sorted(u for u in t_units if u.startswith("head.weight:tile"))
        assert len(tiles) == 16 and all(t_units[u] == 256 * HIDDEN * 4 for u in tiles)
        # Parity: the input's gradient sums the tiles' products in another order (1e-6).
        torch.testing.assert_close(torch.tensor(t_losses), torch.tensor(losses), rtol=1e-6, atol=0)
        for key in full:
            assert t_full[key].shape == full[key].shape, key
            torch.testing.assert_close(t_full[key], full[key], rtol=0, atol=1e-6, msg=key)
        # The user's parameter keeps its name and full shape in the module's state dict.
        assert t_module_state["head.weight"].shape == (OUT, HIDDEN)
        torch.testing.assert_close(t_module_state["head.weight"], t_full["head.weight"], rtol=0, atol=0)
        # Gathered peak: the untiled run gathers the whole head; the tiled one stays within the bound.
        largest_other = max(b for u, b in t_units.items() if u not in tiles)
        assert peak >= OUT * HIDDEN * 4, (rank, peak)
        assert t_peak <= MAX_BYTES + largest_other, (rank, t_peak, MAX_BYTES + largest_other)


def _surfaces(rank: int, world_size: int, root: str):
    """A tiled run's parameter, gradient and optimizer state as the user reads them, its checkpoint
    loaded by an untiled engine and the untiled one's by a tiled engine, and its export."""
    from fxzero.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    def engine(tiling):
        torch.manual_seed(0)
        return fxzero.compile(WideHead(), fxzero.Config(stage=3, tiling=tiling, cost_model=None))

    tiled, plain = engine(fxzero.Tiling(max_bytes=MAX_BYTES)), engine(None)
    out = {}
    for name, e in (("tiled", tiled), ("plain", plain)):  # (one step: Adam's first update is sign(g) x lr)
        x, y = _batches()[0]
        e.backward(_loss(e(x[rank::world_size]), y[rank::world_size]))
        w = e.module.head.weight
        out[name] = {"shape": tuple(w.shape), "param": safe_get_full_fp32_param(w), "grad": safe_get_full_grad(w)}
        e.step()
        out[name].update(exp_avg=safe_get_full_optimizer_state(w, "exp_avg"), full=e.full_state_dict()["head.weight"],
                         after=safe_get_full_fp32_param(w))
        e.save_checkpoint(os.path.join(root, name), tag="t")
    path = tiled.save_16bit_model(os.path.join(root, "export"))
    exported = torch.load(path)["head.weight"] if path is not None else None
    tiled_state = tiled.full_state_dict()
    plain_state = plain.full_state_dict()
    moved = {}
    for name, e, source in (("into_plain", engine(None), "tiled"), ("into_tiled", engine(fxzero.Tiling(max_bytes=MAX_BYTES)), "plain")):
        e.load_checkpoint(os.path.join(root, source), tag="t")
        moved[name] = (e.full_state_dict(), safe_get_full_optimizer_state(e.module.head.weight, "exp_avg"))
    return out, exported, tiled_state, plain_state, moved, {
        "tiled": safe_get_full_optimizer_state(tiled.module.head.weight, "exp_avg"),
        "plain": safe_get_full_optimizer_state(plain.module.head.weight, "exp_avg")}


def test_a_tiled_parameter_keeps_its_name_and_shape_in_every_user_view(tmp_path):
    for rank, (out, exported, tiled_state, plain_state, moved, exp_avg) in enumerate(
            run_ranks(_surfaces, 2, str(tmp_path))):
        t, p = out["tiled"], out["plain"]
        assert t["shape"] == p["shape"] == (OUT, HIDDEN)
        assert torch.equal(t["param"], p["param"])  # (the same initial values)
        for key in ("grad", "exp_avg"):  # (the head's gradient is exact; upstream of it, 1e-6 of the scale)
            assert t[key].shape == (OUT, HIDDEN), key
            torch.testing.assert_close(t[key], p[key], rtol=0, atol=1e-6 * p[key].abs().max().item(), msg=key)
        assert torch.equal(t["after"], t["full"])
        if rank == 0:
            assert torch.equal(exported, tiled_state["head.weight"])
        # A checkpoint is keyed by the parameter, whole: tiled and untiled engines load each other's.
        state, m = moved["into_plain"]
        assert all(torch.equal(state[k], tiled_state[k]) for k in tiled_state)
        assert torch.equal(m, exp_avg["tiled"])
        state, m = moved["into_tiled"]
        assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)
        assert torch.equal(m, exp_avg["plain"])


class TiedLM(nn.Module):
    """A GPT-style tied embedding and LM head, 4096 x 256 (4 MiB), around a small block."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 256)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(256, 64), nn.GELU(), nn.Linear(64, 256))])
        self.head = nn.Linear(256, 4096, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h + self.blocks[0](h))


def _tied(rank: int, world_size: int):
    g = torch.Generator().manual_seed(2)
    batches = [(ids[:, :-1], ids[:, 1:]) for ids in (torch.randint(0, 4096, (4, 9), generator=g) for _ in range(STEPS))]
    out = {}
    for name, tiling in (("plain", None), ("tiled", fxzero.Tiling(max_bytes=1 << 20))):
        torch.manual_seed(0)
        engine = fxzero.compile(TiedLM(), fxzero.Config(stage=3, tiling=tiling, optimizer=fxzero.SGD(lr=0.1),
                                                        cost_model=None))
        losses = train(engine, batches, _loss, rank, world_size)
        units = {u.name: u.padded_numel * u.itemsize for u in engine.layouts}
        out[name] = losses, engine.full_state_dict(), engine.memory_report()["gathered_peak"], units
    return out


def test_a_tied_embedding_and_lm_head_train_tiled_as_untiled_on_two_ranks():
    for rank, out in enumerate(run_ranks(_tied, 2)):
        losses, full, _, _ = out["plain"]
        t_losses, t_full, t_peak, t_units = out["tiled"]
        assert sorted(u for u in t_units if ":tile" in u) == [f"emb.weight:tile{i}" for i in range(8)]
        torch.testing.assert_close(torch.tensor(t_losses), torch.tensor(losses), rtol=1e-6, atol=0)
        for key in full:
            torch.testing.assert_close(t_full[key], full[key], rtol=0, atol=1e-6, msg=key)
        assert t_full["head.weight"] is t_full["emb.weight"] or torch.equal(t_full["head.weight"], t_full["emb.weight"])
        assert t_peak <= (1 << 20) + max(b for u, b in t_units.items() if ":tile" not in u)

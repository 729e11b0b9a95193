"""Parity of the fxzero engine with eager fp32 references, on 1, 2 and 4 gloo ranks.

For each world size, ONE spawn of `run_ranks` trains every selected (stage, model) pair in
turn, so process start-up and imports are paid once per world rather than once per test:

- GPT "tiny" (tied head, 4 blocks) against one eager model over the whole global batch
  (`reference.eager_gpt_reference`): each step's loss is the mean over ranks of the local
  losses, which equals the global-batch loss; final parameters from rank 0's full state dict.
- The CNN against an in-process emulation of DDP with broadcast_buffers=False
  (`reference.eager_cnn_reference`): each rank's own losses, and each rank's full state dict,
  since the BatchNorm running statistics differ by rank.

Every test in a world shares that world's run (a module-scoped fixture). A failure anywhere in
the run therefore fails all of that world's tests with the same rank traceback; to rerun one
pair alone, select it, e.g. `pytest tests/dist/test_parity.py -k "world2 and stage3 and gpt"`:
the run trains only the pairs that the selected tests need.

Tolerances: losses to rtol 1e-5, parameters and buffers to atol 1e-5. A correct engine sits
far inside them (a traced, aten-level re-implementation of these loops, on 1, 2 and 4
emulated ranks with other thread counts, agrees with the references to ~3e-7), and the zoo
models avoid parameters whose gradient is identically zero (see `fxzero/zoo/`), since Adam
would turn their rounding noise into +-lr differences.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero import zoo
from tests.dist.harness import run_ranks
from tests.dist.reference import (
    clone_state_dict,
    eager_cnn_reference,
    eager_gpt_reference,
    make_cnn_batches,
    make_gpt_batches,
    rank_slice,
)

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 10
GLOBAL_BATCH = 8
WORLDS = (1, 2, 4)
STAGES = (1, 2, 3)
MODELS = ("gpt", "cnn")
LOSS_RTOL = 1e-5
STATE_ATOL = 1e-5
# One world trains 3 stages x 2 models, compile included, with up to 4 ranks on 2 cores.
WORLD_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model's training problem, identical for the engine and its reference."""

    name: str
    model_fn: Callable[[], nn.Module]
    """Builds the model on the current default device (module-level, so ranks can unpickle it)."""
    state_dict: dict[str, torch.Tensor]
    """Initial weights and buffers: `torch.manual_seed(0); model_fn()` built eagerly."""
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    """Global batches (x, y), one per step."""


def _loss(name: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return F.cross_entropy(logits, y)


@functools.cache
def _workloads() -> dict[str, Workload]:
    def initial(model_fn):
        torch.manual_seed(0)
        return clone_state_dict(model_fn())

    gpt_fn = functools.partial(zoo.build, "gpt-tiny")
    cnn_fn = functools.partial(zoo.build, "cnn")
    gpt_batches = make_gpt_batches(zoo.GPT_SIZES["tiny"], STEPS, GLOBAL_BATCH, seed=1)
    cnn_batches = make_cnn_batches(STEPS, GLOBAL_BATCH, seed=2)
    return {
        "gpt": Workload("gpt", gpt_fn, initial(gpt_fn), gpt_batches),
        "cnn": Workload("cnn", cnn_fn, initial(cnn_fn), cnn_batches),
    }


@functools.cache
def _gpt_reference() -> dict[str, Any]:
    wl = _workloads()["gpt"]
    return eager_gpt_reference(wl.model_fn, wl.state_dict, wl.batches, ADAMW)


@functools.cache
def _cnn_reference(world_size: int) -> dict[str, Any]:
    wl = _workloads()["cnn"]
    return eager_cnn_reference(wl.model_fn, wl.state_dict, wl.batches, world_size, ADAMW)


# ---------------------------------------------------------------------------------------------
# What every rank runs


def _report_kind(report: Callable[[], Any]) -> str:
    # Reports are checked by their own test; a broken one must not hide the parity results.
    try:
        return type(report()).__name__
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {e}"


def _train_one(rank: int, world_size: int, stage: int, wl: Workload) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = fxzero.Config(stage=stage, optimizer=fxzero.AdamW(**ADAMW))
    with torch.device("meta"):
        model = wl.model_fn()
    engine = fxzero.compile(model, config=cfg, state_dict=wl.state_dict)

    losses = []
    for x, y in wl.batches:
        logits = engine(rank_slice(x, rank, world_size))
        loss = _loss(wl.name, logits, rank_slice(y, rank, world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().reshape(()).cpu().clone())
    losses = torch.stack(losses)

    full = engine.full_state_dict()  # collective: every rank calls it
    kinds = {
        "memory_report": _report_kind(engine.memory_report),
        "comm_report": _report_kind(lambda: engine.comm_report(reset=True)),
    }

    keep_state = True
    if wl.name == "gpt":
        # Equal micro-batches: the mean of the local mean losses is the global-batch loss.
        if world_size > 1:
            dist.all_reduce(losses)
            losses /= world_size
        keep_state = rank == 0  # parameters are the same everywhere; send back one copy
    state = {k: v.detach().cpu().clone() for k, v in full.items()} if keep_state else None
    return {"losses": losses.tolist(), "state_dict": state, "reports": kinds}


def _train_all(
    rank: int, world_size: int, pairs: list[tuple[int, str]], workloads: dict[str, Workload]
) -> dict[tuple[int, str], dict[str, Any]]:
    out = {}
    for stage, name in pairs:
        out[(stage, name)] = _train_one(rank, world_size, stage, workloads[name])
        if world_size > 1:
            # Start the next engine only when every rank has finished with this one.
            dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# Fixtures


@dataclasses.dataclass(frozen=True)
class WorldRun:
    world_size: int
    per_rank: list[dict[tuple[int, str], dict[str, Any]]]

    def get(self, rank: int, stage: int, model: str) -> dict[str, Any]:
        return self.per_rank[rank][(stage, model)]


def _selected_pairs(request: pytest.FixtureRequest, world_size: int) -> list[tuple[int, str]]:
    """The (stage, model) pairs that the selected tests of this module need on this world."""
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or getattr(item, "module", None) is not request.module:
            continue
        params = callspec.params
        if params.get("world_run") == world_size and "stage" in params and "model" in params:
            wanted.add((params["stage"], params["model"]))
    return [p for p in itertools.product(STAGES, MODELS) if p in wanted] or list(
        itertools.product(STAGES, MODELS)
    )


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_run(request: pytest.FixtureRequest) -> WorldRun:
    world_size = request.param
    pairs = _selected_pairs(request, world_size)
    per_rank = run_ranks(_train_all, world_size, pairs, _workloads(), timeout_s=WORLD_TIMEOUT_S)
    return WorldRun(world_size, per_rank)


stage_param = pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage{s}")
model_param = pytest.mark.parametrize("model", MODELS)


# ---------------------------------------------------------------------------------------------
# Tests


def _assert_losses(got: list[float], want: list[float], what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
        msg=lambda m: f"{what}: per-step losses differ from the eager reference\n"
        f"got  {got}\nwant {want}\n{m}",
    )


def _assert_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got is not None, f"{what}: no full_state_dict came back"
    assert set(got) == set(want), (
        f"{what}: full_state_dict keys differ from model.state_dict(): "
        f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}"
    )
    for key in want:
        torch.testing.assert_close(
            got[key],
            want[key],
            rtol=0,
            atol=STATE_ATOL,
            msg=lambda m, key=key: f"{what}: {key!r} differs from the eager reference\n{m}",
        )


@model_param
@stage_param
def test_losses_match_eager(world_run: WorldRun, stage: int, model: str) -> None:
    w = world_run.world_size
    if model == "gpt":
        got = world_run.get(0, stage, model)["losses"]
        _assert_losses(got, _gpt_reference()["losses"], f"gpt stage {stage} world {w}")
    else:
        ref = _cnn_reference(w)["losses"]
        for rank in range(w):
            got = world_run.get(rank, stage, model)["losses"]
            want = [step[rank] for step in ref]
            _assert_losses(got, want, f"cnn stage {stage} world {w} rank {rank}")


@model_param
@stage_param
def test_final_state_matches_eager(world_run: WorldRun, stage: int, model: str) -> None:
    w = world_run.world_size
    if model == "gpt":
        got = world_run.get(0, stage, model)["state_dict"]
        _assert_state(got, _gpt_reference()["state_dict"], f"gpt stage {stage} world {w}")
    else:
        ref = _cnn_reference(w)["state_dicts"]
        for rank in range(w):
            got = world_run.get(rank, stage, model)["state_dict"]
            _assert_state(got, ref[rank], f"cnn stage {stage} world {w} rank {rank}")


@model_param
@stage_param
def test_reports_are_dicts(world_run: WorldRun, stage: int, model: str) -> None:
    for rank in range(world_run.world_size):
        kinds = world_run.get(rank, stage, model)["reports"]
        assert kinds == {"memory_report": "dict", "comm_report": "dict"}, (
            f"rank {rank}, stage {stage}, {model}: reports should be dicts, got {kinds}"
        )


def test_references_are_self_consistent() -> None:
    """The references themselves: no engine involved, so this runs without fxzero.compile."""
    gpt = _gpt_reference()
    assert len(gpt["losses"]) == STEPS and all(torch.isfinite(torch.tensor(gpt["losses"])))
    sd = gpt["state_dict"]
    assert torch.equal(sd["wte.weight"], sd["lm_head.weight"]), "tied head must stay tied"
    assert set(sd) == set(_workloads()["gpt"].state_dict)

    for w in WORLDS:
        ref = _cnn_reference(w)
        assert len(ref["losses"]) == STEPS and all(len(step) == w for step in ref["losses"])
        first = ref["state_dicts"][0]
        for rank, other in enumerate(ref["state_dicts"][1:], start=1):
            for key, value in first.items():
                if "running_" in key or "num_batches_tracked" in key:
                    continue
                assert torch.equal(value, other[key]), f"world {w}: rank {rank} {key} drifted"
            assert not torch.equal(
                first["features.0.bn.running_mean"], other["features.0.bn.running_mean"]
            ), "BatchNorm statistics should follow each rank's own micro-batches"
    # A world of one is plain training on the global batch.
    _assert_state(
        _cnn_reference(1)["state_dicts"][0],
        _plain_cnn_training(),
        "cnn reference, world of one vs a plain loop",
    )


def _plain_cnn_training() -> dict[str, torch.Tensor]:
    wl = _workloads()["cnn"]
    model = wl.model_fn()
    model.load_state_dict(wl.state_dict)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for x, y in wl.batches:
        _loss("cnn", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return clone_state_dict(model)

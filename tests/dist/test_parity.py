"""Parity of the fxzero engine with eager fp32 references, on 1, 2 and 4 gloo ranks.

For each world size, ONE spawn of `run_ranks` trains every selected (stage, model) pair in
turn, so process start-up and imports are paid once per world rather than once per test:

- GPT "tiny" (tied head, 4 blocks) against one eager model over the whole global batch
  (`reference.eager_gpt_reference`): each step's loss is the mean over ranks of the local
  losses, which equals the global-batch loss; final parameters from rank 0's full state dict.
- The CNN against an in-process emulation of DDP with broadcast_buffers=False
  (`reference.eager_cnn_reference`): each rank's own losses, and each rank's full state dict,
  since the BatchNorm running statistics differ by rank.

Collectives: every run pins its cost model, so what runs never depends on a timing measurement
(`Config.cost_model="measure"` would let a calibration decide whether each reduce-scatter runs
natively or as an all-reduce and a slice). The parity runs use `cost_model=None` (native
reduce-scatters); on 2 and 4 ranks the GPT also trains at every stage under `VIA_ALL_REDUCE`, a
hand-built cost model that prices all-reduce far under reduce-scatter, so that every
reduce-scatter runs as an all-reduce, against the same reference and tolerances.

Every test in a world shares that world's run (a module-scoped fixture). A failure anywhere in
the run therefore fails all of that world's tests with the same rank traceback; to rerun one
pair alone, select it, e.g. `pytest tests/dist/test_parity.py -k "world2 and stage3 and gpt"`:
the run trains only the runs that the selected tests need.

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

import fxzero
from fxzero import zoo
from fxzero.cost import CostModel, Link
from tests.dist.harness import ADAMW, run_ranks, train
from tests.dist.reference import (
    classification_loss,
    clone_state_dict,
    eager_cnn_reference,
    eager_gpt_reference,
    lm_loss,
    make_cnn_batches,
    make_gpt_batches,
)

STEPS = 10
GLOBAL_BATCH = 8
WORLDS = (1, 2, 4)
STAGES = (1, 2, 3)
MODELS = ("gpt", "cnn")
LOSS_RTOL = 1e-5
STATE_ATOL = 1e-5
# One world trains 3 stages x 2 models (and the GPT once more per stage with every
# reduce-scatter via all-reduce), compile included, with up to 4 ranks on 2 cores.
WORLD_TIMEOUT_S = 900
NATIVE, VIA = "native", "via_all_reduce"
VIA_ALL_REDUCE = CostModel(
    name="all-reduce-far-cheaper", flops_per_s=1e12, mem_bytes_per_s=1e11,
    links={
        "all_gather": Link(bandwidth=1e9, latency=1e-5),
        "reduce_scatter": Link(bandwidth=1e6, latency=1.0),
        "all_reduce": Link(bandwidth=1e12, latency=1e-9),
    },
)
"""All-reduce priced ~1e-6 x reduce-scatter at every size: `choose_collectives` (all-reduce when
it is under 0.9 x the native reduce-scatter) turns every reduce-scatter into an all-reduce."""
COST_MODELS = {NATIVE: None, VIA: VIA_ALL_REDUCE}


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


LOSSES = {"gpt": lm_loss, "cnn": classification_loss}


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


def _train_one(rank: int, world_size: int, stage: int, wl: Workload, collectives: str) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = fxzero.Config(stage=stage, optimizer=fxzero.AdamW(**ADAMW), cost_model=COST_MODELS[collectives])
    with torch.device("meta"):
        model = wl.model_fn()
    engine = fxzero.compile(model, config=cfg, state_dict=wl.state_dict)
    # Equal micro-batches and no buffers (GPT): the mean of the local losses is the global loss.
    losses = train(engine, wl.batches, LOSSES[wl.name], rank, world_size, mean_over_ranks=wl.name == "gpt")
    full = engine.full_state_dict()  # collective: every rank calls it
    # Parameters are the same everywhere for the GPT; send back one copy. The CNN's buffers differ.
    keep_state = wl.name != "gpt" or rank == 0
    state = {k: v.detach().cpu().clone() for k, v in full.items()} if keep_state else None
    algorithms = [i.algorithm for _, i in engine.schedule.collectives() if i.kind == "reduce_scatter"]
    return {"losses": losses, "state_dict": state, "algorithms": algorithms, "comm": engine.comm_report()}


def _train_all(
    rank: int, world_size: int, runs: list[tuple[int, str, str]], workloads: dict[str, Workload]
) -> dict[tuple[int, str, str], dict[str, Any]]:
    out = {}
    for stage, name, collectives in runs:
        out[(stage, name, collectives)] = _train_one(rank, world_size, stage, workloads[name], collectives)
        if world_size > 1:
            # Start the next engine only when every rank has finished with this one.
            dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# Fixtures


@dataclasses.dataclass(frozen=True)
class WorldRun:
    world_size: int
    per_rank: list[dict[tuple[int, str, str], dict[str, Any]]]

    def get(self, rank: int, stage: int, model: str, collectives: str = NATIVE) -> dict[str, Any]:
        return self.per_rank[rank][(stage, model, collectives)]


def _all_runs(world_size: int) -> list[tuple[int, str, str]]:
    runs = [(stage, model, NATIVE) for stage, model in itertools.product(STAGES, MODELS)]
    if world_size > 1:  # a world of one has no reduce-scatter to choose an algorithm for
        runs += [(stage, "gpt", VIA) for stage in STAGES]
    return runs


def _selected_runs(request: pytest.FixtureRequest, world_size: int) -> list[tuple[int, str, str]]:
    """The (stage, model, collectives) runs that the selected tests of this module need."""
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or getattr(item, "module", None) is not request.module:
            continue
        params = callspec.params
        if params.get("world_run") == world_size and "stage" in params and "model" in params:
            wanted.add((params["stage"], params["model"], params.get("collectives", NATIVE)))
    runs = _all_runs(world_size)
    return [r for r in runs if r in wanted] or runs


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_run(request: pytest.FixtureRequest) -> WorldRun:
    world_size = request.param
    runs = _selected_runs(request, world_size)
    per_rank = run_ranks(_train_all, world_size, runs, _workloads(), timeout_s=WORLD_TIMEOUT_S)
    return WorldRun(world_size, per_rank)


stage_param = pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage{s}")
model_param = pytest.mark.parametrize("model", MODELS)
# The via-all-reduce runs exist on the worlds with more than one rank (same fixture, same spawn).
multi_rank_world = pytest.mark.parametrize("world_run", [w for w in WORLDS if w > 1], indirect=True,
                                           ids=lambda w: f"world{w}")


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
def test_native_runs_use_native_reduce_scatters(world_run: WorldRun, stage: int, model: str) -> None:
    """cost_model=None: nothing is chosen, every reduce-scatter runs natively."""
    for rank in range(world_run.world_size):
        run = world_run.get(rank, stage, model)
        assert run["algorithms"] and set(run["algorithms"]) == {""}, (
            f"rank {rank}, stage {stage}, {model}: reduce-scatter algorithms {run['algorithms']}"
        )
        rs = run["comm"].get("reduce_scatter", {})
        assert rs.get("calls", 0) > 0 and rs["via_all_reduce"] == 0, f"rank {rank}: {run['comm']}"


@multi_rank_world
@pytest.mark.parametrize("collectives", [VIA])
@pytest.mark.parametrize("model", ["gpt"])
@stage_param
def test_reduce_scatter_via_all_reduce_matches_eager(
    world_run: WorldRun, stage: int, model: str, collectives: str
) -> None:
    """Every reduce-scatter as an all-reduce and a slice: the same results as the native path."""
    w = world_run.world_size
    what = f"gpt stage {stage} world {w}, reduce-scatter via all-reduce"
    for rank in range(w):
        run = world_run.get(rank, stage, model, collectives)
        assert run["algorithms"] and set(run["algorithms"]) == {"all_reduce"}, (
            f"{what}, rank {rank}: the schedule's reduce-scatter algorithms are {run['algorithms']}"
        )
        rs = run["comm"]["reduce_scatter"]
        # Carried out as chosen: every logical reduce-scatter of every step went via all-reduce.
        assert rs["calls"] == len(run["algorithms"]) * STEPS and rs["via_all_reduce"] == rs["calls"], (
            f"{what}, rank {rank}: {rs}"
        )
    got = world_run.get(0, stage, model, collectives)
    ref = _gpt_reference()
    _assert_losses(got["losses"], ref["losses"], what)
    _assert_state(got["state_dict"], ref["state_dict"], what)


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
        classification_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return clone_state_dict(model)

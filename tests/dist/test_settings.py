"""Settings the README promises, and initialization from the layers' own reset_parameters().

One spawn per world trains and inspects everything below in turn (the world of 4 only
initializes):

- initialization: a meta model compiled without a state_dict under `Config(seed=s)` holds, on
  every rank and at stages 1 (units whole on every rank) and 3 (sharded), exactly the values of
  the same model built eagerly after `torch.manual_seed(s)`; a second seed gives other values;
- `transport="process_group"`: torch.distributed's collectives, not shared memory, and
  training matches the eager reference;
- `link_emulation`: results bit for bit those of the same run without it, and each step lasts
  at least what the emulator's own formula gives its collectives (a lower bound the emulator
  promises: it sleeps until each collective's deadline, and the link is busy until the
  previous one's; see `fxzero/runtime/comm/link.py`), next to a direct test of that arithmetic;
- `keep_host_memory=True`: glibc stops returning large blocks with mmap (process-wide, hence
  run last in its spawned rank) and training matches the eager reference bit for bit with the
  run without it;
- `memory_report()`'s "persistent_params" (units held whole: all at stages 1-2, those under
  `persist_threshold` at stage 3) and "buffers", against formulas from the models' shapes.

Every engine pins `cost_model=None` (native reduce-scatters). Tolerances against eager: losses
rtol 1e-5, states atol 1e-5, as in test_parity.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxzero
from fxzero import zoo
from fxzero.runtime import host_memory
from fxzero.runtime.comm import Comm, Pending, ShmComm
from fxzero.runtime.comm.link import EmulatedLink
from tests.dist.harness import ADAMW, run_ranks, train
from tests.dist.reference import (
    classification_loss,
    clone_state_dict,
    default_unit_numels,
    eager_gpt_reference,
    lm_loss,
    make_cnn_batches,
    make_gpt_batches,
    padded_numel,
)

WORLDS = (2, 4)
SETTINGS_WORLD = 2
INIT_MODELS = ("gpt-tiny", "cnn")
INIT_STAGES = (1, 3)
SEEDS = (7, 8)  # not the default seed 0
STEPS = 3
LOSS_RTOL = 1e-5
STATE_ATOL = 1e-5
# The emulated link: slow enough that one step's collectives take over 0.3 s (a step takes
# about 0.05 s without emulation).
LINK = fxzero.LinkEmulation(bandwidth=1e6, latency=0.01)
# Stage 3 thresholds: the CNN's root (its head, 170 parameters) and the GPT's root (3,584) and
# tail (64) stay whole; every other unit is larger and sharded.
CNN_THRESHOLD = 200
GPT_THRESHOLD = 5000


@functools.cache
def _gpt_workload() -> tuple[dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    initial = clone_state_dict(zoo.build("gpt-tiny"))
    return initial, make_gpt_batches(zoo.GPT_SIZES["tiny"], STEPS, global_batch=8, seed=11)


@functools.cache
def _gpt_reference() -> dict[str, Any]:
    initial, batches = _gpt_workload()
    return eager_gpt_reference(functools.partial(zoo.build, "gpt-tiny"), initial, batches, ADAMW)


@functools.cache
def _eager_init(name: str, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return clone_state_dict(zoo.build(name))


# ---------------------------------------------------------------------------------------------
# What every rank runs


def _init(rank: int, world_size: int) -> dict[tuple[str, int, int], dict[str, torch.Tensor]]:
    out = {}
    for name in INIT_MODELS:
        for stage in INIT_STAGES:
            for seed in SEEDS:
                with torch.device("meta"):
                    model = zoo.build(name)
                engine = fxzero.compile(model, fxzero.Config(stage=stage, seed=seed, cost_model=None))
                out[(name, stage, seed)] = engine.full_state_dict()  # a collective
    return out


def _gpt_run(rank: int, world_size: int, **config: Any) -> dict[str, Any]:
    """Train gpt-tiny at stage 3 from the shared initial state; step end times on the side."""
    initial, batches = _gpt_workload()
    cfg = fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None, prefetch=None, **config)
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    engine = fxzero.compile(model, cfg, state_dict=initial)
    ends: list[float] = []
    losses = train(engine, batches, lm_loss, rank, world_size, mean_over_ranks=True,
                   after_step=lambda i: ends.append(time.monotonic()))
    state = engine.full_state_dict()
    return {"losses": losses, "state": state if rank == 0 else None, "comm_type": type(engine.comm).__name__,
            "is_shm": isinstance(engine.comm, ShmComm), "is_comm": type(engine.comm) is Comm,
            "step_ends": ends}


def _memory_after_one_step(rank: int, world_size: int, name: str, stage: int, threshold: int) -> dict[str, Any]:
    with torch.device("meta"):
        model = zoo.build(name)
    cfg = fxzero.Config(stage=stage, persist_threshold=threshold, cost_model=None)
    engine = fxzero.compile(model, cfg)  # initialized from reset_parameters (seed 0)
    if name == "cnn":
        batches, loss_fn = make_cnn_batches(1, global_batch=4, seed=3), classification_loss
    else:
        batches, loss_fn = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, global_batch=4, seed=3), lm_loss
    train(engine, batches, loss_fn, rank, world_size)
    return engine.memory_report()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mmapped_blocks_for_a_large_tensor() -> int | None:
    """How many more blocks glibc has mmapped while a 64 MiB tensor is alive (None: no glibc
    mallinfo2). glibc's mmap threshold is at most 32 MiB, so by default such a block is mmapped."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    before = mallinfo2().hblks
    t = torch.ones(16 << 20)  # 64 MiB, touched
    during = mallinfo2().hblks
    del t
    return during - before


def _keep_host_memory_run(rank: int, world_size: int) -> dict[str, Any]:
    """Last in the rank: the setting is process-wide and stays for what follows."""
    out = {"applied_before": host_memory.keep_freed_host_memory.cache_info().currsize,
           "mmapped_before": _mmapped_blocks_for_a_large_tensor()}
    out["run"] = _gpt_run(rank, world_size, keep_host_memory=True)
    out["applied_after"] = host_memory.keep_freed_host_memory.cache_info().currsize
    out["mmapped_after"] = _mmapped_blocks_for_a_large_tensor()
    return out


def _rank_main(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"init": _init(rank, world_size)}
    if world_size != SETTINGS_WORLD:
        return out
    parts = {
        "auto": lambda: _gpt_run(rank, world_size),
        "process_group": lambda: _gpt_run(rank, world_size, transport="process_group"),
        "link": lambda: _gpt_run(rank, world_size, link_emulation=LINK),
        "memory:cnn-stage2": lambda: _memory_after_one_step(rank, world_size, "cnn", 2, 0),
        "memory:cnn-stage3": lambda: _memory_after_one_step(rank, world_size, "cnn", 3, CNN_THRESHOLD),
        "memory:gpt-stage3": lambda: _memory_after_one_step(rank, world_size, "gpt-tiny", 3, GPT_THRESHOLD),
        "keep_host_memory": lambda: _keep_host_memory_run(rank, world_size),  # last: process-wide
    }
    for key, part in parts.items():
        out[key] = part()
        dist.barrier()
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_ranks(_rank_main, request.param, timeout_s=280)


settings_world = pytest.mark.parametrize("runs", [SETTINGS_WORLD], indirect=True, ids=lambda w: f"world{w}")


# ---------------------------------------------------------------------------------------------
# Helpers


def _assert_matches_eager(run: dict[str, Any], what: str) -> None:
    ref = _gpt_reference()
    torch.testing.assert_close(torch.tensor(run["losses"], dtype=torch.float64),
                               torch.tensor(ref["losses"], dtype=torch.float64), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{what}: losses differ from the eager reference\n{m}")
    assert set(run["state"]) == set(ref["state_dict"]), what
    for key, want in ref["state_dict"].items():
        torch.testing.assert_close(run["state"][key], want, rtol=0, atol=STATE_ATOL,
                                   msg=lambda m, k=key: f"{what}: {k!r} differs from the eager reference\n{m}")


def _assert_identical(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["losses"] == want["losses"], f"{what}: {got['losses']} != {want['losses']}"
    for key, value in want["state"].items():
        assert torch.equal(got["state"][key], value), f"{what}: {key!r} differs"


def _padded_bytes(name: str, world_size: int, whole: bool | None = None, threshold: int = 0) -> int:
    """Bytes of the model's units (fp32), each padded to a multiple of the world size; only the
    units held whole (whole=True: fewer parameters than threshold) or sharded (whole=False)."""
    with torch.device("meta"):
        units = default_unit_numels(zoo.build(name))
    return sum(4 * padded_numel(n, world_size) for n in units.values() if whole is None or (n < threshold) == whole)


# ---------------------------------------------------------------------------------------------
# Initialization from reset_parameters()


@pytest.mark.parametrize("stage", INIT_STAGES, ids=lambda s: f"stage{s}")
@pytest.mark.parametrize("name", INIT_MODELS)
def test_seeded_initialization_matches_eager_construction(runs, name: str, stage: int) -> None:
    world, per_rank = runs
    for seed in SEEDS:
        want = _eager_init(name, seed)
        for rank in range(world):
            got = per_rank[rank]["init"][(name, stage, seed)]
            assert list(got) == list(want), f"{name} world {world} rank {rank}: keys {list(got)}"
            for key, value in want.items():
                assert torch.equal(got[key], value), (
                    f"{name} stage {stage} seed {seed} world {world} rank {rank}: {key!r} is not what "
                    f"torch.manual_seed({seed}); zoo.build({name!r}) gives"
                )


@pytest.mark.parametrize("name", INIT_MODELS)
def test_another_seed_gives_other_values(name: str) -> None:
    """The comparison above is not vacuous: the two seeds initialize every weight differently."""
    a, b = (_eager_init(name, seed) for seed in SEEDS)
    # Weights drawn at random (norms start at ones, BatchNorm statistics at zeros and ones).
    weights = [k for k in a if k.endswith(".weight") and "ln_" not in k and ".bn." not in k]
    assert weights, name
    for key in weights:
        assert not torch.equal(a[key], b[key]), f"{name}: {key!r} is the same under seeds {SEEDS}"


# ---------------------------------------------------------------------------------------------
# transport, link emulation, keep_host_memory


@settings_world
def test_default_run_uses_shared_memory_and_matches_eager(runs) -> None:
    world, per_rank = runs
    for rank, out in enumerate(per_rank):
        assert out["auto"]["is_shm"], f"rank {rank}: transport='auto' on one host runs {out['auto']['comm_type']}"
    _assert_matches_eager(per_rank[0]["auto"], "transport='auto'")


@settings_world
def test_process_group_transport_uses_torch_distributed_and_matches_eager(runs) -> None:
    world, per_rank = runs
    for rank, out in enumerate(per_rank):
        run = out["process_group"]
        assert run["is_comm"] and not run["is_shm"], (
            f"rank {rank}: transport='process_group' runs {run['comm_type']}, not the process group's Comm"
        )
    _assert_matches_eager(per_rank[0]["process_group"], "transport='process_group'")


@settings_world
def test_link_emulation_changes_timing_not_results(runs) -> None:
    world, per_rank = runs
    _assert_identical(per_rank[0]["link"], per_rank[0]["auto"], "link emulation vs none")
    # Lower bound of one step at stage 3: every unit is gathered in the forward and its gradient
    # reduce-scattered, each at least latency + bytes * (N-1)/N / bandwidth on the emulated link,
    # one after another. Step 0 includes compiling; steps 1.. are pure training.
    with torch.device("meta"):
        units = default_unit_numels(zoo.build("gpt-tiny"))
    per_collective = [LINK.latency + 4 * padded_numel(n, world) * (world - 1) / world / LINK.bandwidth
                      for n in units.values()]
    bound = 2 * sum(per_collective)
    assert bound > 0.3, bound
    for rank, out in enumerate(per_rank):
        ends = out["link"]["step_ends"]
        assert len(ends) == STEPS
        for step in range(1, STEPS):
            took = ends[step] - ends[step - 1]
            assert took >= bound, (
                f"rank {rank} step {step} took {took:.3f} s, under the {bound:.3f} s its collectives "
                f"need on the emulated link {LINK}: the emulator did not delay them"
            )


def test_emulated_link_deadlines_follow_latency_plus_wire_bytes_over_bandwidth() -> None:
    link = EmulatedLink(fxzero.LinkEmulation(bandwidth=1e6, latency=0.5), world_size=4)
    before = time.monotonic()
    first = link.deadline(4000)  # 3/4 of 4000 bytes on the wire: 0.5 + 0.003 s
    after = time.monotonic()
    assert before + 0.503 <= first <= after + 0.503 + 1e-9
    # Issued while the link is busy: starts at the previous deadline; an all-reduce is 2 passes.
    second = link.deadline(8000, passes=2)
    assert second == pytest.approx(first + 0.5 + 2 * 6000 / 1e6, abs=1e-9)
    assert link.busy_until == second
    alone = EmulatedLink(fxzero.LinkEmulation(bandwidth=1.0, latency=0.25), world_size=1)
    now = time.monotonic()
    assert now + 0.25 <= alone.deadline(10**9) <= time.monotonic() + 0.25, "one rank: nothing on the wire"


def test_a_pending_collective_completes_no_earlier_than_its_deadline() -> None:
    result = torch.ones(3)
    deadline = time.monotonic() + 0.05
    assert Pending(None, result, deadline=deadline).wait() is result
    assert time.monotonic() >= deadline


@settings_world
def test_keep_host_memory_keeps_large_blocks_off_mmap_and_matches_eager(runs) -> None:
    world, per_rank = runs
    for rank, out in enumerate(per_rank):
        got = out["keep_host_memory"]
        assert got["applied_before"] == 0 and got["applied_after"] == 1, (
            f"rank {rank}: Config(keep_host_memory=True) should apply the glibc setting once: {got}"
        )
        if got["mmapped_before"] is not None:
            assert got["mmapped_before"] >= 1, f"rank {rank}: by default glibc mmaps a 64 MiB block: {got}"
            assert got["mmapped_after"] == 0, f"rank {rank}: with keep_host_memory it must come from the heap"
    run = per_rank[0]["keep_host_memory"]["run"]
    _assert_identical(run, per_rank[0]["auto"], "keep_host_memory vs not")
    _assert_matches_eager(run, "keep_host_memory=True")


# ---------------------------------------------------------------------------------------------
# memory_report(): persistent_params and buffers


def _cnn_buffer_bytes() -> int:
    with torch.device("meta"):
        model = zoo.build("cnn")
    return sum(b.numel() * b.element_size() for b in model.buffers())


@settings_world
def test_memory_report_counts_persistent_params_and_buffers(runs) -> None:
    world, per_rank = runs
    cnn_buffers = _cnn_buffer_bytes()
    assert cnn_buffers == 4 * (8 + 8 + 16 + 16) + 2 * 8, "BatchNorm2d(8), (16): mean, var, count"
    cases = {
        # stage 2: every unit whole on every rank
        "memory:cnn-stage2": (_padded_bytes("cnn", world), _padded_bytes("cnn", world), cnn_buffers),
        # stage 3: units under the threshold whole, the others as this rank's shard
        "memory:cnn-stage3": (
            _padded_bytes("cnn", world, whole=True, threshold=CNN_THRESHOLD),
            _padded_bytes("cnn", world, whole=True, threshold=CNN_THRESHOLD)
            + _padded_bytes("cnn", world, whole=False, threshold=CNN_THRESHOLD) // world,
            cnn_buffers,
        ),
        "memory:gpt-stage3": (
            _padded_bytes("gpt-tiny", world, whole=True, threshold=GPT_THRESHOLD),
            _padded_bytes("gpt-tiny", world, whole=True, threshold=GPT_THRESHOLD)
            + _padded_bytes("gpt-tiny", world, whole=False, threshold=GPT_THRESHOLD) // world,
            0,
        ),
    }
    # Not vacuous: some units are whole and some sharded at stage 3.
    for name, threshold in (("cnn", CNN_THRESHOLD), ("gpt-tiny", GPT_THRESHOLD)):
        assert 0 < _padded_bytes(name, world, True, threshold) < _padded_bytes(name, world), name
    for rank, out in enumerate(per_rank):
        for key, (persistent, params, buffers) in cases.items():
            mem = out[key]
            got = (mem["persistent_params"], mem["param_shards"], mem["buffers"])
            assert got == (persistent, params, buffers), (
                f"rank {rank} {key}: (persistent_params, param_shards, buffers) {got} != "
                f"{(persistent, params, buffers)}"
            )

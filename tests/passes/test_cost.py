"""The cost model and simulator against timelines worked out by hand.

Each schedule here is written instruction by instruction and each cost model has round figures,
so the expected start and end of every instruction is arithmetic in the test, independent of
`fxzero.cost`: a collective takes latency + bytes * (N-1)/N / bandwidth, a compute instruction
max(flops / flops_per_s, bytes / mem_bytes_per_s) + overhead, and a wait ends when its
collective does (the stall is the exposed communication).
"""

from __future__ import annotations

import pytest
import torch

import fxzero
from fxzero import cost
from fxzero.cost import DEFAULT_IO, PRESETS, CostModel, Link, simulate
from fxzero.ir.instruction import Instruction
from fxzero.ir.layout import ParamSlot, UnitLayout
from fxzero.schedule import ProgramSchedule, Schedule
from fxzero.schedule.types import SCHEDULE_VERSION
from fxzero.schedule.validate import fingerprint_of, validate

WORLD = 4
NUMEL = 1000  # one unit of 1000 fp32 parameters: its gathered buffer is 4000 bytes
UNIT = UnitLayout("u0", (ParamSlot("w", (NUMEL,), 0, NUMEL),), torch.float32, WORLD, True)
REL = 1e-9


def _schedule(*instructions: Instruction, inputs=("shard", "x"), outputs=()) -> Schedule:
    program = ProgramSchedule("forward", tuple(inputs), tuple(outputs), tuple(instructions),
                              tuple(0 for _ in instructions))
    fp = fingerprint_of([program], [UNIT], 3)
    return Schedule(SCHEDULE_VERSION, 3, WORLD, (UNIT,), (program,), fp)


def _model(**overrides) -> CostModel:
    fields = dict(name="by-hand", flops_per_s=1e12, mem_bytes_per_s=1e12, op_overhead_s=0.0, comm_interference=0.0,
                  links={"all_gather": Link(bandwidth=1e6, latency=1e-3)})
    fields.update(overrides)
    return CostModel(**fields)


def _gather_compute_wait(gather_bytes: int = 4 * NUMEL, flops: int = 10**9, mem_bytes: int = 10**6):
    return _schedule(
        Instruction("ag", "all_gather", "comm", reads=("shard",), unit="u0", numel=NUMEL, bytes=gather_bytes,
                    buffer="gathered", dtype="float32"),
        Instruction("mm", "compute", "compute", reads=("x",), numel=mem_bytes // 8, bytes=mem_bytes // 2,
                    flops=flops, read_bytes=mem_bytes // 2),
        Instruction("w", "wait", "compute", reads=("ag",), deps=(0,), unit="u0", buffer="gathered"),
        Instruction("free_w", "free", "compute", reads=("w",), deps=(2,), unit="u0", touches=("w",),
                    buffer="gathered"),
    )


def _timeline(result) -> list[tuple[str, str, float, float]]:
    return [(e.name, e.stream, e.start, e.end) for e in result.events]


def _assert_timeline(result, expected):
    got = _timeline(result)
    assert [(n, s) for n, s, _, _ in got] == [(n, s) for n, s, _, _ in expected]
    for (name, _, start, end), (_, _, want_start, want_end) in zip(got, expected):
        assert start == pytest.approx(want_start, rel=REL, abs=1e-15), name
        assert end == pytest.approx(want_end, rel=REL, abs=1e-15), name


def test_hand_built_schedule_is_valid():
    validate(_gather_compute_wait())


def test_gather_compute_wait_timeline():
    schedule = _gather_compute_wait()
    bw, latency = 1e6, 1e-3
    gather = latency + 4000 * (WORLD - 1) / WORLD / bw  # 1 ms + 3 ms (a ring moves 3/4 of the buffer)
    compute = max(1e9 / 1e12, 1e6 / 1e12) + 0.0  # FLOP-bound: 1 ms
    assert (gather, compute) == pytest.approx((4e-3, 1e-3), rel=REL)
    result = simulate(schedule, _model())
    _assert_timeline(result, [
        ("ag", "comm", 0.0, gather),
        ("mm", "compute", 0.0, compute),
        ("w", "compute", gather, gather),  # issued at 1 ms, returns when the gather ends
        ("free_w", "compute", gather, gather),
    ])
    assert result.step_seconds == pytest.approx(gather, rel=REL)
    assert result.exposed_comm_seconds == pytest.approx(gather - compute, rel=REL)  # 3 ms stalled
    assert result.comm_seconds == pytest.approx(gather, rel=REL)
    assert result.compute_seconds == pytest.approx(compute, rel=REL)
    assert result.exposed_io_seconds == 0.0 and result.io_seconds == 0.0


def test_a_collective_is_issued_in_program_order():
    # The compute stream issues the gather after the compute before it: it starts at 1 ms.
    schedule = _schedule(
        Instruction("mm", "compute", "compute", reads=("x",), flops=10**9),
        Instruction("ag", "all_gather", "comm", reads=("shard",), unit="u0", numel=NUMEL, bytes=4 * NUMEL,
                    buffer="gathered"),
        Instruction("w", "wait", "compute", reads=("ag",), deps=(1,), unit="u0", buffer="gathered"),
        Instruction("free_w", "free", "compute", reads=("w",), deps=(2,), unit="u0", buffer="gathered"),
    )
    validate(schedule)
    result = simulate(schedule, _model())
    compute, gather = 1e-3, 1e-3 + 3000 / 1e6
    _assert_timeline(result, [
        ("mm", "compute", 0.0, compute),
        ("ag", "comm", compute, compute + gather),
        ("w", "compute", compute + gather, compute + gather),
        ("free_w", "compute", compute + gather, compute + gather),
    ])
    assert result.exposed_comm_seconds == pytest.approx(gather, rel=REL)
    assert result.step_seconds == pytest.approx(compute + gather, rel=REL)


def test_memory_bound_compute_and_op_overhead():
    # 4e9 bytes at 1e12 B/s is 4 ms, more than the 1 ms of FLOPs; every op pays 0.5 ms overhead
    # (the wait and the free too), and the all-gather hides behind the compute entirely.
    schedule = _gather_compute_wait(mem_bytes=4 * 10**9)
    overhead = 5e-4
    result = simulate(schedule, _model(op_overhead_s=overhead))
    gather = 1e-3 + 3000 / 1e6
    compute = max(1e-3, 4e9 / 1e12) + overhead
    _assert_timeline(result, [
        ("ag", "comm", 0.0, gather),
        ("mm", "compute", 0.0, compute),
        ("w", "compute", compute, compute + overhead),
        ("free_w", "compute", compute + overhead, compute + 2 * overhead),
    ])
    assert result.exposed_comm_seconds == 0.0
    assert result.step_seconds == pytest.approx(compute + 2 * overhead, rel=REL)


def test_communication_in_flight_slows_compute():
    # interference 0.5: the compute overlaps the gather for its whole 1 ms, so it takes 1.5 ms
    result = simulate(_gather_compute_wait(), _model(comm_interference=0.5))
    gather, compute = 4e-3, 1e-3 + 0.5 * 1e-3
    _assert_timeline(result, [
        ("ag", "comm", 0.0, gather),
        ("mm", "compute", 0.0, compute),
        ("w", "compute", gather, gather),
        ("free_w", "compute", gather, gather),
    ])
    assert result.exposed_comm_seconds == pytest.approx(gather - compute, rel=REL)


def test_the_cost_models_world_size_prices_the_ring():
    # A model for 8 ranks prices a 4-rank schedule's gather over 8: 7/8 of the buffer.
    result = simulate(_gather_compute_wait(), _model(world_size=8))
    assert result.events[0].end == pytest.approx(1e-3 + 4000 * 7 / 8 / 1e6, rel=REL)


def _reduce_scatter(algorithm: str) -> Schedule:
    return _schedule(
        Instruction("rs", "reduce_scatter", "comm", reads=("g",), unit="u0", numel=NUMEL, bytes=4 * NUMEL,
                    algorithm=algorithm, buffer="grad_shard"),
        Instruction("w", "wait", "compute", reads=("rs",), deps=(0,), unit="u0", buffer="grad_shard"),
        inputs=("g",),
    )


LINKS = {
    "all_gather": Link(bandwidth=1e6, latency=1e-3),
    "reduce_scatter": Link(bandwidth=2e6, latency=2e-3),
    "all_reduce": Link(bandwidth=5e5, latency=3e-3),
}


@pytest.mark.parametrize("algorithm, link", [("", "reduce_scatter"), ("all_reduce", "all_reduce")])
def test_a_collective_is_priced_on_the_link_it_runs_on(algorithm, link):
    result = simulate(_reduce_scatter(algorithm), _model(links=LINKS))
    want = LINKS[link].latency + 4000 * (WORLD - 1) / WORLD / LINKS[link].bandwidth
    # reduce_scatter: 2 ms + 1.5 ms; as an all-reduce: 3 ms + 6 ms
    assert want == pytest.approx({"reduce_scatter": 3.5e-3, "all_reduce": 9e-3}[link], rel=REL)
    _assert_timeline(result, [("rs", "comm", 0.0, want), ("w", "compute", want, want)])
    assert result.exposed_comm_seconds == pytest.approx(want, rel=REL)


def test_a_model_with_only_an_all_gather_link_prices_everything_on_it():
    result = simulate(_reduce_scatter("all_reduce"), _model())
    assert result.events[0].end == pytest.approx(1e-3 + 3000 / 1e6, rel=REL)


def _transfer(kind: str, tier: str, nbytes: int) -> Schedule:
    buffer = "fetched" if kind == "fetch" else "token"
    instructions = [
        Instruction("t", kind, "io", reads=("s",), unit="u0", numel=nbytes // 4, bytes=nbytes, tier=tier,
                    state="exp_avg", buffer=buffer, dtype="float32"),
        Instruction("w", "wait", "compute", reads=("t",), deps=(0,), unit="u0", buffer=buffer),
    ]
    if kind == "fetch":
        instructions.append(Instruction("free_w", "free", "compute", reads=("w",), deps=(1,), unit="u0",
                                        buffer="fetched"))
    return _schedule(*instructions, inputs=("s",))


IO = {"nvme_read": Link(bandwidth=1e8, latency=2e-4), "nvme_write": Link(bandwidth=5e7, latency=3e-4),
      "cpu_read": Link(bandwidth=4e9, latency=1e-5)}


@pytest.mark.parametrize("kind, tier, io, want", [
    ("fetch", "nvme", IO, 2e-4 + 1e6 / 1e8),
    ("offload", "nvme", IO, 3e-4 + 1e6 / 5e7),
    ("fetch", "cpu", IO, 1e-5 + 1e6 / 4e9),
    # tiers the model does not list: DEFAULT_IO's NVMe figures, half the memory bandwidth for cpu
    ("fetch", "nvme", {}, DEFAULT_IO["nvme_read"].latency + 1e6 / DEFAULT_IO["nvme_read"].bandwidth),
    ("offload", "nvme", {}, DEFAULT_IO["nvme_write"].latency + 1e6 / DEFAULT_IO["nvme_write"].bandwidth),
    ("offload", "cpu", {}, 1e6 / (1e12 / 2)),
], ids=["nvme-read", "nvme-write", "cpu-read", "default-nvme-read", "default-nvme-write", "default-cpu"])
def test_a_transfer_is_priced_by_its_tier(kind, tier, io, want):
    schedule = _transfer(kind, tier, 10**6)
    validate(schedule)
    result = simulate(schedule, _model(io=dict(io)))
    assert (result.events[0].stream, result.events[0].start) == ("io", 0.0)
    assert result.events[0].end == pytest.approx(want, rel=REL)
    assert result.events[1].end == pytest.approx(want, rel=REL)
    assert result.io_seconds == pytest.approx(want, rel=REL)
    assert result.exposed_io_seconds == pytest.approx(want, rel=REL)
    assert result.exposed_comm_seconds == 0.0 and result.comm_seconds == 0.0


def test_storage_io_in_flight_slows_compute():
    """io_interference 0.5: a 1 ms compute under a 10.2 ms NVMe fetch takes 1.5 ms; with none,
    1 ms; a collective's interference does not apply to a transfer."""
    fetch = Instruction("t", "fetch", "io", reads=("s",), unit="u0", numel=250_000, bytes=10**6, tier="nvme",
                        state="exp_avg", buffer="fetched", dtype="float32")
    mm = Instruction("mm", "compute", "compute", reads=("x",), numel=1, bytes=0, flops=10**9)
    wait = Instruction("w", "wait", "compute", reads=("t",), deps=(0,), unit="u0", buffer="fetched")
    free = Instruction("free_w", "free", "compute", reads=("w",), deps=(2,), unit="u0", buffer="fetched")
    schedule = _schedule(fetch, mm, wait, free, inputs=("s", "x"))
    validate(schedule)
    transfer = 2e-4 + 1e6 / 1e8
    for fields, compute in ((dict(io_interference=0.5), 1.5e-3), (dict(comm_interference=0.5), 1e-3), ({}, 1e-3)):
        result = simulate(schedule, _model(io=dict(IO), **fields))
        _assert_timeline(result, [
            ("t", "io", 0.0, transfer),
            ("mm", "compute", 0.0, compute),
            ("w", "compute", transfer, transfer),
            ("free_w", "compute", transfer, transfer),
        ])
        assert result.exposed_io_seconds == pytest.approx(transfer - compute, rel=REL)


def test_default_io_figures_are_the_documented_drive():
    assert DEFAULT_IO["nvme_read"] == Link(bandwidth=1.05e9, latency=1e-4)
    assert DEFAULT_IO["nvme_write"] == Link(bandwidth=2.3e9, latency=1e-4)


# -- resolve: what Config.cost_model may name -----------------------------------------------------


def test_resolve():
    for name in PRESETS:
        assert cost.resolve(name) is PRESETS[name]
    mine = _model()
    assert cost.resolve(mine) is mine
    assert cost.resolve(None) is None
    with pytest.raises(TypeError, match="Config.cost_model must be 'measure', a preset name, .* got int"):
        cost.resolve(3)
    with pytest.raises(ValueError, match=r"unknown hardware 'tpu-v9'; choose one of \['a100-40gb', 'a100-80gb', 'cpu-loopback'"):
        cost.resolve("tpu-v9")


def test_a_preset_cost_model_reaches_the_compiler():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    engine = fxzero.compile(model, fxzero.Config(cost_model="h100x8-nvlink"))
    assert engine.cost_model is PRESETS["h100x8-nvlink"]
    x = torch.randn(2, 4)
    engine.backward(engine(x).square().mean())
    engine.step()
    assert engine.schedule is not None
    assert all(torch.isfinite(v).all() for v in engine.full_state_dict().values())

"""DeepSpeed's LR schedules: the lr (and momentum) a scheduler writes at every step, against the
sequence written out here from DeepSpeed 0.19.8's formulas; the state round trip; and the
mistakes `schedule_from_deepspeed` refuses.

Step i is the scheduler's `last_batch_iteration`: building it writes the lr of i = -1, the k-th
`step()` the lr of i = k - 1 (see [Note: step counting] in fxzero/runtime/lr_schedules.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from fxzero.config.schedules import (
    SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    schedule_from_deepspeed,
)
from fxzero.runtime.lr_schedules import build_scheduler

STEPS = 30


def _sgd(*lrs: float) -> torch.optim.SGD:
    """One param group per lr."""
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs])


def _adam(lr: float = 0.5) -> torch.optim.Adam:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=(0.9, 0.999))


def _lrs(optimizer, scheduler, steps: int = STEPS) -> list[list[float]]:
    """Each group's lr after building (first entry), then after each of `steps` steps."""
    seen = [[float(g["lr"]) for g in optimizer.param_groups]]
    for _ in range(steps):
        scheduler.step()
        seen.append([float(g["lr"]) for g in optimizer.param_groups])
    return seen


def _assert_lrs(got: list[list[float]], expected: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)


def _warmup(i: int, steps: int, kind: str) -> float:
    """DeepSpeed's warmup fraction at step i >= 0, for i < steps."""
    return math.log(i + 1) / math.log(steps) if kind == "log" else i / steps


# -- warmup schedules ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    opt = _sgd(0.5)
    sched = build_scheduler(WarmupLR(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10,
                                     warmup_type=kind), opt)
    expected = [[0.01]] + [[0.01 + 0.09 * (_warmup(i, 10, kind) if i < 10 else 1.0)] for i in range(STEPS)]
    got = _lrs(opt, sched)
    _assert_lrs(got, expected)
    # built: the min lr, as at step 0; the top is reached at step W - 1 (log) or W (linear), and held
    assert got[0] == got[1] == [0.01]
    top = 9 if kind == "log" else 10
    assert got[top] < got[1 + top] and got[1 + top:] == [[0.1]] * (STEPS - top)
    assert sched.get_last_lr() == pytest.approx([0.1])


@pytest.mark.timeout(60)
def test_warmup_lr_max_defaults_to_each_groups_lr():
    opt = _sgd(0.3, 0.06)
    sched = build_scheduler(WarmupLR(warmup_num_steps=4, warmup_type="linear"), opt)
    expected = [[0.0, 0.0]] + [[lr * min(1.0, i / 4) for lr in (0.3, 0.06)] for i in range(8)]
    _assert_lrs(_lrs(opt, sched, 8), expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, expected", [("log", [0.0, 0.0, 1.0, 1.0]), ("linear", [0.0, 0.0, 0.5, 1.0])])
def test_warmup_of_one_step_lasts_two(kind, expected):
    """DeepSpeed warms up over max(2, warmup_num_steps) steps."""
    opt = _sgd(0.5)
    sched = build_scheduler(WarmupLR(warmup_max_lr=1.0, warmup_num_steps=1, warmup_type=kind), opt)
    assert [lr for [lr] in _lrs(opt, sched, 3)] == pytest.approx(expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    opt = _sgd(0.5)
    sched = build_scheduler(WarmupDecayLR(total_num_steps=30, warmup_min_lr=0.01, warmup_max_lr=0.1,
                                          warmup_num_steps=10, warmup_type=kind), opt)

    def gamma(i):
        return _warmup(i, 10, kind) if i < 10 else max(0.0, (30 - i) / 20)

    expected = [[0.01]] + [[0.01 + 0.09 * gamma(i)] for i in range(40)]
    got = _lrs(opt, sched, 40)
    _assert_lrs(got, expected)
    # the decay starts from the top at step W and reaches the min lr at step T, then stays
    assert got[1 + 10] == [0.1]
    assert got[1 + 29] > got[1 + 30] and got[1 + 30:] == [[0.01]] * 10


@pytest.mark.timeout(60)
def test_warmup_decay_lr_reaches_zero_at_total_steps():
    opt = _sgd(0.5)
    sched = build_scheduler(WarmupDecayLR(total_num_steps=12, warmup_num_steps=4, warmup_type="linear"), opt)
    got = [lr for [lr] in _lrs(opt, sched, 16)]
    assert got[1 + 11] == pytest.approx(0.001 / 8) and got[1 + 12:] == [0.0] * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_scales_each_groups_lr(kind):
    opt = _sgd(0.1, 0.02)
    sched = build_scheduler(WarmupCosineLR(total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=10,
                                           cos_min_ratio=0.01, warmup_type=kind), opt)

    def ratio(i):
        if i < 10:
            return 0.1 + 0.9 * _warmup(i, 10, kind)
        progress = min(1.0, (i - 10 + 1) / 20)
        return 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2

    expected = [[0.0, 0.0]] + [[0.1 * ratio(i), 0.02 * ratio(i)] for i in range(STEPS + 5)]
    got = _lrs(opt, sched, STEPS + 5)
    _assert_lrs(got, expected)
    # built: lr 0 whatever warmup_min_ratio is; then the ratio rises from it
    assert got[0] == [0.0, 0.0]
    _assert_lrs(got[1:2], [[0.01, 0.002]])
    # the floor is reached at step T - 1 and held
    assert got[1 + 28] > got[1 + 29]
    _assert_lrs(got[1 + 29:], [[0.001, 0.0002]] * 6)


# -- OneCycle ------------------------------------------------------------------------------------


def _height(i: int, first: int, second: int) -> float:
    """The cycle's height (0 at min_lr, 1 at max_lr) at step i, without stairs."""
    c = (i + 1) % (first + second)
    return c / first if c <= first else (first + second - c) / second


@pytest.mark.timeout(60)
def test_one_cycle_two_phases_then_decay():
    opt = _sgd(0.5)
    sched = build_scheduler(OneCycle(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10,
                                     cycle_second_step_size=5, decay_step_size=4, decay_lr_rate=0.5,
                                     cycle_momentum=False), opt)

    def lr(i):
        if i < 15:
            return 0.01 + 0.09 * _height(i, 10, 5)
        return 0.01 / (1 + 0.5 * (i - 15 + 1) / 4)

    expected = [[0.01]] + [[lr(i)] for i in range(STEPS)]
    got = _lrs(opt, sched)
    _assert_lrs(got, expected)
    # up for 10 steps to the top at step 9, down for 5 to the bottom at step 14, then below it
    _assert_lrs([got[1 + 9], got[1 + 14], got[1 + 15]], [[0.1], [0.01], [0.01 / 1.125]])


@pytest.mark.timeout(60)
def test_one_cycle_stairs():
    opt = _sgd(0.5)
    sched = build_scheduler(OneCycle(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=8,
                                     cycle_second_step_size=4, cycle_first_stair_count=4,
                                     cycle_second_stair_count=2, cycle_momentum=False), opt)
    got = [lr for [lr] in _lrs(opt, sched, 14)]
    # rising: a stair of 1/4 every 2 steps; falling: a stair of 1/2 every 2 steps; no decay after
    assert got == pytest.approx([0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.timeout(60)
def test_one_cycle_second_half_defaults_to_first():
    opt = _sgd(0.5)
    sched = build_scheduler(OneCycle(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4,
                                     cycle_first_stair_count=2, cycle_momentum=False), opt)
    assert [lr for [lr] in _lrs(opt, sched, 9)] == pytest.approx([0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0])


@pytest.mark.timeout(60)
def test_one_cycle_without_a_second_half_never_reaches_the_top():
    """The cycle's last step is its bottom, as in DeepSpeed: with no falling half, that is the step
    which would have been the top."""
    opt = _sgd(0.5)
    sched = build_scheduler(OneCycle(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4,
                                     cycle_second_step_size=0, cycle_momentum=False), opt)
    _assert_lrs(_lrs(opt, sched, 5), [[0.0], [0.25], [0.5], [0.75], [0.0], [0.0]])


@pytest.mark.timeout(60)
def test_one_cycle_momentum_cycles_inversely_and_decays_up():
    opt = _adam()
    sched = build_scheduler(OneCycle(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=6,
                                     cycle_second_step_size=4, decay_step_size=2, cycle_min_mom=0.85,
                                     cycle_max_mom=0.95, decay_mom_rate=0.01), opt)
    # built: the min momentum; the second beta becomes 0.99, as DeepSpeed writes it
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)
    moms = []
    for _ in range(STEPS):
        sched.step()
        moms.append(opt.param_groups[0]["betas"])
    expected = [0.95 - 0.1 * _height(i, 6, 4) if i < 10 else 0.95 * (1 + 0.01 * (i - 10 + 1) / 2)
                for i in range(STEPS)]
    assert [m for m, _ in moms] == pytest.approx(expected)
    assert {b for _, b in moms} == {0.99}
    assert moms[5][0] == pytest.approx(0.85) and moms[9][0] == pytest.approx(0.95)


@pytest.mark.timeout(60)
def test_one_cycle_momentum_needs_betas():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5, momentum=0.7)
    with pytest.warns(UserWarning, match="cycle_momentum has no effect: SGD"):
        sched = build_scheduler(OneCycle(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4), opt)
    sched.step()
    assert opt.param_groups[0]["momentum"] == 0.7 and "betas" not in opt.param_groups[0]


# -- LRRangeTest ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = _sgd(0.5, 0.5)
    sched = build_scheduler(LRRangeTest(lr_range_test_min_lr=0.01, lr_range_test_step_size=5,
                                        lr_range_test_step_rate=2.0, lr_range_test_staircase=staircase), opt)

    def lr(i):
        q = (i + 1) / 5
        return 0.01 * (1 + 2.0 * (math.floor(q) if staircase else q))

    _assert_lrs(_lrs(opt, sched), [[lr(i)] * 2 for i in range(-1, STEPS)])


# -- state, resuming, and the optimizer's lr -----------------------------------------------------

_ONE_OF_EACH = [
    WarmupLR(warmup_num_steps=8),
    WarmupDecayLR(total_num_steps=25, warmup_num_steps=8, warmup_type="linear"),
    WarmupCosineLR(total_num_steps=25, warmup_num_steps=8, warmup_min_ratio=0.2),
    OneCycle(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=6, cycle_second_step_size=3,
             decay_step_size=2, decay_lr_rate=0.3, decay_mom_rate=0.01),
    LRRangeTest(lr_range_test_step_size=3, lr_range_test_staircase=True),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", _ONE_OF_EACH, ids=lambda s: type(s).__name__)
def test_state_dict_round_trip_continues_the_sequence(schedule):
    whole_opt = _adam()
    whole = _lrs(whole_opt, build_scheduler(schedule, whole_opt), 24)

    first_opt = _adam()
    first = build_scheduler(schedule, first_opt)
    head = _lrs(first_opt, first, 12)
    resumed_opt = _adam()
    resumed = build_scheduler(schedule, resumed_opt)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"last_batch_iteration": 11}
    tail = _lrs(resumed_opt, resumed, 12)[1:]
    assert head + tail == whole
    assert resumed_opt.param_groups[0]["betas"] == whole_opt.param_groups[0]["betas"]


@pytest.mark.timeout(60)
def test_resuming_at_a_step_writes_nothing_until_stepped():
    opt = _sgd(0.5)
    sched = build_scheduler(WarmupLR(warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"), opt,
                            last_step=4)
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(RuntimeError, match="call step"):
        sched.get_last_lr()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.05]) and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    sched.step(last_batch_iteration=20)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and sched.get_lr() == pytest.approx([0.1])


@pytest.mark.timeout(60)
def test_a_tensor_lr_is_filled_in_place():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.5))
    lr = opt.param_groups[0]["lr"]
    sched = build_scheduler(LRRangeTest(lr_range_test_min_lr=0.25, lr_range_test_step_size=1), opt)
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.5)


@pytest.mark.timeout(60)
def test_build_scheduler_refuses_what_it_cannot_drive():
    with pytest.raises(TypeError, match="one of .*WarmupLR.*got dict"):
        build_scheduler({"type": "WarmupLR"}, _sgd(0.1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer, got list"):
        build_scheduler(WarmupLR(), [{"lr": 0.1}])
    with pytest.raises(ValueError, match="last_step must be an int >= -1"):
        build_scheduler(WarmupLR(), _sgd(0.1), last_step=-2)


# -- the dataclasses and the DeepSpeed section ---------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, match", [
    (lambda: WarmupLR(warmup_type="cosine"), r'WarmupLR.warmup_type must be "log" or "linear", got \'cosine\''),
    (lambda: WarmupLR(warmup_num_steps=0), "WarmupLR.warmup_num_steps must be an int >= 1, got 0"),
    (lambda: WarmupDecayLR(total_num_steps=1.5), "WarmupDecayLR.total_num_steps must be an int >= 1"),
    (lambda: WarmupCosineLR(total_num_steps=100, cos_min_ratio=2), r"cos_min_ratio must be a number in \[0.0, 1.0\]"),
    (lambda: OneCycle(cycle_min_lr=0.1, cycle_max_lr="1"), "OneCycle.cycle_max_lr must be a number >= 0.0"),
    (lambda: OneCycle(cycle_min_lr=0.1, cycle_max_lr=1, cycle_first_step_size=0), "cycle_first_step_size must be"),
    (lambda: LRRangeTest(lr_range_test_staircase=1), "lr_range_test_staircase must be true or false"),
])
def test_a_bad_field_is_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.timeout(60)
def test_no_room_for_the_decay_warns():
    with pytest.warns(UserWarning, match="total_num_steps=5 is not more than warmup_num_steps=10"):
        WarmupDecayLR(total_num_steps=5, warmup_num_steps=10)


@pytest.mark.timeout(60)
def test_schedule_from_deepspeed_reads_each_type():
    assert set(SCHEDULES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    # ints from JSON where floats are meant; a type with no params keeps every default
    assert schedule_from_deepspeed({"type": "WarmupLR", "params": {"warmup_max_lr": 1, "warmup_num_steps": 50}}) \
        == WarmupLR(warmup_max_lr=1.0, warmup_num_steps=50)
    assert schedule_from_deepspeed({"type": "WarmupLR"}) == WarmupLR()
    assert schedule_from_deepspeed({"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}) \
        == WarmupDecayLR(total_num_steps=5000)
    assert schedule_from_deepspeed({"type": "WarmupCosineLR", "params": {"total_num_steps": 5000,
                                                                         "warmup_type": "linear"}}) \
        == WarmupCosineLR(total_num_steps=5000, warmup_type="linear")
    assert schedule_from_deepspeed({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1,
                                                                   "cycle_momentum": False}}) \
        == OneCycle(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_momentum=False)
    assert schedule_from_deepspeed({"type": "LRRangeTest", "params": {"lr_range_test_staircase": True}}) \
        == LRRangeTest(lr_range_test_staircase=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("section, match", [
    ({"type": "WarmupLr"},
     r"scheduler.type 'WarmupLr' is not one of WarmupLR, .*LRRangeTest; did you mean 'WarmupLR'\?"),
    ({"type": "StepLR", "params": {}}, "is not one of .*torch.optim.lr_scheduler"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 10}},
     r"WarmupLR has no param 'warmup_num_step'; did you mean 'warmup_num_steps'\?"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 0.1}},
     "WarmupCosineLR has no param 'warmup_max_lr'"),
    ({"type": "WarmupLR", "param": {}}, r"unknown key 'param'; did you mean 'params'\?"),
    ({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.1}}, "WarmupDecayLR needs 'total_num_steps'"),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}, "OneCycle needs 'cycle_min_lr'"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "OneCycle needs 'cycle_max_lr'"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
     r'scheduler.params.total_num_steps is "auto": .*no trainer to supply it: give a number'),
    ({"type": "WarmupLR", "params": {"warmup_type": "cos"}}, "WarmupLR.warmup_type must be"),
])
def test_schedule_from_deepspeed_refuses_mistakes(section, match):
    with pytest.raises(ValueError, match=match):
        schedule_from_deepspeed(section)

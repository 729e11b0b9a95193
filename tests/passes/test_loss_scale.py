"""The float16 loss scaler step by step against DeepSpeed's counting (`DynamicLossScaler.update_scale`
in deepspeed/runtime/fp16/loss_scaler.py, consecutive_hysteresis false, DeepSpeed's default).

The reference, `deepspeed_scales`, is DeepSpeed's rule restated with DeepSpeed's own variables
(an iteration counter and the iteration of the last overflow), not fxzero's (a count of good
steps), and the first sequences are also spelled out by hand, so an off-by-one in either shows.
"""

from __future__ import annotations

import itertools
import random

import pytest

import fxzero
from fxzero.runtime.loss_scale import LossScaler


def deepspeed_scales(overflows: list[bool], *, initial: float, window: int, hysteresis: int,
                     min_scale: float = 1.0) -> list[float]:
    """The scale after each step's update, as DeepSpeed computes it: iterations count from 0,
    the last overflow starts at -1; an overflow with the hysteresis used up halves the scale,
    otherwise uses one up; a good step doubles it when stable = it - last - 1 is a positive
    multiple of the window, which also restores the hysteresis."""
    scale, it, last, left, out = initial, 0, -1, hysteresis, []
    for overflow in overflows:
        if overflow:
            if hysteresis == 1 or left == 1:
                scale = max(scale / 2, min_scale)
            else:
                left -= 1
            last = it
        else:
            stable = it - last - 1
            if stable > 0 and stable % window == 0:
                left = hysteresis
                scale *= 2
        it += 1
        out.append(scale)
    return out


def fxzero_scales(overflows: list[bool], **policy) -> list[float]:
    scaler = LossScaler(fxzero.LossScale(**policy))
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


G, O = False, True


def test_the_scale_first_doubles_on_the_window_plus_first_good_step_then_every_window():
    # window 3, from the start: steps 1-3 keep 256, step 4's update doubles it (stable 3), then
    # steps 7 and 10 (stable 6, 9).
    got = fxzero_scales([G] * 10, initial_scale_power=8, window=3, hysteresis=2)
    assert got == [256, 256, 256, 512, 512, 512, 1024, 1024, 1024, 2048]
    assert got == deepspeed_scales([G] * 10, initial=256, window=3, hysteresis=2)


def test_an_overflow_restarts_the_count_and_hysteresis_delays_the_halving():
    # window 2, hysteresis 2. Step 3 doubles (stable 2). Step 5 overflows: hysteresis 2 -> 1, the
    # scale stays. Step 6, 7 good (stable 0, 1: a good step does not restore the hysteresis).
    # Step 8 overflows: hysteresis is 1, so it halves; step 9 overflows: halves again. Steps 10,
    # 11, 12 good: step 12 doubles (stable 2) and restores the hysteresis, so step 13's overflow
    # does not halve, and step 14's does.
    pattern = [G, G, G, G, O, G, G, O, O, G, G, G, O, O]
    want = [256, 256, 512, 512, 512, 512, 512, 256, 128, 128, 128, 256, 256, 128]
    assert deepspeed_scales(pattern, initial=256, window=2, hysteresis=2) == want
    assert fxzero_scales(pattern, initial_scale_power=8, window=2, hysteresis=2) == want


def test_with_hysteresis_one_every_overflow_halves_down_to_the_minimum():
    pattern = [O, O, O, O, G, G, G]
    want = [4, 2, 2, 2, 2, 2, 4]  # window 2: the third good step after the last overflow doubles
    assert fxzero_scales(pattern, initial_scale_power=3, window=2, hysteresis=1, min_scale=2.0) == want
    assert deepspeed_scales(pattern, initial=8, window=2, hysteresis=1, min_scale=2.0) == want


@pytest.mark.parametrize("window, hysteresis", list(itertools.product((1, 2, 3, 5), (1, 2, 3))))
def test_random_runs_follow_deepspeed_step_for_step(window, hysteresis):
    rng = random.Random(window * 10 + hysteresis)
    for _ in range(20):
        pattern = [rng.random() < 0.3 for _ in range(40)]
        want = deepspeed_scales(pattern, initial=2.0 ** 10, window=window, hysteresis=hysteresis)
        got = fxzero_scales(pattern, initial_scale_power=10, window=window, hysteresis=hysteresis)
        assert got == want, pattern


def test_a_static_scale_never_moves():
    assert fxzero_scales([G, O, G, G, O, O], static=128.0, window=1) == [128.0] * 6

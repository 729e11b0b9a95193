"""`engine.tput_timer`: DeepSpeed's throughput counter, which training scripts read and step.

DeepSpeed's engine keeps a `ThroughputTimer`: each forward starts it, each `step()` stops it, and
the time between is summed over the steps after the first `start_step` optimizer steps (warm-up:
fxzero compiles its program in the first). Scripts read `avg_samples_per_sec()` and the counters,
and call `update_epoch_count()` at each epoch's end (DeepSpeed-Chat, Megatron-DeepSpeed). fxzero
keeps the same counts with the same meaning; it prints nothing of its own (`steps_per_print`'s
line already gives the step time, `fxzero/runtime/stepping.py`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """Samples per second over the optimizer steps after `start_step`.

    Args:
        batch_size: samples per optimizer step over all ranks (`train_batch_size`); None counts 1.
        start_step: optimizer steps left out of the average, as DeepSpeed's default (2).
    """

    def __init__(self, batch_size: Optional[int], start_step: int = 2) -> None:
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        """Micro-steps (`step()` calls) this epoch."""
        self.global_step_count = 0
        """Optimizer steps (accumulation boundaries) so far."""
        self.total_elapsed_time = 0.0
        """Seconds from each forward's start to its `step()`, summed after `start_step`."""
        self.step_elapsed_time = 0.0
        self.started = False
        self.start_time = 0.0
        self.end_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A forward begins (the last forward before a `step()` is the one timed)."""
        self.started = True
        if self.global_step_count >= self.start_step:
            _synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False) -> None:
        """A `step()`: `global_step` when it ended an accumulation."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            _synchronize()
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
        if global_step:
            self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps; -inf before the first step, as
        DeepSpeed's (and 0 steps timed yet is -inf too, where DeepSpeed divides by zero or a
        negative count)."""
        timed = self.global_step_count - self.start_step
        if self.global_step_count == 0 or timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()

"""How many tokens random-LTD keeps per step: DeepSpeed's `RandomLTDScheduler`, by its state keys.

    scheduler = RandomLTDScheduler(config)         # config: the engine's random-LTD dict
    scheduler.update_seq(global_steps)             # the engine, before each training forward
    scheduler.get_current_seq()                    # the tokens each routed layer keeps now

The one schedule DeepSpeed 0.19.8 has, "fixed_linear", goes from `min_value` to `max_value` over
`require_steps` optimizer steps, in multiples of `seq_per_step`:

    kept(step) = min(max_value, v - v % seq_per_step),  v = floor(step / require_steps * (max - min) + min)

The state is a dict under DeepSpeed's key names (`state["consumed_layer_tokens"]`,
`state["current_value"]`), because scripts read it by those names (DeepSpeedExamples' ViT
finetuning logs `state['consumed_layer_tokens']`); `state_dict()` is what checkpoints keep.
Written from DeepSpeed's `runtime/data_pipeline/data_routing/scheduler.py` semantics.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["BaseScheduler", "RandomLTDScheduler"]

# DeepSpeed's state keys (runtime/data_pipeline/constants.py), which scripts read.
MIN, MAX, CURRENT = "min_value", "max_value", "current_value"
SCHEDULE_CONFIG, SCHEDULE_TYPE = "schedule_config", "schedule_type"
REQUIRE_STEPS, SEQ_PER_STEP = "require_steps", "seq_per_step"
CONSUMED, CURRENT_STEP = "consumed_layer_tokens", "current_steps"
SCHEDULES = ("fixed_linear",)
"""The schedule types DeepSpeed 0.19.8 computes (its `get_value` raises for any other)."""


class BaseScheduler:
    """The schedule's arithmetic over `state` (DeepSpeed's base class, by name)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def _fixed_root_value(self, global_steps: int, root_degree: float) -> int:
        schedule = self.state[SCHEDULE_CONFIG]
        progress = (float(global_steps) / schedule[REQUIRE_STEPS]) ** (1.0 / root_degree)
        value = math.floor(progress * (self.state[MAX] - self.state[MIN]) + self.state[MIN])
        value -= value % schedule[SEQ_PER_STEP]
        return min(value, self.state[MAX])

    def get_value(self, global_steps: int) -> int:
        """The kept count the schedule gives at `global_steps` optimizer steps."""
        if self.state[SCHEDULE_TYPE] != "fixed_linear":
            raise ValueError(f"random-LTD schedule_type {self.state[SCHEDULE_TYPE]!r}: DeepSpeed 0.19.8 and fxzero "
                             "compute \"fixed_linear\" only")
        return self._fixed_root_value(global_steps, 1)


class RandomLTDScheduler(BaseScheduler):
    """DeepSpeed's random-LTD scheduler: the kept count, and the layer-tokens consumed so far.

    `config` is DeepSpeed's random-LTD dict (`Engine.random_ltd_config()`): "total_layer_num",
    "random_ltd_layer_num", "random_ltd_schedule" and "global_batch_size" (the engine adds the
    last, the train batch size)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.model_layer_num = int(config["total_layer_num"])
        self.random_ltd_layer_num = int(config["random_ltd_layer_num"])
        self.config_schedule = config["random_ltd_schedule"]
        self.global_batch_size = int(config["global_batch_size"])
        lr_schedule = config.get("layer_token_lr_schedule") or {}
        if lr_schedule.get("enabled", False):
            raise ValueError("random-LTD's layer_token_lr_schedule is not implemented (in DeepSpeed 0.19.8 "
                             "either); set its \"enabled\" to false and use an LR schedule by steps")
        self.reset_to_init()

    def reset_to_init(self) -> None:
        schedule = self.config_schedule
        if schedule is not None:
            self.state[MIN] = schedule[MIN]
            self.state[MAX] = schedule[MAX]
            self.state[CURRENT] = schedule[MIN]
            self.state[SCHEDULE_CONFIG] = schedule[SCHEDULE_CONFIG]
            self.state[SCHEDULE_TYPE] = schedule[SCHEDULE_TYPE]
        self.state[CONSUMED] = 0
        self.state[CURRENT_STEP] = -1

    def get_current_seq(self) -> int:
        """The number of tokens each routed layer keeps in the next training forward."""
        return self.state[CURRENT]

    def set_current_seq(self, seq_length: int) -> None:
        self.state[CURRENT] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """The layer-tokens `train_iters` steps consume from here (advances the state, as DeepSpeed's)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[CONSUMED]

    def update_seq(self, global_steps: int) -> None:
        """Before a training forward at `global_steps`: the kept count follows the schedule until
        it reaches max_value, and the first forward of each step counts its layer-tokens (the
        routed layers at the kept count, the others at max_value, times the global batch)."""
        if self.state[CURRENT] < self.state[MAX]:
            self.state[CURRENT] = self.get_value(global_steps)
        if global_steps != self.state[CURRENT_STEP]:
            routed = self.state[CURRENT] * self.random_ltd_layer_num
            whole = self.state[MAX] * (self.model_layer_num - self.random_ltd_layer_num)
            self.state[CONSUMED] += self.global_batch_size * (routed + whole)
            self.state[CURRENT_STEP] = global_steps

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps (plain ints: fxzero's engine_state.pt holds plain data only)."""
        return {key: self.state[key] for key in (CONSUMED, CURRENT_STEP, CURRENT, MIN, MAX)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for key in (CONSUMED, CURRENT_STEP, CURRENT, MIN, MAX):
            self.state[key] = state_dict[key]

"""DeepSpeed's own runtime unit tests beside the ZeRO ones, unchanged, under `fxzero run`:
`unwrap_model_for_generation` and the LR schedulers (tests/deepspeed_unit/README.md records
DeepSpeed 0.19.8's results on this CPU). They run as `test_deepspeed_unit_tests.py` runs
DeepSpeed's ZeRO tests (its `_run`), in their own file so that the suite's two workers share them.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.dist.test_deepspeed_unit_tests import _run

UNWRAP = "unit/runtime/zero/test_unwrap_model.py"
"""DeepSpeed's `unwrap_model_for_generation` (`deepspeed.runtime.zero`): the whole model gathered,
the hooks off inside the block and back after it, then training on (2 classes, 2 tests)."""


SCHEDULES = "unit/runtime/test_lr_schedulers.py"
"""DeepSpeed's LR scheduler tests: the config's "scheduler" through initialize (the lr before and
during training, against the optimizer's, for all five types) and the classes built on a torch
optimizer directly (`WarmupLR(optimizer, ...)`: per-group lists, tensor lrs, DeepSpeed's
attributes), 82 tests."""

SCHEDULES_DIFFERENT = {
    "test_warmup_cosine_lr_unknown_warmup_type_falls_back_to_log":
        "DeepSpeed warns and warms up as \"log\" for a warmup_type it does not know (\"not_a_warmup_type\"); "
        "fxzero refuses it, naming the two it has, as it refuses the config's (a misspelled \"linaer\" would "
        "otherwise train on another schedule)",
}
"""Tests of DeepSpeed behaviour fxzero differs from on purpose (each is deselected, with the reason)."""

SCHEDULES_DISTRIBUTED = ("TestGetLrBeforeTrain", "TestLrSchedule", "TestSchedulerOptimizerParity", "TestLrRange",
                         "TestOneCycle", "TestWarmupCosineLR")
"""The file's classes that train through initialize on 2 ranks; by default the first of them runs
with the plain tests (`FXZERO_DEEPSPEED_UNIT=all`: all of them)."""


@pytest.mark.timeout(900)
def test_deepspeeds_unwrap_and_lr_scheduler_tests_pass_unchanged(tmp_path):
    """Both files in one `fxzero run` (its start and pytest's are most of a default run's time)."""
    selection = [UNWRAP, SCHEDULES, *(f"--deselect={SCHEDULES}::{t}" for t in SCHEDULES_DIFFERENT)]
    if os.environ.get("FXZERO_DEEPSPEED_UNIT") != "all":
        selection += [f"--deselect={SCHEDULES}::{cls}" for cls in SCHEDULES_DISTRIBUTED[1:]]
    code, out = _run(selection, tmp_path)
    unwrap = sorted(re.findall(rf"^PASSED {re.escape(UNWRAP)}::(\S+)", out, re.M))
    assert code == 0 and unwrap == ["TestUnwrapModel::test", "TestUnwrapModelTraceInvalidate::test"], out[-6000:]
    statuses = re.findall(rf"^(PASSED|FAILED|ERROR|SKIPPED) {re.escape(SCHEDULES)}::(\S+)", out, re.M)
    assert statuses and all(s == "PASSED" for s, _ in statuses), out[-6000:]
    want = 81 if os.environ.get("FXZERO_DEEPSPEED_UNIT") == "all" else 41
    assert len(statuses) == want, (len(statuses), out[-3000:])
    assert any(t.startswith("TestGetLrBeforeTrain") for _, t in statuses)

"""DeepSpeed's own runtime unit tests beside the ZeRO ones, unchanged, under `fxzero run`:
`unwrap_model_for_generation`, the LR schedulers, models with several outputs, nested zero.Init,
the dataloader and `no_sync` (tests/deepspeed_unit/README.md records DeepSpeed 0.19.8's results
on this CPU). They run as `test_deepspeed_unit_tests.py` runs DeepSpeed's ZeRO tests (its
`_run`), in their own file so that the suite's two workers share them.
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


MORE = {
    "unit/runtime/test_multi_output_model.py": "a model returning 2 or 3 losses, their sum backpropagated "
        "with accumulation, `engine.backward`'s returned loss over the accumulation steps, inputs that require "
        "grad (2 tests)",
}
"""Further files whose every test applies, run by default (what each checks)."""

ALL_ONLY = {
    "unit/runtime/zero/test_zero_dynamic_class.py": "a module class declared inside zero.Init (2 tests)",
    "unit/runtime/zero/test_zero_nesting_init.py": "zero.Init nested in zero.Init, an engine built inside one, and "
        "Hugging Face's VisionEncoderDecoderModel.from_pretrained under HfDeepSpeedConfig (3 tests)",
    "unit/runtime/test_data.py": "RepeatingLoader, and the dataloader's drop_last from the config (5 tests)",
    "unit/runtime/test_no_sync_ctxt.py": "backwards inside engine.no_sync() at stages 0 and 1, fp16/bf16/fp32 (6 "
        "tests of test_zero_stage)",
}
"""Files run with `FXZERO_DEEPSPEED_UNIT=all` (the applicable tests of each)."""

NO_SYNC_DIFFERENT = {
    "test_zero_stage[2-*], [3-*]": "expect DeepSpeed's refusal of no_sync at ZeRO-2 and 3; fxzero keeps the full "
                                   "gradients unreduced there as at stages 0-1 (docs/guides/deepspeed.md)",
    "test_engine_step, test_reentry": "expect DeepSpeed's AssertionError for step() inside no_sync and a nested "
                                      "no_sync; fxzero refuses both with a RuntimeError naming the call",
    "test_multiple_ctxts": "reads safe_get_full_grad inside no_sync, where DeepSpeed returns the rank's unreduced "
                           "gradient; fxzero refuses it there (the full gradient the step applies does not exist yet)",
}
"""test_no_sync_ctxt.py's tests of DeepSpeed behaviour fxzero differs from on purpose."""


@pytest.mark.timeout(900)
def test_deepspeeds_runtime_tests_pass_unchanged(tmp_path):
    """Every file in one `fxzero run` (its start and pytest's are most of a default run's time)."""
    everything = os.environ.get("FXZERO_DEEPSPEED_UNIT") == "all"
    selection = [UNWRAP, SCHEDULES, *(f"--deselect={SCHEDULES}::{t}" for t in SCHEDULES_DIFFERENT), *MORE]
    if everything:
        selection += [*ALL_ONLY, "-k", "not TestNoSyncCtxt or test_zero_stage and (0- or 1-)"]
    else:
        selection += [f"--deselect={SCHEDULES}::{cls}" for cls in SCHEDULES_DISTRIBUTED[1:]]
    code, out = _run(selection, tmp_path)
    for path in [*MORE, *(ALL_ONLY if everything else ())]:
        statuses = re.findall(rf"^(PASSED|FAILED|ERROR|SKIPPED) {re.escape(path)}::(\S+)", out, re.M)
        assert statuses and all(s == "PASSED" for s, _ in statuses), (path, statuses, out[-6000:])
    want = {"unit/runtime/test_multi_output_model.py": 2}
    if everything:
        want.update({"unit/runtime/zero/test_zero_dynamic_class.py": 2,
                     "unit/runtime/zero/test_zero_nesting_init.py": 3, "unit/runtime/test_data.py": 5,
                     "unit/runtime/test_no_sync_ctxt.py": 6})
    for path, n in want.items():
        assert len(re.findall(rf"^PASSED {re.escape(path)}::", out, re.M)) == n, (path, out[-3000:])
    unwrap = sorted(re.findall(rf"^PASSED {re.escape(UNWRAP)}::(\S+)", out, re.M))
    assert code == 0 and unwrap == ["TestUnwrapModel::test", "TestUnwrapModelTraceInvalidate::test"], out[-6000:]
    statuses = re.findall(rf"^(PASSED|FAILED|ERROR|SKIPPED) {re.escape(SCHEDULES)}::(\S+)", out, re.M)
    assert statuses and all(s == "PASSED" for s, _ in statuses), out[-6000:]
    want = 81 if os.environ.get("FXZERO_DEEPSPEED_UNIT") == "all" else 41
    assert len(statuses) == want, (len(statuses), out[-3000:])
    assert any(t.startswith("TestGetLrBeforeTrain") for _, t in statuses)

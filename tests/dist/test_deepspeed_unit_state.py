"""DeepSpeed's own unit tests of what a program reads and sets of a ZeRO engine's state, unchanged,
under `fxzero run` (tests/deepspeed_unit/README.md records DeepSpeed 0.19.8's results on this CPU):

- `test_zero_tensor_fragment.py`: `safe_get_full_*` of the fp32 masters, gradients and Adam's
  moments after every backward and step, `safe_set_full_*` of each then read back exactly, and
  `safe_update_full_grad_vectorized`, at stages 1-3, with the optimizer states on the device, the
  cpu or NVMe, bf16 and fp32, frozen layers (None for them);
- `test_zero_config.py`: `DeepSpeedZeroConfig`'s aliases, deprecated keys and stage defaults;
- `test_zero_leaf_module.py`: `set_z3_leaf_modules` and the config's `leaf_module`, a forward that
  picks its layer by a counter or by the rank, a mixture-of-experts block with several outputs;
- `test_ignore_unused_parameters.py`: a layer no output depends on, ZeRO-2, optimizer on the cpu,
  bf16, accumulation;
- `test_zero2_offload_multi_backward.py`: several backwards before a step with the optimizer on the
  cpu, against the same without offload.

They run as `test_deepspeed_unit_tests.py` runs DeepSpeed's ZeRO tests (its `_run`).
"""

from __future__ import annotations

import itertools
import os
import re

import pytest

from tests.dist.test_deepspeed_unit_tests import _run

FRAGMENT = "unit/runtime/zero/test_zero_tensor_fragment.py"
FILES = {
    FRAGMENT: "the safe_get/set_full_* API at stages 1-3, offloaded or not, bf16/fp32, frozen layers",
    "unit/runtime/zero/test_zero_config.py": "DeepSpeedZeroConfig (6 tests)",
    "unit/runtime/zero/test_zero_leaf_module.py": "ZeRO-3 leaf modules, by call, by name, by the config (21 tests)",
    "unit/runtime/zero/test_ignore_unused_parameters.py": "an unused layer, ZeRO-2, cpu offload, bf16 (1 test)",
    "unit/v1/zero/test_zero2_offload_multi_backward.py": "backwards before a step, offloaded or not (8 tests)",
}

NOT_APPLICABLE = {
    f"{FRAGMENT}::*[*-local-*]": "the local API's tests size their values by `param.ds_tensor` (DeepSpeed's own "
                                 "partition, which fxzero does not give); tests/dist/test_deepspeed_namespace.py "
                                 "checks fxzero's local API",
    "test_zero_leaf_module.py::TestSetZ3LeafModule::test_no_grad_input_error": "expects DeepSpeed's RuntimeError "
        "for a leaf module whose inputs do not require grad (its hooks need them); fxzero's programs do not",
    "test_ignore_unused_parameters.py::...::test[False]": "expects DeepSpeed's AssertionError for a parameter "
        "without a gradient when ignore_unused_parameters is false; fxzero trains it with a zero gradient (the key "
        "is named as having no effect)",
    "test_zero2_offload_multi_backward.py::...::test_single_backward_allocates_no_cpu_accumulator": "reads "
        "DeepSpeed's optimizer buffer `accumulated_grads_in_cpu`",
}
"""Tests deselected, with the reason."""

_LOCAL = [f"{FRAGMENT}::TestTensorFragmentGet::test_zero_fragments[{o}-{s}-local-dtype{d}-{f}]"
          for o, s, d, f in itertools.product(("none", "cpu", "nvme"), (1, 2, 3), (0, 1, 2), (True, False))]
_LOCAL += [f"{FRAGMENT}::TestTensorFragmentSet::test_zero_fragments[{o}-{s}-local-dtype{d}]"
           for o, s, d in itertools.product(("none", "cpu", "nvme"), (1, 2, 3), (0, 1, 2))]
DESELECTED = [*_LOCAL,
              "unit/runtime/zero/test_zero_leaf_module.py::TestSetZ3LeafModule::test_no_grad_input_error",
              "unit/runtime/zero/test_ignore_unused_parameters.py::TestStage2IgnoreUnusedParameters::test[False]",
              *(f"unit/v1/zero/test_zero2_offload_multi_backward.py::TestZeroOffloadMultiBackward::"
                f"test_single_backward_allocates_no_cpu_accumulator[{s}]" for s in (1, 2))]

REPRESENTATIVE = [
    f"{FRAGMENT}::TestTensorFragmentGet::test_zero_fragments[cpu-3-full-dtype0-True]",  # (bf16, frozen layer)
    f"{FRAGMENT}::TestTensorFragmentSet::test_zero_fragments[cpu-2-full-dtype2]",
    f"{FRAGMENT}::TestTensorFragmentSet::test_zero_fragments[nvme-3-full-dtype2]",
    f"{FRAGMENT}::TestTensorFragmentUpdate::test_zero_fragments[cpu-3-True-dtype0]",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/zero/test_zero_leaf_module.py::test_zero_leaf_module_custom_config",
    "unit/runtime/zero/test_zero_leaf_module.py::TestSetZ3LeafModule::test_choose_module_by_rank",
    "unit/runtime/zero/test_zero_leaf_module.py::TestSetZ3LeafModule::test_leaf_module_enabled_via_config",
    "unit/runtime/zero/test_ignore_unused_parameters.py::TestStage2IgnoreUnusedParameters::test[True]",
    "unit/v1/zero/test_zero2_offload_multi_backward.py::TestZeroOffloadMultiBackward::"
    "test_multi_backward_matches_no_offload[2]",
]
"""One of each kind, run by default (`FXZERO_DEEPSPEED_UNIT=all`: every applicable test)."""

PASSING = {FRAGMENT: 59, "unit/runtime/zero/test_zero_config.py": 6, "unit/runtime/zero/test_zero_leaf_module.py": 21,
           "unit/runtime/zero/test_ignore_unused_parameters.py": 1,
           "unit/v1/zero/test_zero2_offload_multi_backward.py": 8}
"""Tests each file passes on this CPU with every applicable test selected (the others skip
themselves here: fp16, bf16 without NCCL, NVMe below stage 3, one DeepSpeed skips upstream)."""


@pytest.mark.timeout(1500)
def test_deepspeeds_state_api_tests_pass_unchanged(tmp_path):
    everything = os.environ.get("FXZERO_DEEPSPEED_UNIT") == "all"
    selection = [*FILES, *(f"--deselect={t}" for t in DESELECTED)] if everything else REPRESENTATIVE
    code, out = _run(selection, tmp_path)
    statuses = re.findall(r"^(PASSED|FAILED|ERROR) (unit/\S+?)::(\S+)", out, re.M)
    assert code == 0 and statuses and all(s == "PASSED" for s, _, _ in statuses), out[-6000:]
    passed = {path: sum(p == path for _, p, _ in statuses) for path in FILES}
    if everything:
        assert passed == PASSING, (passed, out[-3000:])
    else:
        assert sum(passed.values()) == len(REPRESENTATIVE) - 1 + 6, (passed, out[-3000:])
    assert "fxzero run: `import deepspeed` is fxzero" in out

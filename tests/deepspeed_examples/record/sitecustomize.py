"""Records the loss of every training step a DeepSpeed program takes, per rank, without touching it.

With FXZERO_SEED=N, every rank first seeds torch's global RNG with N: the example scripts build
their models without a seed, and torch seeds itself from the OS, so two runs (DeepSpeed's and
fxzero's) start from the same weights only when the process starts seeded.

On PYTHONPATH with FXZERO_RECORD_LOSSES=DIR, the engine's `backward(loss)` (DeepSpeed's
`DeepSpeedEngine`, or fxzero's `Engine`, whichever this process has) appends `loss.item()`, and
each rank writes `DIR/rank<RANK>.json` at exit: the per-step losses of DeepSpeedExamples'
scripts under DeepSpeed and under fxzero, compared by tools/deepspeed_examples.py and
tests/dist/test_deepspeed_examples.py.

Where a script's shims directory holds a `_shim_prelude` module, every rank imports it first (its
fixes to the environment: shims/dschat/_shim_prelude.py).
"""

import atexit
import importlib
import importlib.util
import json
import os
import time

if "LOCAL_RANK" in os.environ and importlib.util.find_spec("_shim_prelude") is not None:
    importlib.import_module("_shim_prelude")  # (a shims directory's fixes to the environment)

if os.environ.get("FXZERO_SEED") and "LOCAL_RANK" in os.environ:
    import torch

    torch.manual_seed(int(os.environ["FXZERO_SEED"]))

if os.environ.get("FXZERO_RECORD_LOSSES") and "LOCAL_RANK" in os.environ:  # (a rank, not the launcher)
    _LOSSES: list = []
    _TIMES: list = []  # (when each backward began: the differences are the step times)

    _PATCHED: list = []

    def _patch(module_name: str, class_name: str) -> None:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except ImportError:
            return
        if cls in _PATCHED:  # (under `fxzero run`, DeepSpeedEngine is fxzero's Engine itself)
            return
        _PATCHED.append(cls)
        backward = cls.backward

        def recording(self, loss, *args, **kwargs):
            _LOSSES.append(float(loss.detach().float()))
            _TIMES.append(time.monotonic())
            return backward(self, loss, *args, **kwargs)

        cls.backward = recording

    # (whichever this process has: a DeepSpeed environment may have fxzero installed beside it)
    _patch("fxzero.runtime.engine", "Engine")
    _patch("deepspeed.runtime.engine", "DeepSpeedEngine")

    def _write() -> None:
        path = os.path.join(os.environ["FXZERO_RECORD_LOSSES"], f"rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w") as f:
            json.dump({"losses": _LOSSES, "step_s": [b - a for a, b in zip(_TIMES, _TIMES[1:])]}, f)

    atexit.register(_write)

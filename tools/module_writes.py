"""`model.load_state_dict(sd)` and an in-place write after `deepspeed.initialize`, under DeepSpeed
and under fxzero, side by side: does the next step train from the values written?

    python tools/module_writes.py --deepspeed-python /path/to/venv-with-deepspeed/bin/python

One script (this file, run as a rank) is started by each system on one CPU rank, at ZeRO-1, 2
and 3, fp32 and bf16: DeepSpeed's with torchrun (`DS_ACCELERATOR=cpu`), fxzero's with
`fxzero run` (its `import deepspeed` is fxzero). The rank trains one step, loads a state dict
holding 0.5 in every element, trains one more step (AdamW, lr 1e-2), and reports how far the
first weight's fp32 master is from 0.5 (`safe_get_full_fp32_param`): about lr (0.01) when the
step trained from the loaded values, about 1 when it trained from the old ones. Then it sets
every element of that weight to 0.25 in place under `torch.no_grad()` (where the rank holds a
value: ZeRO-1/2), steps once more, and reports the same distance from 0.25. Prints one JSON
object per system and configuration ([Note: writes into the user's module] in
`fxzero/runtime/module_writes.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(stage: int, dtype: str) -> None:
    import deepspeed
    import torch
    import torch.nn as nn
    from deepspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    x = torch.randn(2, 4, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)

    def step() -> None:
        engine.backward(engine(x).float().sum())
        engine.step()

    def distance(value: float) -> float:
        return float((safe_get_full_fp32_param(model[0].weight) - value).abs().max())

    step()
    shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters()}
    result = {"system": os.environ.get("MODULE_WRITES_SYSTEM"), "stage": stage, "dtype": dtype}
    try:
        model.load_state_dict({name: torch.full(shape, 0.5) for name, shape in shapes.items()})
        step()
        result["after_load_step"] = distance(0.5)
    except Exception as e:  # (a refusal is a result too)
        result["load_error"] = f"{type(e).__name__}: {e}"[:300]
    if stage < 3:
        with torch.no_grad():
            model[0].weight.fill_(0.25)
        step()
        result["after_in_place_step"] = distance(0.25)
    print("RESULT " + json.dumps(result), flush=True)


def launch(system: str, python: str, stage: int, dtype: str, port: int) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MODULE_WRITES_SYSTEM": system,
           "PYTHONPATH": ROOT}
    launcher = ([python, "-m", "fxzero.cli", "run", "--num_gpus=1", f"--master_port={port}"] if system == "fxzero"
                else [python, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={port}"])
    proc = subprocess.run([*launcher, os.path.abspath(__file__), "--rank-main", str(stage), dtype],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} stage {stage} {dtype} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", help="a Python with DeepSpeed installed (else fxzero alone)")
    parser.add_argument("--rank-main", nargs=2, metavar=("STAGE", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # (DeepSpeed's launcher passes it)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(int(args.rank_main[0]), args.rank_main[1])
        return
    systems = [("fxzero", sys.executable)] + ([("deepspeed", args.deepspeed_python)] if args.deepspeed_python else [])
    port = 29600
    for stage in (1, 2, 3):
        for dtype in ("fp32", "bf16"):
            for system, python in systems:
                port += 1
                print(json.dumps(launch(system, python, stage, dtype, port)), flush=True)


if __name__ == "__main__":
    main()

"""Every DeepSpeedExamples config, trained on under DeepSpeed 0.19.8 and under `fxzero run`, side by side.

    python tools/deepspeed_config_parity.py --deepspeed-python /path/to/venv-with-deepspeed/bin/python \
        [--configs NAME,...] [--steps 6] [--json out.json]

For each config of `tests/data/deepspeedexamples_configs/` (DeepSpeedExamples' own, byte for
byte) that fxzero reads, the same 2-rank program trains a small MLP for `--steps` optimizer
steps under both systems: the config as committed, but for its batch sizes (micro-batch 2,
its gradient accumulation capped at 2, the train batch size implied) and its NVMe paths (a
temporary directory). What the config says of the optimizer, its hyperparameters, the LR
schedule, precision (fp16 with its loss scaling, bf16), ZeRO stage, offload, clipping and the
rest is trained as written. Prints one JSON line per config: both systems' per-step losses
(rank 0's micro-batch) and learning rates, and the largest difference of each; a config one
system refuses is reported with the reason. Configs with "auto" values (filled in by Hugging
Face's Trainer, tested in tests/dist/test_hf_trainer.py) and those fxzero refuses for a feature
it does not have (tests/passes/test_deepspeedexamples_configs.py lists them) are skipped. With
`--stages 1,2,3` each config is also trained at those ZeRO stages (most of DeepSpeedExamples'
configs are stage 0).

The same file is the training program: `--train CONFIG --out FILE` (what both launchers run).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "deepspeedexamples_configs"
MICRO, WORLD, HIDDEN, CLASSES = 2, 2, 32, 4


def _has_auto(value) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_auto(v) for v in value)
    return value == "auto"


def adapt(config: dict, workdir: str) -> dict:
    """The config with this program's batch sizes and a temporary NVMe directory."""
    out = copy.deepcopy(config)
    accumulation = min(int(out.get("gradient_accumulation_steps") or 1), 2)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        out.pop(key, None)
    out.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=accumulation,
               train_batch_size=MICRO * accumulation * WORLD)

    def paths(section):
        if isinstance(section, dict):
            for key, value in section.items():
                if key == "nvme_path" and value:
                    section[key] = workdir
                else:
                    paths(value)

    paths(out)
    return out


def train(config_path: str, out_path: str, steps: int) -> None:
    """The program both systems run (2 ranks): an MLP, seeded alike, on seeded batches."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    with open(config_path) as f:
        config = json.load(f)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(16, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)])

        def forward(self, x, y):
            for i, layer in enumerate(self.layers):
                x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
            return nn.functional.cross_entropy(x.float(), y)

    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = (torch.bfloat16 if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled")
             else torch.float16 if (config.get("fp16") or {}).get("enabled") else torch.float32)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    losses, lrs = [], []
    for _ in range(steps * config["gradient_accumulation_steps"]):
        x = torch.randn(world * MICRO, 16, generator=g)
        y = torch.randint(0, CLASSES, (world * MICRO,), generator=g)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(x[mine].to(dtype), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        lrs.append(float(engine.get_lr()[0]))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "lrs": lrs}, f)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(system: str, python: str, config: dict, workdir: str, steps: int) -> dict:
    config_path, out = os.path.join(workdir, f"{system}.json"), os.path.join(workdir, f"{system}-out.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    if system == "fxzero":
        cmd = [python, "-m", "fxzero.cli", "run", f"--num_gpus={WORLD}", "--no_local_rank", f"--master_port={_port()}"]
    else:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", f"--master_port={_port()}"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": str(WORLD)}
    proc = subprocess.run([*cmd, os.path.abspath(__file__), "--train", config_path, "--out", out,
                           "--steps", str(steps)], cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        import re

        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                 if re.search(r"\w(Error|Exception)\b", ln) and "ChildFailedError" not in ln]
        return {"error": (lines[-1] if lines else (proc.stdout + proc.stderr)[-600:])[:600]}
    with open(out) as f:
        return json.load(f)


def _largest_relative(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b) if not (math.isnan(x) and math.isnan(y))),
               default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--deepspeed-python")
    parser.add_argument("--fxzero-python", default=sys.executable)
    parser.add_argument("--configs", help="comma-separated file names (default: all)")
    parser.add_argument("--stages", help="also train each config at these ZeRO stages (comma-separated; its "
                        "zero_optimization.stage replaced), besides as committed")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.train:
        train(args.train, args.out, args.steps)
        return 0
    if not args.deepspeed_python:
        parser.error("--deepspeed-python is required")
    sys.path.insert(0, str(ROOT))
    import warnings

    from fxzero.config import Config

    names = args.configs.split(",") if args.configs else sorted(p.name for p in CONFIGS.glob("*.json"))
    stages = [None] + [int(s) for s in args.stages.split(",")] if args.stages else [None]
    results = []
    for name, stage in [(n, s) for n in names for s in stages]:
        config = json.loads((CONFIGS / name).read_text())
        row: dict = {"config": name}
        if stage is not None:
            if (config.get("zero_optimization") or {}).get("stage", 0) == stage:
                continue  # (as committed)
            config = {**config, "zero_optimization": {**(config.get("zero_optimization") or {}), "stage": stage}}
            row["stage"] = stage
        with tempfile.TemporaryDirectory() as workdir:
            if _has_auto(config):
                row["skipped"] = "\"auto\" values (a trainer fills them in)"
            else:
                adapted = adapt(config, workdir)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        Config.from_deepspeed(adapted)
                except Exception as e:  # (a feature fxzero does not have: named by the reader)
                    row["skipped"] = f"fxzero refuses it: {str(e)[:300]}"
            if "skipped" not in row:
                row["deepspeed"] = launch("deepspeed", args.deepspeed_python, adapted, workdir, args.steps)
                row["fxzero"] = launch("fxzero", args.fxzero_python, adapted, workdir, args.steps)
                ds, fx = row["deepspeed"], row["fxzero"]
                if "losses" in ds and "losses" in fx:
                    row["loss_rel_diff"] = _largest_relative(fx["losses"], ds["losses"])
                    row["lr_rel_diff"] = _largest_relative(fx["lrs"], ds["lrs"])
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

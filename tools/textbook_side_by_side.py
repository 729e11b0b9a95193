"""The textbook DeepSpeed script under fxzero and under DeepSpeed, side by side; prints JSON.

    .venv/bin/python tools/textbook_side_by_side.py [--rounds 2] [--deepspeed-python .venv-bench/bin/python]

Runs `examples/deepspeed_textbook.py` (import fxzero as deepspeed) and the same file with
`import deepspeed` (DeepSpeed on its CPU accelerator, from another venv: see ../shared/ANCHORS.md)
with `examples/ds_config.json`, on 2 ranks under torchrun, alternating, each rank's global RNG
seeded to 0 before the script runs (the script seeds nothing). Per run: the wall time of the
whole launch (start-up, compile or JIT, 16 optimizer steps), the losses rank 0 prints, and
fxzero's per-rank log line at step 10 (step time averaged over steps 1-10, tracing included).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "deepspeed_textbook.py"
CONFIG = ROOT / "examples" / "ds_config.json"


def _run(python: pathlib.Path, script: pathlib.Path, seed_dir: str, extra_env: dict) -> dict:
    torchrun = python.with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": seed_dir, **extra_env}
    start = time.perf_counter()
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", str(script), str(CONFIG)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"error": (proc.stdout + proc.stderr)[-2000:], "wall_s": wall}
    return {
        "wall_s": round(wall, 2),
        "losses": [float(x) for x in re.findall(r"Loss ([\d.]+)", proc.stdout)],
        "log_lines": [line for line in proc.stdout.splitlines() if line.startswith("[rank ")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--deepspeed-python", type=pathlib.Path, default=ROOT / ".venv-bench" / "bin" / "python")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        seed_dir = os.path.join(tmp, "seed")
        os.makedirs(seed_dir)
        with open(os.path.join(seed_dir, "sitecustomize.py"), "w") as f:
            f.write("import torch\ntorch.manual_seed(0)\n")
        ds_script = pathlib.Path(tmp) / "deepspeed_textbook_ds.py"
        ds_script.write_text(SCRIPT.read_text().replace("import fxzero as deepspeed", "import deepspeed"))
        have_ds = args.deepspeed_python.exists()
        runs: dict[str, list] = {"fxzero": [], "deepspeed": []}
        for _ in range(args.rounds):
            runs["fxzero"].append(_run(pathlib.Path(sys.executable), SCRIPT, seed_dir, {}))
            if have_ds:
                runs["deepspeed"].append(_run(args.deepspeed_python, ds_script, seed_dir, {"DS_ACCELERATOR": "cpu"}))
    walls = {k: [r["wall_s"] for r in v if "error" not in r] for k, v in runs.items()}
    summary = {k: min(v) for k, v in walls.items() if v}
    if len(summary) == 2:
        summary["fxzero_over_deepspeed"] = round(summary["fxzero"] / summary["deepspeed"], 3)
    print(json.dumps({"script": str(SCRIPT.relative_to(ROOT)), "config": str(CONFIG.relative_to(ROOT)),
                      "ranks": 2, "runs": runs, "best_wall_s": summary}, indent=1))


if __name__ == "__main__":
    main()

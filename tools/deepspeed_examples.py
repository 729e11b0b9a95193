"""DeepSpeedExamples' scripts, unchanged, under DeepSpeed 0.19.8 and under `fxzero run`, side by side.

    python tools/deepspeed_examples.py --deepspeed-python /path/to/venv-with-deepspeed/bin/python \
        [--runs cifar-stage0-fp32-2,...] [--write tests/deepspeed_examples/deepspeed_losses.json]

Each run starts the same script (tests/deepspeed_examples/, upstream files with only their data
sources replaced: see its README) with the same arguments, once with DeepSpeed on its CPU
accelerator (`DS_ACCELERATOR=cpu`, launched by torchrun) and once with `fxzero run`, every rank
seeded alike at start (FXZERO_SEED) and its per-step losses and step times recorded by
tests/deepspeed_examples/record/sitecustomize.py. Prints one JSON object per run: both systems'
losses (rank 0's micro-batch), the largest difference, the median step time of each. With
`--write`, DeepSpeed's losses are stored as the reference tests/dist/test_deepspeed_examples.py
compares fxzero against (the test needs no DeepSpeed installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "tests", "deepspeed_examples")
sys.path.insert(0, EXAMPLES)
from tokenizer import make_tokenizer  # noqa: E402  (tests/deepspeed_examples/tokenizer.py)

RUNS: dict[str, dict] = {}
"""name -> {"script", "args", "nproc"}: what the test and this tool run."""
for _stage in (0, 1, 2, 3):
    for _dtype in ("fp32", "bf16"):
        for _nproc in (1, 2):
            RUNS[f"cifar-stage{_stage}-{_dtype}-{_nproc}"] = {
                "script": "cifar10_deepspeed.py", "shims": "cifar", "nproc": _nproc,
                "args": ["--epochs", "1", "--dtype", _dtype, "--stage", str(_stage), "--log-interval", "100"]}


_HELLO = ["--num_iterations", "21", "--checkpoint_every", "10", "--log_every", "5", "--batch_size", "8",
          "--num_layers", "2", "--num_heads", "4", "--ff_dim", "256", "--h_dim", "128", "--max_seq_length", "128",
          "--dtype", "bf16"]
"""HelloDeepSpeed's arguments: a 2-layer Roberta of width 128 (its 50,265-token vocabulary), 20 steps of
micro-batch 8 padded to each batch's longest row (at most 128), a checkpoint at step 10 and 20."""
for _nproc in (1, 2):
    RUNS[f"hello-bf16-{_nproc}"] = {"script": "train_bert_ds.py", "shims": "hello", "nproc": _nproc,
                                    "args": ["--checkpoint_dir", "{workdir}/ck", "--tokenizer", "{tokenizer}", *_HELLO]}
    RUNS[f"hello-fixed-bf16-{_nproc}"] = {**RUNS[f"hello-bf16-{_nproc}"], "env": {"FXZERO_WIKITEXT_WORDS": "200"}}


def environment(record_dir: str, shims: str) -> dict[str, str]:
    """What every rank of either system gets: the script's data shims, the recorder, the seed."""
    env = dict(os.environ)
    paths = [os.path.join(EXAMPLES, "shims", shims), os.path.join(EXAMPLES, "record")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(FXZERO_SEED="0", FXZERO_RECORD_LOSSES=record_dir, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def launch(system: str, run: dict, workdir: str, python: str, port: int) -> dict:
    """Run one script under `system` ("deepspeed" or "fxzero"); rank 0's recorded losses and times."""
    script = os.path.join(EXAMPLES, run["script"])
    tokenizer = make_tokenizer(os.path.join(tempfile.gettempdir(), "fxzero-roberta-shaped-tokenizer"))
    args = [a.format(workdir=workdir, tokenizer=tokenizer) for a in run["args"]]
    env = {**environment(workdir, run["shims"]), **run.get("env", {})}
    if system == "fxzero":
        cmd = [python, "-m", "fxzero.cli", "run", f"--num_gpus={run['nproc']}", f"--master_port={port}"]
    else:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={run['nproc']}", f"--master_port={port}"]
    proc = subprocess.run([*cmd, script, *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} {run['script']} {' '.join(run['args'])} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    with open(os.path.join(workdir, "rank0.json")) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", required=True, help="a Python with deepspeed==0.19.8 and torch")
    parser.add_argument("--fxzero-python", default=sys.executable)
    parser.add_argument("--runs", default="cifar-stage0-fp32-2,cifar-stage3-fp32-2,cifar-stage0-fp32-1,"
                        "cifar-stage3-bf16-2", help="comma-separated names: " + ", ".join(RUNS))
    parser.add_argument("--write", help="store DeepSpeed's losses here (the test's reference)")
    args = parser.parse_args()
    reference = {}
    for i, name in enumerate(args.runs.split(",")):
        run = RUNS[name]
        out = {"run": name, "script": run["script"], "args": run["args"], "nproc": run["nproc"]}
        for system, python in (("deepspeed", args.deepspeed_python), ("fxzero", args.fxzero_python)):
            with tempfile.TemporaryDirectory() as workdir:
                out[system] = launch(system, run, workdir, python, 29600 + 2 * i + (system == "fxzero"))
        ds, fx = out["deepspeed"]["losses"], out["fxzero"]["losses"]
        out["steps"] = len(ds)
        out["max_abs_loss_difference"] = max(abs(a - b) for a, b in zip(ds, fx)) if len(ds) == len(fx) else None
        for system in ("deepspeed", "fxzero"):
            times = out[system]["step_s"][1:]  # (the first step compiles, or warms caches)
            out[f"{system}_median_step_s"] = statistics.median(times) if times else None
        print(json.dumps(out), flush=True)
        reference[name] = {"args": run["args"], "nproc": run["nproc"], "losses": ds}
    if args.write:
        with open(args.write, "w") as f:
            json.dump({"deepspeed": "0.19.8", "note": "rank 0's per-step losses under DeepSpeed on its CPU "
                       "accelerator, written by tools/deepspeed_examples.py", "runs": reference}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

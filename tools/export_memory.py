"""Peak memory of `fxzero export` on a 1B-parameter checkpoint: about one tensor, never the model.

    nice .venv/bin/python tools/export_memory.py                  # gpt-1b, fp32 and bf16 exports

A first child process builds the model on the meta device, compiles it in a world of one (its
parameters initialized by the model's own init, unit by unit) and saves a checkpoint (the fp32
masters and AdamW's two moments) into a directory under --dir. Then `fxzero export` runs on it
in a child once per --dtypes entry, and its peak RSS is that child's own (os.wait4's rusage).
This process imports no torch and holds no model: a child started by fork or vfork begins in its
parent's memory, and Linux counts the parent's peak into the child's maxrss. One JSON line per
event goes to stdout:

- "checkpoint": the model's parameter count, the checkpoint's bytes, build and save seconds;
- "export": per dtype, peak RSS, seconds, bytes written, and the largest tensor's bytes;
- "summary": each export's peak RSS against the target (--rss-target-gib, 1.5 by default).

The checkpoint and the exports are removed at the end (--keep leaves them). Progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def progress(msg: str) -> None:
    print(f"[export_memory {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def build_checkpoint(model_name: str, save_dir: str) -> dict:
    """(In the --build child.) Compile `model_name` in a world of one and save its checkpoint."""
    import math

    import torch

    sys.path.insert(0, ROOT)
    import fxzero
    from fxzero import zoo

    start = time.monotonic()
    with torch.device("meta"):
        model = zoo.build(model_name)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    built = time.monotonic()
    progress(f"compiled {model_name}: {engine.num_params:,} parameters in {built - start:.0f} s; saving")
    path = engine.save_checkpoint(save_dir)
    saved = time.monotonic()
    with open(os.path.join(path, "fxzero.json")) as f:
        tensors = json.load(f)["tensors"]
    largest = max(math.prod(shape) * getattr(torch, dtype).itemsize for _, shape, dtype in tensors)
    return {"event": "checkpoint", "model": model_name, "params": engine.num_params, "path": path,
            "bytes": dir_bytes(path), "largest_tensor_bytes": largest, "build_seconds": built - start,
            "save_seconds": saved - built}


def fxzero_command() -> list[str]:
    """The `fxzero` console script beside this interpreter, or the same entry point by -c."""
    script = os.path.join(os.path.dirname(sys.executable), "fxzero")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "import sys; from fxzero.cli import main; sys.exit(main())"]


def run_export(save_dir: str, out: str, dtype: str) -> dict:
    """`fxzero export save_dir out --dtype dtype` in a child; its own peak RSS from os.wait4."""
    command = [*fxzero_command(), "export", save_dir, out, "--dtype", dtype]
    start = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.monotonic() - start
    child.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait again)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed with exit code {child.returncode}:\n{output}")
    summary = json.loads(output.strip().splitlines()[-1])
    return {"event": "export", "dtype": dtype, "command": " ".join(command), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "seconds": seconds, "export_seconds": summary["seconds"], "bytes": summary["bytes"],
            "tensors": summary["tensors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-1b", help="zoo model (default gpt-1b)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="exports to run, comma-separated (fp32,bf16,fp16)")
    parser.add_argument("--dir", default="/tmp", help="where the checkpoint and exports go (about 22 GB for gpt-1b)")
    parser.add_argument("--rss-target-gib", type=float, default=1.5)
    parser.add_argument("--keep", action="store_true", help="leave the checkpoint and exports on disk")
    parser.add_argument("--build", metavar="SAVE_DIR", default=None, help=argparse.SUPPRESS)  # the first child
    args = parser.parse_args()
    if args.build is not None:
        emit(build_checkpoint(args.model, args.build))
        return

    root = tempfile.mkdtemp(prefix="fxzero-export-memory-", dir=args.dir)
    try:
        save_dir = os.path.join(root, "ckpt")
        built = subprocess.run([sys.executable, os.path.abspath(__file__), "--build", save_dir, "--model", args.model],
                               stdout=subprocess.PIPE, text=True, check=True)
        checkpoint = json.loads(built.stdout.strip().splitlines()[-1])
        emit(checkpoint)
        exports = []
        for dtype in args.dtypes.split(","):
            progress(f"fxzero export --dtype {dtype}")
            exports.append(run_export(save_dir, os.path.join(root, f"export-{dtype}"), dtype))
            emit({**exports[-1], "largest_tensor_bytes": checkpoint["largest_tensor_bytes"]})
        target = args.rss_target_gib * GiB
        emit({"event": "summary", "model": args.model, "checkpoint_bytes": checkpoint["bytes"],
              "rss_target_bytes": int(target),
              "exports": {e["dtype"]: {"peak_rss_gib": round(e["peak_rss_bytes"] / GiB, 3),
                                       "seconds": round(e["seconds"], 1), "bytes": e["bytes"],
                                       "met": e["peak_rss_bytes"] < target} for e in exports}})
    finally:
        if args.keep:
            progress(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

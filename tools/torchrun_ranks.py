"""Running a tool's rank function on N local ranks, one fresh torchrun per run, for side-by-side
measurements (tools/recompute_memory.py, tools/offload_activations.py, tools/tiling.py).

Each rank writes its result as JSON to `<out>/rank<r>.json` (their stdout interleaves); the
caller gets the ranks' results in rank order, or an error with the ranks' stderr tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def run_ranks(script: str, label: str, ranks: int, args: list[str], timeout: float) -> list[dict]:
    """`python -m torch.distributed.run --standalone --nproc_per_node=ranks script --rank-main
    --out DIR *args`, one thread per rank; the ranks' JSON results."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               script, "--rank-main", "--out", out, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"{label}: rank processes failed:\n{proc.stderr[-3000:]}")
        results = []
        for r in range(ranks):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results

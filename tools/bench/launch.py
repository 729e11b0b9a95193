"""Start the ranks of one run as fresh processes and collect what they wrote.

Fresh processes per run keep each system's peak RSS its own (nothing inherited from an earlier
system, no allocator state carried over) and make alternating systems run for run trivial.
A run never hangs the benchmark: when a rank fails, its peers (likely blocked in a collective)
are killed after a short grace; past the spec's timeout every rank is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from tools.bench.common import SCRATCH_ENV, children_cpu_seconds, cpu_busy_seconds, nvme_parent
from tools.bench.spec import RunSpec
from tools.bench.systems import SYSTEMS

__all__ = ["REPO_ROOT", "run_system"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# After one rank fails, how long its peers get to finish on their own before they are killed.
_PEER_GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(spec: RunSpec, rank: int, port: int, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(spec.threads)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _wait(procs: list[subprocess.Popen], *, deadline: float) -> bool:
    """Wait for every rank; stop early when one failed and its peers outlived the grace.

    Returns whether the deadline passed.
    """
    first_failure: Optional[float] = None
    while any(p.poll() is None for p in procs):
        now = time.perf_counter()
        if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
            first_failure = now
        if now > deadline:
            return True
        if first_failure is not None and now - first_failure > _PEER_GRACE_S:
            return False
        time.sleep(0.2)
    return False


def run_system(
    name: str, spec: RunSpec, *, python: str = sys.executable, log_dir: Optional[str] = None
) -> dict[str, Any]:
    """Run system `name` once on `spec.world_size` fresh rank processes.

    Returns {"ranks": [per-rank results in rank order], "wall_s": ...} or, when the run failed,
    {"error": message, "wall_s": ...} with the failing rank's traceback or log tail.
    """
    system = SYSTEMS[name]
    out = tempfile.mkdtemp(prefix=f"bench-{name}-", dir=log_dir)
    # The ranks' NVMe offload folders go in here (common.nvme_scratch), removed after the run
    # even when a rank was killed before it could remove its own (GBs at 1B parameters).
    scratch = tempfile.mkdtemp(prefix=f"bench-{name}-scratch-", dir=nvme_parent())
    port = _free_port()
    procs, logs = [], []
    busy0, ours0 = cpu_busy_seconds(), children_cpu_seconds()
    t0 = time.perf_counter()
    for rank in range(spec.world_size):
        log = os.path.join(out, f"rank{rank}.log")
        logs.append(log)
        with open(log, "wb") as f:
            procs.append(
                subprocess.Popen(
                    [python, "-m", "tools.bench.worker", "--system", name, "--spec", spec.to_json(), "--out", out],
                    cwd=REPO_ROOT,
                    env=_rank_env(spec, rank, port, {**system.env, SCRATCH_ENV: scratch}),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # so a kill reaches the rank's own children too
                )
            )
    try:
        timed_out = _wait(procs, deadline=t0 + spec.timeout_s)
    finally:  # also on KeyboardInterrupt / SIGTERM of the benchmark: leave no rank behind
        _kill(procs)
        shutil.rmtree(scratch, ignore_errors=True)
    wall_s = time.perf_counter() - t0
    busy1, ours1 = cpu_busy_seconds(), children_cpu_seconds()
    load = {}
    if busy0 is not None and busy1 is not None:
        # What else kept the machine busy during this run: CPU time of all processes minus our
        # ranks' own. Runs that shared the cores with other work show it here.
        load = {
            "ranks_cpu_s": ours1 - ours0,
            "background_cores": max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall_s,
        }

    results, errors = [], []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            if "error" in result:
                errors.append(result["error"])
            results.append(result)
        else:
            why = "timed out" if timed_out else f"exited with code {p.returncode}"
            errors.append(f"[rank {rank}] {why} without a result; log tail:\n{_tail(log)}")
    if errors:
        # The first error in rank order is usually the cause; peers report the broken group.
        return {"error": errors[0], "wall_s": wall_s, "logs": out, **load}
    if log_dir is None:
        for path in os.listdir(out):
            os.remove(os.path.join(out, path))
        os.rmdir(out)
    return {"ranks": results, "wall_s": wall_s, **load}

"""One rank of one benchmark run: `python -m tools.bench.worker --system NAME --spec JSON --out DIR`.

The launcher sets the torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). The rank
wraps torch.distributed's collectives for counting before anything else binds them, joins the
gloo group, builds its system's trainer, runs the warm-up and timed steps on the benchmark's
batches, and writes everything it measured to DIR/rank{R}.json (an "error" key on failure).
Nothing is communicated for the measurement itself: results travel by file, so no extra
collective lands in the traffic counts or the step times. (The one exception is a trainer's
`align()`, the floor's barrier before each step: outside the step's time, not counted, and its
loopback bytes left out of the wire figure.)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tools.bench import commcount
from tools.bench.common import StepClock, loopback_bytes, make_batch, peak_rss_bytes, rss_bytes
from tools.bench.spec import RunSpec, gpt_shape
from tools.bench.systems import SYSTEMS


def _write(path: str, result: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def run(name: str, spec: RunSpec) -> dict[str, Any]:
    """Train `spec.total_steps` steps of system `name` on this rank; returns the measurements."""
    system = SYSTEMS[name]
    counter = commcount.CommCounter()
    commcount.install(counter)
    torch.set_num_threads(spec.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.timeout_s))
    rank = dist.get_rank()
    shape = gpt_shape(spec.model, spec.seq)
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    trainer = None
    try:
        runner = importlib.import_module(f"tools.bench.{system.runner}")
        t0 = time.perf_counter()
        trainer = runner.setup(spec, counter, system.options)
        gc.collect()
        result["setup_s"] = time.perf_counter() - t0
        result["rss_after_setup_bytes"] = rss_bytes()
        result["peak_rss_after_setup_bytes"] = peak_rss_bytes()

        losses, times = [], []
        wire_start = None
        align = getattr(trainer, "align", None)  # the floor's barrier before each step (floor.py)
        align_wire = 0
        for step in range(spec.total_steps):
            if align is not None:  # untimed and uncounted; its loopback bytes are left out too
                counting, counter.enabled = counter.enabled, False
                before = loopback_bytes()
                align()
                after = loopback_bytes()
                counter.enabled = counting
                if wire_start is not None and before is not None and after is not None:
                    align_wire += after - before
            if step == spec.warmup:
                counter.reset()
                counter.enabled = True
                trainer.reset_counters()
                wire_start = loopback_bytes()
            x, y = make_batch(spec, shape.vocab_size, shape.seq_len, step, rank)
            with StepClock() as clock:
                losses.append(trainer.step(x, y))
            times.append(clock.seconds)
        counter.enabled = False
        wire_end = loopback_bytes()

        result["peak_rss_bytes"] = peak_rss_bytes()
        result["losses"] = losses
        result["step_times_s"] = times
        result["comm"] = counter.report(spec.steps)
        if wire_start is not None and wire_end is not None:
            result["loopback_bytes_per_step"] = (wire_end - wire_start - align_wire) / spec.steps
        result.update(trainer.report())
        if hasattr(trainer, "predict"):  # after the peak was read: calibration allocates
            result.update(trainer.predict())
    finally:
        close = getattr(trainer, "close", None)
        if close is not None:
            close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    parser.add_argument("--spec", required=True, help="RunSpec as JSON")
    parser.add_argument("--out", required=True, help="folder for rank{R}.json")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    path = os.path.join(args.out, f"rank{rank}.json")
    try:
        result = run(args.system, RunSpec.from_json(args.spec))
    except BaseException:
        _write(path, {"rank": rank, "error": f"[rank {rank}] " + traceback.format_exc()})
        sys.stdout.flush()
        os._exit(1)  # a peer may be blocked in a collective: don't wait in teardown
    _write(path, result)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

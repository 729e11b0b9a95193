"""How much communication prefetch hides, on an emulated link whose comm time equals compute.

Loopback on this box is nearly free, so the link emulator (fxzero.LinkEmulation: collectives
complete as if on a link of the given bandwidth; the waiting rank sleeps) stands in for a real
network. The tool
1. measures the step time with no emulation: `compute` (plus loopback's own small cost);
2. sets the emulated bandwidth so that ZeRO-3's full traffic (3 x Phi elements: every unit
   gathered in the forward and again in the backward, and reduce-scattered) takes that long too;
3. measures fxzero ZeRO-3 on that link: with prefetch (the default, which keeps the units the
   backward needs first gathered from the forward, so it moves less), with prefetch but every
   unit gathered twice (Prefetch(keep_for_backward=False): exactly 3 x Phi), and without prefetch.
It prints one JSON line per run, each with its own `comm` (its bytes on that link) and its step
time against max(compute, comm) and compute + comm, and a summary with the ratios the issue asks
for: with prefetch within 1.15 x max(compute, comm); without, about compute + comm.

    .venv/bin/python tools/overlap.py --model small --ranks 2 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import fxzero
from fxzero import zoo


def _steps(rank: int, args, config: fxzero.Config, steps: Optional[int] = None) -> dict:
    with torch.device("meta"):
        model = zoo.gpt(args.model)
    engine = fxzero.compile(model, config)
    cfg = model.config
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    times = []
    for i in range(args.warmup + (steps or args.steps)):
        dist.barrier()
        start = time.perf_counter()
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        report = engine.comm_report(reset=True)
    wire = sum(k["bytes"] for k in report.values())
    return {"median_step_s": statistics.median(times[args.warmup :]), "bytes_per_step": wire}


def _rank(rank: int, args, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    results = []
    try:
        # Native collectives everywhere (no cost-model choice), so runs differ only in scheduling.
        base = _steps(rank, args, fxzero.Config(stage=3, cost_model=None))
        compute = base["median_step_s"]
        results.append({"run": "no emulation", **base})
        # The link is set by ZeRO-3's full traffic (3 x Phi: every unit gathered twice), which
        # takes `compute` on it. Wire bytes per rank: each collective moves (N-1)/N of its buffer.
        full = _steps(rank, args, fxzero.Config(stage=3, prefetch=None, cost_model=None), steps=1)
        wire_of = lambda r: r["bytes_per_step"] * (args.ranks - 1) / args.ranks  # noqa: E731
        link = fxzero.LinkEmulation(bandwidth=wire_of(full) / compute, latency=0.0)
        runs = (
            ("prefetch", fxzero.Prefetch()),
            ("prefetch, every unit gathered twice", fxzero.Prefetch(keep_for_backward=False)),
            ("no prefetch", None),
        )
        for name, prefetch in runs:
            r = _steps(rank, args, fxzero.Config(stage=3, prefetch=prefetch, link_emulation=link, cost_model=None))
            comm = wire_of(r) / link.bandwidth
            results.append({
                "run": f"emulated link, {name}", "bandwidth_bytes_per_s": link.bandwidth, "comm_s": comm, **r,
                "vs_max_compute_comm": r["median_step_s"] / max(compute, comm),
                "vs_compute_plus_comm": r["median_step_s"] / (compute + comm),
            })
        if rank == 0:
            with_pf, twice, without = results[1:]
            summary = {
                "summary": True,
                "model": args.model,
                "compute_s": compute,
                "comm_s_3phi": wire_of(full) / link.bandwidth,
                "prefetch_step_s": with_pf["median_step_s"],
                "prefetch_vs_max": with_pf["vs_max_compute_comm"],
                "prefetch_gathered_twice_vs_max": twice["vs_max_compute_comm"],
                "no_prefetch_step_s": without["median_step_s"],
                "no_prefetch_vs_sum": without["vs_compute_plus_comm"],
                "target": "prefetch_vs_max <= 1.15",
            }
            with open(out_path, "w") as f:
                for r in results:
                    f.write(json.dumps(r) + "\n")
                f.write(json.dumps(summary) + "\n")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_path = f"/tmp/fxzero-overlap-{os.getpid()}.jsonl"
    mp.start_processes(_rank, args=(args, port, out_path), nprocs=args.ranks, start_method="spawn")
    with open(out_path) as f:
        print(f.read(), end="")
    os.unlink(out_path)


if __name__ == "__main__":
    main()

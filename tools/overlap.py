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
   The step times of 1 and 3 come from interleaved rounds (one step of each configuration per
   round), so the box's slow periods do not land on one configuration only.
It prints one JSON line per run, each with its own `comm` (its bytes on that link) and its step
time against max(compute, comm) and compute + comm, and a summary with the ratios the issue asks
for: with prefetch within 1.15 x max(compute, comm); without, about compute + comm.

    .venv/bin/python tools/overlap.py --model small --ranks 2 --steps 9
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import fxzero
from fxzero import zoo


def _engine(rank: int, args, config: fxzero.Config):
    with torch.device("meta"):
        model = zoo.gpt(args.model)
    engine = fxzero.compile(model, config)
    cfg = model.config
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
    return engine, x, y


def _step(engine, x, y) -> tuple[float, int]:
    """One training step: its time and the bytes its collectives moved."""
    dist.barrier()
    start = time.perf_counter()
    loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
    engine.backward(loss)
    engine.step()
    took = time.perf_counter() - start
    return took, sum(k["bytes"] for k in engine.comm_report(reset=True).values())


def _rank(rank: int, args, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        # Native collectives everywhere (no cost-model choice), so runs differ only in scheduling.
        base = _engine(rank, args, fxzero.Config(stage=3, cost_model=None))
        calibration = [_step(*base)[0] for _ in range(args.warmup + 3)][args.warmup :]
        # The link is set by ZeRO-3's full traffic (3 x Phi: every unit gathered twice), which
        # takes the calibration's compute time on it. Wire bytes per rank: each collective moves
        # (N-1)/N of its buffer.
        wire_of = lambda nbytes: nbytes * (args.ranks - 1) / args.ranks  # noqa: E731
        _, full_bytes = _step(*_engine(rank, args, fxzero.Config(stage=3, prefetch=None, cost_model=None)))
        link = fxzero.LinkEmulation(bandwidth=wire_of(full_bytes) / statistics.median(calibration), latency=0.0)
        runs = {"no emulation": base}
        for name, prefetch in (("prefetch", fxzero.Prefetch()),
                               ("prefetch, every unit gathered twice", fxzero.Prefetch(keep_for_backward=False)),
                               ("no prefetch", None)):
            config = fxzero.Config(stage=3, prefetch=prefetch, link_emulation=link, cost_model=None)
            runs[f"emulated link, {name}"] = _engine(rank, args, config)
        # [Note: interleaved rounds] Each round runs one step of every configuration, so a slow
        # period of this shared box slows them all alike instead of one configuration's steps.
        times: dict[str, list[float]] = {name: [] for name in runs}
        wire: dict[str, int] = {}
        for _ in range(args.warmup + args.steps):
            for name, run in runs.items():
                took, wire[name] = _step(*run)
                times[name].append(took)
        median = {name: statistics.median(t[args.warmup :]) for name, t in times.items()}
        compute = median["no emulation"]
        results = [{"run": "no emulation", "median_step_s": compute, "bytes_per_step": wire["no emulation"]}]
        for name in list(runs)[1:]:
            comm = wire_of(wire[name]) / link.bandwidth
            results.append({
                "run": name, "bandwidth_bytes_per_s": link.bandwidth, "comm_s": comm,
                "median_step_s": median[name], "bytes_per_step": wire[name],
                "vs_max_compute_comm": median[name] / max(compute, comm),
                "vs_compute_plus_comm": median[name] / (compute + comm),
            })
        if rank == 0:
            with_pf, twice, without = results[1:]
            summary = {
                "summary": True,
                "model": args.model,
                "steps": args.steps,
                "compute_s": compute,
                "comm_s_3phi": wire_of(full_bytes) / link.bandwidth,
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
    parser.add_argument("--steps", type=int, default=9)
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

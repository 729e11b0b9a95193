"""Activation offload side by side: the 25M zoo GPT at long sequence, resident against
`Activations(offload=Nvme(...))`, on 2 CPU ranks.

    .venv/bin/python tools/offload_activations.py --seq 1024 --batch 4 --rounds 2 [--recompute unit]

One invocation runs the policies alternately (resident, nvme, resident, nvme, ...), each in fresh
rank processes (torchrun, gloo, one thread per rank), the same model, data and steps, each with
the cost model `--cost-model` names (default "cpu-loopback", the preset for this kind of machine:
fixed, so both policies compile the same collectives). Each run
prints one JSON line per rank: the median step time of the timed steps, peak RSS (VmHWM), after
the last forward the activation bytes held in memory (`memory_report()["activations"]`) and on
the disk (`activations_nvme`), the offloaded tensors and bytes the program moves per step, the
bytes the NVMe tier wrote and read, and the losses. The last line compares nvme with resident
by medians over rounds (the slowest rank of each run); losses must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.torchrun_ranks import run_ranks  # noqa: E402

POLICIES = ("resident", "nvme")


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import fxzero
    from fxzero.zoo import gpt

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = gpt("small", seq_len=args.seq)
    offload = fxzero.Nvme(path=args.nvme_path) if args.policy == "nvme" else None
    cost_model = None if args.cost_model == "none" else args.cost_model
    config = fxzero.Config(stage=3, seed=0, cost_model=cost_model,
                           activations=fxzero.Activations(recompute=args.recompute, offload=offload))
    engine = fxzero.compile(model, config)
    rank = engine.rank
    gen = torch.Generator().manual_seed(7 + rank)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
               for _ in range(args.warmup + args.steps)]
    times, losses = [], []
    for i, ids in enumerate(batches):
        start = time.perf_counter()
        loss = F.cross_entropy(engine(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        memory = engine.memory_report()  # (after the forward: what it keeps, where)
        engine.backward(loss)
        engine.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    forward = engine.schedule.program("forward").instructions
    moved = [i.bytes for i in forward if i.kind == "offload" and i.state == "activation"]
    io = engine.io_report().get("activations", {})
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    line = {"event": "rank", "policy": args.policy, "rank": rank, "median_step_s": statistics.median(times),
            "peak_rss_bytes": hwm, "activations_resident_bytes": memory["activations"],
            "activations_nvme_bytes": memory["activations_nvme"], "offloaded_tensors": len(moved),
            "offloaded_bytes_per_step": sum(moved), "nvme_written_bytes": io.get("write", {}).get("bytes", 0),
            "nvme_read_bytes": io.get("read", {}).get("bytes", 0), "nvme_direct": io.get("direct"),
            "nvme_io": {k: io[k] for k in ("read", "write") if k in io},
            "predicted": _predicted(engine), "losses": losses}
    engine.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:  # (the ranks' stdout interleaves)
        json.dump(line, f)


def _predicted(engine) -> dict:
    """The simulator's step of this program on the cost model it was compiled with (calibrated
    here under --cost-model measure): its I/O time and the part of it no compute hides, beside
    the measured ones."""
    from fxzero.cost.simulate import simulate

    if engine.cost_model is None:
        return {}
    sim = simulate(engine.schedule, engine.cost_model)
    io = {k: v.bandwidth for k, v in engine.cost_model.io.items() if k.startswith("nvme")}
    return {"step_s": sim.step_seconds, "io_s": sim.io_seconds, "exposed_io_s": sim.exposed_io_seconds,
            "nvme_bytes_per_s": io}


def run(policy: str, args: argparse.Namespace) -> list[dict]:
    return run_ranks(__file__, policy, args.ranks, [
        "--policy", policy, "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--recompute", args.recompute, "--nvme-path", args.nvme_path,
        "--cost-model", args.cost_model], args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--recompute", choices=("none", "unit"), default="none")
    parser.add_argument("--cost-model", default="cpu-loopback",
                        help="Config.cost_model: a preset (default: this kind of machine), \"measure\" or \"none\"")
    parser.add_argument("--nvme-path", default=None, help="the disk directory (default: a new one under /tmp)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--policy", choices=POLICIES, default="resident", help=argparse.SUPPRESS)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:
        args.nvme_path = args.nvme_path or scratch
        print(json.dumps({"event": "config", **{k: v for k, v in vars(args).items()
                                                if k not in ("policy", "rank_main", "out")}}), flush=True)
        results: dict[str, list[list[dict]]] = {p: [] for p in POLICIES}
        for r in range(args.rounds):
            for policy in POLICIES:
                ranks = run(policy, args)
                results[policy].append(ranks)
                for line in ranks:
                    print(json.dumps({**line, "round": r}), flush=True)

    def median(policy: str, key: str) -> float:
        return statistics.median(max(line[key] for line in ranks) for ranks in results[policy])

    summary: dict = {"event": "summary"}
    for key in ("median_step_s", "peak_rss_bytes", "activations_resident_bytes"):
        summary[key] = {p: median(p, key) for p in POLICIES}
        summary[key]["nvme_over_resident"] = summary[key]["nvme"] / summary[key]["resident"]
    summary["losses_equal"] = all(a["losses"] == b["losses"] for ra, rb in zip(results["resident"], results["nvme"])
                                  for a, b in zip(ra, rb))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Memory-centric tiling side by side: a model with a 32768 x 4096 Linear (512 MiB of fp32
weight), untiled against `Tiling(max_bytes=64 MiB)`, ZeRO-3 on 2 CPU ranks.

    .venv/bin/python tools/tiling.py --rounds 2

One invocation runs the two alternately (untiled, tiled, untiled, tiled, ...), each in fresh
rank processes (torchrun, gloo, one thread per rank), the same model, data and steps. Each run
prints one JSON line per rank: the median step time of the timed steps, the gathered peak
(`memory_report()["gathered_peak"]`: the most bytes of gathered parameter buffers alive at once),
the schedule's own figure for it, the all-gather bytes (`comm_report()`), peak RSS (VmHWM) and the
losses; the last line compares them (tiled / untiled step time by medians over rounds; the largest
relative loss difference; the tiled gathered peak against max_bytes plus the largest other unit).
Losses are not bit for bit: the input's gradient sums the tiles' products in another order
([Note: tiling] in `fxzero/passes/tile.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.torchrun_ranks import run_ranks  # noqa: E402

MODES = ("untiled", "tiled")


def _model(d_in: int, hidden: int, out: int, bottleneck: int):
    import torch
    import torch.nn as nn

    class WideHead(nn.Module):
        """A small trunk (each weight a few MiB) and a wide output Linear (hidden -> out)."""

        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(d_in, hidden)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, bottleneck), nn.GELU(),
                                                      nn.Linear(bottleneck, hidden)) for _ in range(2))
            self.head = nn.Linear(hidden, out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.inp(x))
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    return WideHead()


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import fxzero

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(args.d_in, args.hidden, args.out_features, args.bottleneck)
    tiling = fxzero.Tiling(max_bytes=args.max_mib << 20) if args.mode == "tiled" else None
    engine = fxzero.compile(model, fxzero.Config(stage=3, seed=0, cost_model=None, tiling=tiling))
    rank = engine.rank
    gen = torch.Generator().manual_seed(7 + rank)
    batches = [(torch.randn(args.batch, args.seq, args.d_in, generator=gen),
                torch.randint(0, args.out_features, (args.batch, args.seq), generator=gen))
               for _ in range(args.warmup + args.steps)]
    times, phases, losses = [], [], []
    for i, (x, y) in enumerate(batches):
        if i == len(batches) - 1:
            engine.record_timeline(True)
        t0 = time.perf_counter()
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            times.append(t3 - t0)
            phases.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2})
        losses.append(loss.item())
    by_kind: dict[str, float] = {}  # the last step's instructions: time per program and kind (a wait: exposed)
    for t in engine.timeline():
        ins = engine.schedule.program(t.program).instructions[t.index]
        key = f"{t.program}:{ins.kind}"
        by_kind[key] = round(by_kind.get(key, 0.0) + t.end - t.start, 4)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    units = {u.name: u.padded_numel * u.itemsize for u in engine.layouts}
    tiles = [u for u in units if ":tile" in u]
    line = {"event": "rank", "mode": args.mode, "rank": rank, "median_step_s": statistics.median(times),
            "median_phase_s": {k: round(statistics.median(p[k] for p in phases), 4) for k in phases[0]},
            "last_step_instruction_s": by_kind,
            "gathered_peak_bytes": engine.memory_report()["gathered_peak"],
            "schedule_peak_gathered_bytes": engine._stepping.compiled.schedule.peak_gathered_bytes,
            "all_gather_bytes": engine.comm_report()["all_gather"]["bytes"], "peak_rss_bytes": hwm,
            "tiles": len(tiles), "tile_bytes": max((units[u] for u in tiles), default=0),
            "largest_other_unit_bytes": max(b for u, b in units.items() if u not in tiles), "losses": losses}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:  # (the ranks' stdout interleaves)
        json.dump(line, f)


def run(mode: str, args: argparse.Namespace) -> list[dict]:
    return run_ranks(__file__, mode, args.ranks, [
        "--mode", mode, *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                          ("seq", "batch", "steps", "warmup", "d_in", "hidden", "out_features", "bottleneck", "max_mib")]],
        args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    parser.add_argument("--d-in", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096, help="the wide Linear's input features")
    parser.add_argument("--out-features", type=int, default=32768, help="the wide Linear's output features")
    parser.add_argument("--bottleneck", type=int, default=256)
    parser.add_argument("--max-mib", type=int, default=64, help="Tiling(max_bytes=...) in MiB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--mode", choices=MODES, default="untiled", help=argparse.SUPPRESS)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    print(json.dumps({"event": "config", **{k: v for k, v in vars(args).items()
                                            if k not in ("mode", "rank_main", "out")}}))
    results: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            ranks = run(mode, args)
            results[mode].append(ranks)
            for line in ranks:
                print(json.dumps({**line, "round": r}), flush=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(max(line[key] for line in ranks) for ranks in results[mode])

    summary: dict = {"event": "summary"}
    for key in ("median_step_s", "gathered_peak_bytes", "schedule_peak_gathered_bytes", "all_gather_bytes",
                "peak_rss_bytes"):
        summary[key] = {m: median(m, key) for m in MODES}
    summary["step_tiled_over_untiled"] = summary["median_step_s"]["tiled"] / summary["median_step_s"]["untiled"]
    tiled = results["tiled"][0][0]
    summary["tiled_bound_bytes"] = (args.max_mib << 20) + tiled["largest_other_unit_bytes"]
    summary["tiled_peak_within_bound"] = summary["gathered_peak_bytes"]["tiled"] <= summary["tiled_bound_bytes"]
    summary["max_relative_loss_difference"] = max(
        abs(a - b) / abs(b) for ra, rb in zip(results["tiled"], results["untiled"])
        for x, y in zip(ra, rb) for a, b in zip(x["losses"], y["losses"]))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

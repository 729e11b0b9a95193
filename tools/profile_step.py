"""Where one fxzero training step spends its time, measured on real ranks.

Runs the zoo GPT on N gloo ranks, records the executed timeline (every forward and backward
instruction with start and end), and prints one JSON line per rank: time per program, time
spent in waits (communication left exposed), the slowest op kinds, and what the simulator
predicts for the same schedule with the engine's calibrated cost model; the median time of the
phases (forward, backward, the optimizer step) over the steps after the first.

    .venv/bin/python tools/profile_step.py --model small --ranks 2 --steps 4
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import fxzero
from fxzero import zoo
from fxzero.cost import simulate


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        with torch.device("meta"):
            model = zoo.gpt(args.model, **dict(_override(o) for o in args.override))
        prefetch = None if args.no_prefetch else fxzero.Prefetch()
        offload = fxzero.Offload()
        if args.offload:
            place = fxzero.Cpu() if args.offload == "cpu" else fxzero.Nvme(path=args.nvme_path)
            offload = fxzero.Offload(params=place, optimizer=place, step_in_backward=args.step_in_backward,
                                     lookahead=args.lookahead)
        link = fxzero.LinkEmulation(bandwidth=args.link_bandwidth, latency=0.0) if args.link_bandwidth else None
        optimizer = {"adamw": fxzero.AdamW(), "lamb": fxzero.Lamb()}[args.optimizer]
        engine = fxzero.compile(model, fxzero.Config(stage=args.stage, prefetch=prefetch, offload=offload,
                                                     link_emulation=link, optimizer=optimizer,
                                                     activations=fxzero.Activations(recompute=args.recompute)))
        cfg = model.config
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
        y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
        steps = []
        for i in range(args.steps):
            if i == args.steps - 1:
                engine.record_timeline(True)
            dist.barrier()
            t0 = time.perf_counter()
            loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            steps.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "total": t3 - t0})
        schedule = engine.schedule
        by_kind: dict[str, float] = collections.Counter()
        by_op: dict[str, float] = collections.Counter()
        per_program: dict[str, float] = collections.Counter()
        for t in engine.timeline():
            program = schedule.program(t.program)
            ins = program.instructions[t.index]
            seconds = t.end - t.start
            kind = ins.kind
            if kind == "wait":  # exposed time, by what was waited for
                waited = next((i for i in program.instructions if i.name == ins.reads[0]), None)
                kind = f"wait({waited.kind if waited else '?'})"
            by_kind[f"{t.program}:{kind}"] += seconds
            per_program[t.program] += seconds
            if ins.kind == "compute":
                node = engine._last.compiled.programs[t.program].gm.graph
                by_op[_op_name(node, ins.name)] += seconds
        predicted = simulate(schedule, engine.cost_model) if engine.cost_model is not None else None
        last = steps[-1]
        print(json.dumps({
            "rank": rank,
            "model": args.model,
            "params": engine.num_params,
            "optimizer": args.optimizer,
            "last_step_s": {k: round(v, 4) for k, v in last.items()},
            "median_step_s": {k: round(statistics.median(s[k] for s in steps[1:] or steps), 4) for k in last},
            "instruction_s": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_ops_s": {k: round(v, 4) for k, v in by_op.most_common(8)},
            "io": engine.io_report(),
            "predicted": None if predicted is None else {k: round(v, 4) if isinstance(v, float) else v for k, v in predicted.summary().items()},
            "cost_model": None if engine.cost_model is None else engine.cost_model.to_json(),
        }), flush=True)
        engine.close()
    finally:
        dist.destroy_process_group()


def _override(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)


def _op_name(graph, name: str) -> str:
    for n in graph.nodes:
        if n.name == name:
            return str(getattr(n.target, "__name__", n.target))
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="zoo GPT size (tiny, small, gpt2)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--optimizer", choices=["adamw", "lamb"], default="adamw",
                        help="fxzero.AdamW() or fxzero.Lamb() (its per-parameter norms: one all-reduce per unit)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                        help="GPTConfig field for the zoo model, e.g. --override n_blocks=20")
    parser.add_argument("--offload", choices=["cpu", "nvme"], default=None,
                        help="parameters and optimizer states on this tier")
    parser.add_argument("--nvme-path", default="/var/tmp", help="directory for --offload nvme")
    parser.add_argument("--step-in-backward", action="store_true", help="Offload(step_in_backward=True)")
    parser.add_argument("--lookahead", type=int, default=1, help="Offload(lookahead=...)")
    parser.add_argument("--recompute", choices=["none", "unit", "selective"], default="none",
                        help="fxzero.Activations(recompute=...)")
    parser.add_argument("--link-bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                        help="emulate a link of this bandwidth (fxzero.LinkEmulation), as tools/overlap.py does")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(args, port), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()

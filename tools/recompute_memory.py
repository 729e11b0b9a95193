"""Activation recompute side by side: the 25M zoo GPT at long sequence, resident against
`Activations(recompute="unit")` and `"selective"`, and the memory budget's planner, on 2 CPU ranks.

    .venv/bin/python tools/recompute_memory.py --seq 1024 --batch 4 --rounds 2
    .venv/bin/python tools/recompute_memory.py --seq 1024 --batch 4 --rounds 1 \
        --policies none budget budget-recompute budget-offload --budget-mib 400

One invocation runs the policies alternately (resident, unit, selective, resident, ...), each in
fresh rank processes (torchrun, gloo, one thread per rank), the same model, data and steps. Each
run prints, per rank: the median step time of the timed steps, peak RSS (VmHWM), the activation
bytes the forward keeps for the backward (the compiled program's saved tensors by storage, as
`memory_report()["activations"]` counts them: `fxzero.activation_estimate.count_saved`;
`kept_gathered_bytes` apart: gathered parameters the prefetch keeps for the backward) and the
losses; a budget run adds what the planner chose and the peak held (`memory_report()`'s
activations_peak, against the budget). The last line compares each policy with the resident one
(P / resident) by medians over rounds, and the planner with the faster of recompute-only and
offload-only at the same budget. Losses must be equal bit for bit (recompute changes where
values are computed, not their arithmetic; offload moves them).
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

POLICIES = ("none", "unit", "unit-attention", "selective", "budget", "budget-recompute", "budget-offload")
"""Recompute policies ("unit-attention": recompute="unit", keep_attention=True), and the memory
budget's planner (--budget-mib) free to recompute and offload to NVMe, or limited to one of them
(`Activations.budget_choices`)."""


def activations(policy: str, args: argparse.Namespace):
    import fxzero

    if not policy.startswith("budget"):
        from fxzero.activation_estimate import policy_activations

        return policy_activations(policy)
    if args.budget_mib is None:
        raise SystemExit(f"--policies {policy} needs --budget-mib")
    budget = int(args.budget_mib * 2**20)
    if policy == "budget-recompute":
        return fxzero.Activations(memory_budget=budget, budget_choices=("recompute",))
    nvme = fxzero.Nvme(path=args.nvme_path)
    choices = ("offload",) if policy == "budget-offload" else ("recompute", "offload")
    return fxzero.Activations(memory_budget=budget, offload=nvme, budget_choices=choices)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import fxzero
    from fxzero.activation_estimate import count_saved
    from fxzero.zoo import gpt

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = gpt(args.model, seq_len=args.seq)
    config = fxzero.Config(stage=3, seed=0, cost_model=args.cost_model, activations=activations(args.policy, args))
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
        engine.backward(loss)
        engine.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    # What the forward keeps for the backward, by storage, as memory_report() counts it: past the
    # model's outputs, gathered parameters the prefetch keeps apart (fxzero/activation_estimate.py)
    counted = count_saved(engine._stepping.compiled, args.policy)
    kept_bytes, kept_gathered = counted.total, counted.kept_gathered_bytes
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    report = engine.memory_report()
    trace = {r.name: r.summary for r in engine._stepping.compiled.pass_trace}
    plan = {k: v for k, v in trace["separate_phases"].items() if k.startswith("budget_")}
    if "plan_offload" in trace:
        plan["offloaded_bytes"] = trace["plan_offload"]["offload_bytes"]
    line = {"event": "rank", "policy": args.policy, "rank": rank, "median_step_s": statistics.median(times),
            "peak_rss_bytes": hwm, "kept_bytes": kept_bytes, "kept_gathered_bytes": kept_gathered,
            "held_peak_bytes": report["activations_peak"], "nvme_peak_bytes": report.get("activations_nvme_peak", 0),
            "plan": plan, "losses": losses}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:  # (the ranks' stdout interleaves)
        json.dump(line, f)


def run(policy: str, args: argparse.Namespace) -> list[dict]:
    extra = ["--budget-mib", str(args.budget_mib)] if args.budget_mib is not None else []
    return run_ranks(__file__, policy, args.ranks, [
        "--policy", policy, "--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--cost-model", args.cost_model, "--nvme-path", args.nvme_path, *extra],
        args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="small",
                        help="the zoo GPT: small (25M, the issue's figures) or tiny (the tests' plumbing)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--policy", choices=POLICIES, default="none", help=argparse.SUPPRESS)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=["none", "unit", "selective"],
                        help="which to run (default the recompute policies; a long sequence the resident run "
                             "cannot fit: unit; budget*: need --budget-mib)")
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="Activations(memory_budget=...) in MiB for the budget* policies")
    parser.add_argument("--nvme-path", default=tempfile.gettempdir(), help="NVMe directory for offloaded activations")
    parser.add_argument("--cost-model", default="cpu-loopback",
                        help="what prices the compiler's choices, the budget's plans among them (default: this "
                             "machine's preset, pinned so the plans do not depend on a measurement)")
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    print(json.dumps({"event": "config", **{k: v for k, v in vars(args).items()
                                            if k not in ("policy", "rank_main", "out")}}))
    results: dict[str, list[list[dict]]] = {p: [] for p in args.policies}
    for r in range(args.rounds):
        for policy in args.policies:
            ranks = run(policy, args)
            results[policy].append(ranks)
            for line in ranks:
                print(json.dumps({**line, "round": r}), flush=True)

    def median(policy: str, key: str) -> float:
        return statistics.median(max(line[key] for line in ranks) for ranks in results[policy])

    summary = {"event": "summary"}
    others = [p for p in args.policies if p != "none"] if "none" in args.policies else []
    for key in ("median_step_s", "peak_rss_bytes", "kept_bytes", "held_peak_bytes"):
        summary[key] = {p: median(p, key) for p in args.policies}
        for p in others:
            summary[key][f"{p}_over_resident"] = summary[key][p] / summary[key]["none"]
    for p in others:  # (each rank's losses against the resident run's, round by round)
        summary[f"{p}_losses_equal"] = all(a["losses"] == b["losses"]
                                           for ra, rb in zip(results["none"], results[p]) for a, b in zip(ra, rb))
    budgeted = [p for p in args.policies if p.startswith("budget")]
    if {"budget", "budget-recompute", "budget-offload"} <= set(budgeted):  # (issue 23's bar for the planner)
        steps = summary["median_step_s"]
        summary["budget_over_best_single"] = steps["budget"] / min(steps["budget-recompute"], steps["budget-offload"])
    for p in budgeted:
        summary[f"{p}_within_budget"] = summary["held_peak_bytes"][p] <= args.budget_mib * 2**20
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""fxzero side by side with DDP, FSDP2 and DeepSpeed ZeRO-3: same model, batch, ranks and data.

    .venv-bench/bin/python tools/bench.py --model small --rounds 3 > bench-small.jsonl
    .venv-bench/bin/python tools/bench.py --quick          # tiny model, 2 steps, 1 round

(`bash scripts/bench-env.sh` creates .venv-bench with torch 2.13.0+cpu, fxzero and DeepSpeed.
With another interpreter the DeepSpeed systems are reported as unavailable.)

One invocation runs every requested system on the same model, micro-batch per rank and ranks,
alternating runs (A, B, C, A, B, C, ... for --rounds rounds) so that drifts of a noisy machine
spread over all systems. Every run starts fresh rank processes (gloo, one thread each), builds
the model from the same seed, trains --warmup untimed then --steps timed steps on the same
batches, and reports median step time, peak RSS per rank (VmHWM), traffic per step and the
losses. JSON lines go to stdout ("config", "unavailable", "run", "system", "summary");
progress goes to stderr. See tools/bench/report.py for each line's fields.

The machine is shared: before each run the benchmark waits (up to --quiet-wait) until other
processes keep fewer than --quiet-cores cores busy, measures the background load during the
run, and redoes a run that had company (--retries); the noisy line stays, marked "discarded".

Traffic: fxzero's figure is its engine's comm_report(); every other system's is counted by
wrapping torch.distributed's collectives in the rank (DDP: a comm hook), and the loopback
interface's byte counter says what gloo actually sent (tools/bench/commcount.py).

DeepSpeed ZeRO-Infinity (`--systems ds-zero3-offload-nvme`) is off by default: it needs libaio
and a 3-minute JIT build (`BENCH_NVME=1 bash scripts/bench-env.sh`).

Offload side by side: fxzero-offload-cpu / fxzero-offload-nvme place parameters and optimizer
states as ds-zero3-offload-cpu / ds-zero3-offload-nvme do; the summary compares each with
fxzero on the device and with DeepSpeed at the same placement. NVMe files go under
$BENCH_NVME_DIR (default: the temporary directory), in a folder removed after each run. Where
DeepSpeed's NVMe offload is I/O bound, --model gpt-1b (~1.0B parameters, micro-batch 1):

    .venv-bench/bin/python tools/bench.py --model gpt-1b --rounds 1 --warmup 1 --steps 2 \
        --systems ds-zero3-offload-nvme,fxzero-offload-nvme

bf16 side by side (`--systems bf16`: ddp-bf16, fsdp2-bf16, ds-zero3-bf16, floor-bf16,
fxzero-stage3-bf16): DDP under autocast, FSDP2 with a bf16 MixedPrecisionPolicy, DeepSpeed with
"bf16" enabled, fxzero with MixedPrecision(bf16), and the no-communication floor (each rank
trains its own copy under autocast, all at once). Their losses are compared with ddp-bf16's at a
bf16 tolerance; the summary gives fxzero-stage3-bf16's step against fsdp2-bf16, ds-zero3-bf16 and
floor-bf16, and its peak RSS against fsdp2-bf16's:

    .venv-bench/bin/python tools/bench.py --model small --rounds 3 --systems bf16 > bench-bf16.jsonl

Activations side by side (`--systems activations`, issue 23): fxzero resident (fxzero-stage3),
Activations(recompute="unit") and "selective" (fxzero-stage3-unit, -selective; a mode this fxzero
lacks is skipped, with a note), FSDP2 with torch.utils.checkpoint around each block (fsdp2-ckpt)
and DeepSpeed ZeRO-3 with its activation checkpointing (ds-zero3-ckpt: the model calls
deepspeed.checkpointing.checkpoint per block and the config has the activation_checkpointing
section), each peer next to its resident run, and DDP as the loss reference. --seq sets the
sequence length (activations grow with it). The summary's "activations" holds the issue's bars
(tools/bench/activations.py), also printed to stderr with pass/miss, fxzero's kept activation
bytes (memory_report()["activations_peak"]) and whether fxzero's policies' losses equal the
resident run's bit for bit:

    .venv-bench/bin/python tools/bench.py --model small --seq 1024 --batch 4 --rounds 2 \
        --systems activations > bench-activations.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.bench import report  # noqa: E402
from tools.bench.activations import bar_lines  # noqa: E402
from tools.bench.common import background_cores  # noqa: E402
from tools.bench.launch import run_system  # noqa: E402
from tools.bench.spec import MODEL_PRESETS, RunSpec  # noqa: E402
from tools.bench.systems import DEFAULT_SYSTEMS, SYSTEM_GROUPS, SYSTEMS, System, expand, unavailable  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="systems: " + ", ".join(f"{n} ({s.description})" for n, s in SYSTEMS.items())
        + "; groups: " + ", ".join(f"{g} ({','.join(names)})" for g, names in SYSTEM_GROUPS.items()),
    )
    parser.add_argument("--model", default="small", choices=sorted(MODEL_PRESETS), help="GPT size: a zoo size or gpt-1b (~1.0B, see tools/bench/spec.py) (default: small, ~25M)")
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS),
        help="comma-separated systems or groups (" + ", ".join(SYSTEM_GROUPS) + ") (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default: 2)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (default: 6)")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch per rank (default: the model's preset)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length, tokens (default: the model's seq_len)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (default: 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is killed (default: 1800)")
    parser.add_argument("--keep-logs", metavar="DIR", default=None, help="keep every rank's log and result under DIR")
    parser.add_argument(
        "--quiet-cores", type=float, default=0.3,
        help="before each run, wait until other processes keep fewer cores than this busy (default: 0.3)",
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=120.0,
        help="longest wait for a quiet machine before a run, seconds; 0 never waits (default: 120)",
    )
    parser.add_argument(
        "--retries", type=int, default=1,
        help="runs redone when other processes kept more than --quiet-cores busy during them; the "
        "noisy run's line is kept, marked \"discarded\" (default: 1)",
    )
    parser.add_argument(
        "--summarize", metavar="JSONL", default=None,
        help="run nothing: recompute the system and summary lines from the run lines of an earlier output",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 warm-up + 1 timed step, 1 round (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.warmup, args.steps, args.quiet_wait, args.retries = "tiny", 1, 1, 1, 0.0, 0
    args.systems = expand([s.strip() for s in args.systems.split(",") if s.strip()])
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {unknown}; choose from {sorted(SYSTEMS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.seq is not None and args.seq < 1:
        parser.error("--seq must be at least 1")
    if args.retries < 0:
        parser.error("--retries must be >= 0")
    return args


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def count_params(spec: RunSpec) -> int:
    from tools.bench.common import build_model

    return sum(p.numel() for p in build_model(spec, device="meta").parameters())  # tied weights once


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "fxzero"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def git_state() -> str:
    """The checkout's commit, with "-dirty" when tracked files differ from it (work in progress)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def wait_for_quiet(max_cores: float, max_wait_s: float) -> float:
    """Sleep until other processes keep fewer than `max_cores` cores busy, or `max_wait_s` passed.

    The machine is shared (tests, builds): a run next to other work measures the contention.
    Returns the seconds waited; each run line also reports the background load it actually had.
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        cores = background_cores(1.0)
        if cores is None or cores < max_cores:
            break
    return time.perf_counter() - t0


def run_once(name: str, round_: int, spec: RunSpec, args: argparse.Namespace) -> dict:
    """One run of system `name`, after waiting for a quiet machine; returns its "run" line."""
    waited = wait_for_quiet(args.quiet_cores, args.quiet_wait) if args.quiet_wait > 0 else 0.0
    t0 = time.perf_counter()
    result = run_system(name, spec, log_dir=args.keep_logs)
    result["waited_for_quiet_s"] = round(waited, 1)
    line = report.run_line(name, round_, result, spec.steps, spec.warmup)
    status = f"median {line['median_step_s']:.3f} s/step" if line["ok"] else "FAILED"
    status += f", background {line.get('background_cores', float('nan')):.2f} cores"
    progress(f"round {round_}/{args.rounds} {name}: {status} ({time.perf_counter() - t0:.1f} s)")
    return line


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_system, which kills the ranks


def fxzero_path() -> str:
    import fxzero

    return os.path.dirname(fxzero.__file__)


def summarize(path: str, quiet_cores: float) -> int:
    """Print the system and summary lines for the kept run lines of an earlier output."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip().startswith("{")]
    config = next(line for line in lines if line["event"] == "config")
    missing = {line["system"]: line["reason"] for line in lines if line["event"] == "unavailable"}
    runs: dict[str, list[dict]] = {}
    for line in lines:
        if line["event"] == "run" and "discarded" not in line:
            runs.setdefault(line["system"], []).append(line)
    finish(runs, config["num_params"], config["spec"]["model"], missing, quiet_cores)
    return 0


def finish(runs: dict[str, list[dict]], num_params: int, model: str, missing: dict[str, str], quiet_cores: float) -> dict:
    """Emit one "system" line per system (in `runs`' order) and the "summary" line."""
    systems: dict[str, dict] = {}
    references = set(report.LOSS_REFERENCES.values())
    for name in sorted(runs, key=lambda n: n not in references):  # the loss references first
        # A saved line of a system this checkout lacks: fp32, compared with DDP.
        system = SYSTEMS.get(name) or System("", description="(not in this checkout's system table)")
        reference_name = report.LOSS_REFERENCES[system.precision]
        reference = systems.get(reference_name) if name != reference_name else None
        systems[name] = report.system_line(
            name, system.description, runs[name], reference, quiet_cores=quiet_cores,
            reference_name=reference_name, precision=system.precision, trains_alike=system.trains_alike,
            activations=system.activations, resident=system.resident,
        )
    for name in runs:
        emit(systems[name])
    summary = report.summary_line({n: systems[n] for n in runs}, num_params, model, missing)
    emit(summary)
    for line in bar_lines(summary):  # the bars, readable: "[pass] what: value (bar <= x)"
        progress(line)
    return systems


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.quiet_cores)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    preset = dict(MODEL_PRESETS[args.model])
    if args.batch is not None:
        preset["batch"] = args.batch
    if args.seq is not None:
        preset["seq"] = args.seq
    spec = RunSpec(
        **preset, world_size=args.ranks, threads=args.threads, warmup=args.warmup, steps=args.steps, timeout_s=args.timeout
    )
    num_params = count_params(spec)
    emit({
        "event": "config",
        "spec": dataclasses.asdict(spec),
        "num_params": num_params,
        "rounds": args.rounds,
        "systems": args.systems,
        "order": "alternating: every system once per round, in the order given; a redone run follows its discarded one",
        "quiet_cores": args.quiet_cores,
        "retries": args.retries,
        "python_executable": sys.executable,
        "versions": versions(),
        "git": git_state(),
        "fxzero_path": fxzero_path(),
        "cpus": os.cpu_count(),
    })

    missing: dict[str, str] = {}
    runnable = []
    for name in args.systems:
        why = unavailable(name, spec)
        if why is None:
            runnable.append(name)
        else:
            missing[name] = why
            emit({"event": "unavailable", "system": name, "reason": why})
            progress(f"skipping {name}: {why}")
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)

    runs: dict[str, list[dict]] = {name: [] for name in runnable}
    for round_ in range(1, args.rounds + 1):
        for name in runnable:
            if runs[name] and not any(r["ok"] for r in runs[name]):
                continue  # failed every time so far: a deterministic failure, don't repeat it
            for attempt in range(1 + args.retries):
                line = run_once(name, round_, spec, args)
                noisy = line.get("background_cores", 0.0) > args.quiet_cores
                if line["ok"] and noisy and attempt < args.retries:
                    # Other work shared the cores during this run: keep the line, mark it, redo.
                    line["discarded"] = f"background load {line['background_cores']:.2f} cores > --quiet-cores"
                emit(line)
                if "discarded" not in line:
                    runs[name].append(line)
                    break

    systems = finish(runs, num_params, spec.model, missing, args.quiet_cores)
    return 0 if all(s.get("rounds_ok") for s in systems.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

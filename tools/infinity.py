"""ZeRO-Infinity on one box: train a model whose states exceed this machine's RAM, from NVMe.

    .venv/bin/python tools/infinity.py --nvme-path /var/tmp/fxzero-nvme          # gpt-2b, 3 steps

Builds the model on the meta device, materializes its parameters unit by unit straight into
files under --nvme-path (never the whole model in memory), and trains it with parameter shards,
gradients and AdamW's moments on NVMe: every read and write is a fetch or offload instruction
of the compiled schedule, on the io stream. One JSON line per event goes to stdout:

- "disk": the disk's sequential bandwidth measured here first, dd-style (one stream, 1 MiB
  blocks, O_DIRECT where the filesystem allows, a file of --dd-bytes, 16 GiB by default), written
  then read back;
- "step": per training step, loss, seconds per phase, bytes read and written, and the optimizer
  phase's achieved bandwidth, also as a fraction of what the dd figures allow for the same mix
  of reads and writes (bytes_read / dd_read + bytes_written / dd_write seconds);
- "summary": peak resident memory (this process's max RSS), losses, and each target of the issue
  (>= 2e9 parameters with model states > RAM, RSS < 8 GiB, finite decreasing losses on the
  repeated batch, optimizer-phase bandwidth >= 70% of the dd figure) with whether it was met.

With --precision bf16 (the default) the model computes in bfloat16: NVMe holds each unit's fp32
master and moments beside the bfloat16 copy that its gathers read. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import resource
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxzero  # noqa: E402
from fxzero import zoo  # noqa: E402

GiB = 1 << 30
RSS_LIMIT = 8 * GiB
BANDWIDTH_TARGET = 0.70


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def progress(msg: str) -> None:
    print(f"[infinity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def total_ram() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def dd(path: str, nbytes: int, block: int = 1 << 20) -> dict:
    """Sequential write then read of one file of `nbytes`, one stream, `block`-sized calls."""
    name = os.path.join(path, f".fxzero-dd-{os.getpid()}")
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    direct = getattr(os, "O_DIRECT", 0)
    out = {"bytes": nbytes, "block_bytes": block}
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
            out["direct"] = bool(direct)
        except OSError:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            out["direct"] = False
        start = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        out["write_s"] = time.perf_counter() - start
        os.close(fd)
        fd = os.open(name, os.O_RDONLY | (direct if out["direct"] else 0))
        start = time.perf_counter()
        for off in range(0, nbytes, block):
            os.preadv(fd, [buf], off)
        out["read_s"] = time.perf_counter() - start
        os.close(fd)
    finally:
        if os.path.exists(name):
            os.unlink(name)
    out["write_GBps"] = nbytes / out["write_s"] / 1e9
    out["read_GBps"] = nbytes / out["read_s"] / 1e9
    return out


def io_totals(report: dict) -> tuple[int, int, float, float]:
    """Bytes read, bytes written, and the summed per-operation seconds each way, over tiers."""
    r = sum(t["read"]["bytes"] for t in report.values())
    w = sum(t["write"]["bytes"] for t in report.values())
    rs = sum(t["read"]["seconds"] for t in report.values())
    ws = sum(t["write"]["seconds"] for t in report.values())
    return r, w, rs, ws


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", default=None,
                   help="directory on the disk to train from (default: a new folder under /var/tmp)")
    p.add_argument("--model", default="gpt-2b", help="zoo model (default gpt-2b, 2.21e9 parameters)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (one repeated batch)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--io-threads", type=int, default=4, help="NVMe I/O workers (operations in flight)")
    p.add_argument("--dd-bytes", type=float, default=16 * GiB,
                   help="size of the dd-style probe file; far larger than the caches between this "
                        "machine and its disk (a 4 GiB file read right after writing it came back at "
                        "1.3-2.1 GB/s on the same disk across runs)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 (default): MixedPrecision(bfloat16), fp32 masters and moments on NVMe beside the "
                        "bf16 copies the gathers read; fp32: everything in fp32")
    p.add_argument("--step-in-backward", action="store_true",
                   help="update each unit inside the backward (Offload(step_in_backward=True)); the "
                        "optimizer-phase figures then cover the backward, where the updates run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    own_dir = args.nvme_path is None
    path = args.nvme_path or tempfile.mkdtemp(prefix="fxzero-infinity-", dir="/var/tmp")
    os.makedirs(path, exist_ok=True)

    progress(f"dd-style probe: {args.dd_bytes / GiB:.1f} GiB under {path}")
    disk = dd(path, int(args.dd_bytes))
    emit({"event": "disk", "path": path, **disk})

    with torch.device("meta"):
        model = zoo.build(args.model)
    num_params = sum(p.numel() for p in model.parameters())
    nvme = fxzero.Nvme(path=path, threads=args.io_threads)
    config = fxzero.Config(
        stage=3,
        optimizer=fxzero.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
        offload=fxzero.Offload(params=nvme, optimizer=nvme, step_in_backward=args.step_in_backward),
        cost_model=None,
        mixed_precision=fxzero.MixedPrecision(param_dtype=torch.bfloat16) if args.precision == "bf16" else None,
    )
    progress(f"{args.model}: {num_params / 1e9:.2f}e9 parameters, model states {16 * num_params / GiB:.1f} GiB "
             f"(RAM {total_ram() / GiB:.1f} GiB); materializing into {path}")
    start = time.perf_counter()
    engine = fxzero.compile(model, config)
    init_s = time.perf_counter() - start
    emit({"event": "init", "model": args.model, "num_params": num_params, "precision": args.precision, "seconds": init_s,
          "io": engine.io_report(reset=True), "peak_rss": peak_rss()})

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    losses, fractions = [], []
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            logits = engine(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            t1 = time.perf_counter()
            forward_io = io_totals(engine.io_report(reset=True))
            engine.backward(loss)
            t2 = time.perf_counter()
            backward_io = io_totals(engine.io_report(reset=True))
            engine.step()
            t3 = time.perf_counter()
            step_io = io_totals(engine.io_report(reset=True))
            before = [a + b for a, b in zip(forward_io, backward_io)]
            opt = step_io
            phase_s = t3 - t2
            if args.step_in_backward:  # the updates ran in the backward: measure that phase
                opt = [a + b for a, b in zip(backward_io, step_io)]
                phase_s = t3 - t1
            dd_seconds = opt[0] / (disk["read_GBps"] * 1e9) + opt[1] / (disk["write_GBps"] * 1e9)
            fraction = dd_seconds / phase_s
            losses.append(loss.item())
            fractions.append(fraction)
            record = {
                "event": "step", "step": step, "loss": loss.item(), "seconds": t3 - t0,
                "forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                "forward_backward_read_bytes": before[0], "forward_backward_write_bytes": before[1],
                "step_in_backward": args.step_in_backward,
                "optimizer_read_bytes": opt[0], "optimizer_write_bytes": opt[1],
                "optimizer_phase_s": phase_s,
                "optimizer_GBps": (opt[0] + opt[1]) / phase_s / 1e9,
                "optimizer_read_GBps": opt[0] / phase_s / 1e9,
                "optimizer_write_GBps": opt[1] / phase_s / 1e9,
                "optimizer_fraction_of_dd": fraction,
                "memory": engine.memory_report(), "peak_rss": peak_rss(),
            }
            emit(record)
            progress(f"step {step}: loss {loss.item():.4f}, {t3 - t0:.1f} s (fwd {t1 - t0:.1f}, bwd {t2 - t1:.1f}, "
                     f"step() {t3 - t2:.1f}; optimizer phase {phase_s:.1f} s at {record['optimizer_GBps']:.2f} GB/s "
                     f"= {fraction:.0%} of dd), "
                     f"peak RSS {peak_rss() / GiB:.2f} GiB")
    finally:
        engine.close()
        if own_dir:
            os.rmdir(path)

    rss = peak_rss()
    targets = {
        "params_at_least_2e9": num_params >= 2e9,
        "model_states_exceed_ram": 16 * num_params > total_ram(),
        "peak_rss_under_8GiB": rss < RSS_LIMIT,
        "losses_finite_and_decreasing": all(math.isfinite(v) for v in losses)
        and all(b < a for a, b in zip(losses, losses[1:])) and len(losses) >= 2,
        "optimizer_bandwidth_at_least_70pct_of_dd": bool(fractions) and min(fractions) >= BANDWIDTH_TARGET,
    }
    emit({"event": "summary", "model": args.model, "num_params": num_params, "precision": args.precision,
          "steps": args.steps,
          "losses": losses, "peak_rss": rss, "ram": total_ram(), "optimizer_fraction_of_dd": fractions,
          "disk": {"read_GBps": disk["read_GBps"], "write_GBps": disk["write_GBps"]}, "targets": targets})
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

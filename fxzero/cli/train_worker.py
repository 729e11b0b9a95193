"""One rank of `fxzero train`, started by torchrun: `python -m fxzero.cli.train_worker ...`.

Trains a MODEL on synthetic data and reports to the launching `fxzero train` on stdout, one JSON
event per line from rank 0 (`start`, `step`, `done`), plus an `error` event from any rank that
fails. The data is a task the model can learn, picked from its inputs and outputs:

- tokens: one integer input (B, T) in [0, V) and logits (B, T, V): predict perm[x], a fixed
  permutation of each token (as tools/demo.py does); a uniform guess scores ln V;
- classes: one floating point input and logits (B, C): the argmax class of a fixed random
  linear teacher of the flattened input;
- anything else: drive the outputs towards zero (mean squared output), just to exercise a step.

Each rank draws its own batch every step, as data-parallel ranks do. Every rank records when
each instruction of the last step ran (`Engine.record_timeline`). At the
end rank 0 records the artifacts of the program that ran (graph, pass trace, schedule), run.json
and every rank's timeline (timeline.json) into --out.

All times are `time.perf_counter()` seconds, the clock the engine records with; the ranks run
on one machine (torchrun --standalone), where that clock is shared by all processes.

Every collective has a timeout (--collective-timeout seconds, the process group's and that of
every group made after it, such as the shared-memory transport's barriers): a rank that dies or
hangs makes the others fail in their next collective instead of waiting forever, each with the
usual one-line `error` event, "[rank N] a collective did not complete within ...".
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import resource
import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

TASK_SEED = 1234
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""Seconds a collective may wait for the other ranks (`fxzero train --collective-timeout`)."""


def _emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fxzero.cli.train_worker")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--stage", default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--config", default=None)
    p.add_argument("--inputs", action="append", default=[])
    p.add_argument("--out", required=True)
    p.add_argument("--collective-timeout", type=_positive_seconds, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                   help="seconds a collective may wait for the other ranks")
    return p.parse_args(argv)


class Task:
    """A synthetic learning problem for a model's inputs and outputs."""

    def __init__(self, name: str, describe: str, loss: Callable, target: Callable):
        self.name, self.describe, self.loss, self.target = name, describe, loss, target


def choose_task(specs, outputs) -> Task:
    out = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    single = len(specs) == 1
    if single and specs[0].high is not None and out.dim() == 3 and specs[0].low >= 0 and out.shape[-1] >= specs[0].high:
        vocab = out.shape[-1]
        perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(TASK_SEED))
        return Task("tokens", f"predict a fixed permutation of each token (uniform guess: {math.log(vocab):.3f})",
                    lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
                    lambda xs: perm[xs[0]])
    if single and specs[0].dtype.is_floating_point and out.dim() == 2:
        classes = out.shape[-1]
        features = math.prod(specs[0].shape[1:])
        teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(TASK_SEED))
        return Task("classes", f"classify by a fixed random linear teacher (uniform guess: {math.log(classes):.3f})",
                    lambda o, y: F.cross_entropy(o, y),
                    lambda xs: (xs[0].flatten(1).float() @ teacher).argmax(-1))
    return Task("outputs", "drive the outputs towards zero (mean squared output)",
                lambda o, y: sum(t.float().pow(2).mean() for t in (o if isinstance(o, (tuple, list)) else [o])),
                lambda xs: None)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    import fxzero
    from fxzero.artifacts import record
    from fxzero.cli.common import make_config
    from fxzero.modelspec import InputSpec, build_model, example_inputs, parse_inputs

    specs = parse_inputs(args.inputs)
    config = make_config(args.config, args.stage)
    if args.lr is not None:
        import dataclasses

        config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, lr=args.lr))
    torch.manual_seed(config.seed)
    model = build_model(args.model)
    specs = specs or [InputSpec.of(x) for x in example_inputs(model, what=f"MODEL {args.model!r}")]
    start = time.perf_counter()
    engine = fxzero.compile(model, config)
    if rank == 0:
        _emit("start", model=args.model, params=engine.num_params, world=world, stage=config.stage,
              compile_seconds=time.perf_counter() - start)

    task: Optional[Task] = None
    steps, spans = [], []
    batch_inputs = None
    first_call_seconds = 0.0
    timeline: dict = {}
    clock = time.perf_counter
    for step in range(1, args.steps + 1):
        gen = torch.Generator().manual_seed(TASK_SEED + 1 + step * world + rank)
        batch_inputs = tuple(s.make(gen, batch=args.batch) for s in specs)
        last = step == args.steps
        if last:
            # The recorded step starts on every rank together, so the ranks' timelines line up.
            dist.barrier()
            engine.record_timeline(True)
        t0 = clock()
        out = engine(*batch_inputs)
        if step == 1:
            first_call_seconds = clock() - t0  # the engine compiles inside its first call
        if task is None:
            task = choose_task(specs, out)
            if rank == 0:
                _emit("task", name=task.name, describe=task.describe)
        loss = task.loss(out, task.target(batch_inputs))
        t1 = clock()
        engine.backward(loss)
        t2 = clock()
        mem = engine.memory_report()  # gradients still held, optimizer states from earlier steps
        t_step = clock()
        engine.step()
        t3 = clock()
        spans += [{"rank": rank, "step": step, "name": n, "start": a, "end": b}
                  for n, a, b in (("forward", t0, t1), ("backward", t1, t2), ("step", t_step, t3))]
        if last:
            timeline = {"rank": rank, "step_program": [t_step, t3],
                        "instructions": [[t.program, t.index, t.start, t.end] for t in engine.timeline()]}
            engine.record_timeline(False)
        stats = torch.tensor([loss.item(), t3 - t0, mem["model_states"], mem["gathered_peak"], _rss_bytes()],
                             dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        if rank == 0:
            row = {
                "step": step,
                "loss": sum(g[0].item() for g in gathered) / world,
                "seconds": max(g[1].item() for g in gathered),
                "ranks": [{"rank": r, "model_states": int(g[2]), "gathered_peak": int(g[3]), "peak_rss": int(g[4])}
                          for r, g in enumerate(gathered)],
                "loss_scale": engine.loss_scale,
                "skipped_steps": engine.skipped_steps,
            }
            steps.append(row)
            _emit("step", **row)

    per_rank: list = [None] * world  # (spans, timeline) of every rank
    dist.all_gather_object(per_rank, (spans, timeline))
    if rank != 0:
        return
    recorded_specs = [InputSpec(s.dtype, tuple(x.shape), s.low, s.high) for s, x in zip(specs, batch_inputs)]
    # compile_seconds of a train: the engine's first call, which compiles and runs one forward.
    art = record(engine.program, model=args.model, inputs=recorded_specs, config=config,
                 seconds=first_call_seconds, command="train")
    art.run = {"task": task.name if task else None, "steps": steps, "spans": [s for r, _ in per_rank for s in r],
               "comm_last_step": engine.comm_report(), "collective_timeout_s": args.collective_timeout}
    art.timeline = {"clock": "time.perf_counter", "step": args.steps, "ranks": [t for _, t in per_rank]}
    art.write(args.out)
    _emit("done", out=args.out)


# What gloo says (through torch.distributed or the shared-memory transport, which wraps it)
# when a peer does not answer within the timeout, or has gone (a crashed rank).
_TIMED_OUT = ("timed out",)
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def collective_failure(e: BaseException) -> str:
    """"timeout" or "peer_gone" for a collective that failed because of another rank, else ""."""
    if isinstance(e, TimeoutError):
        return "timeout"
    if not isinstance(e, RuntimeError):  # torch.distributed's errors are RuntimeErrors
        return ""
    lower = str(e).lower()
    if any(w in lower for w in _TIMED_OUT):
        return "timeout"
    if any(w in lower for w in _PEER_GONE):
        return "peer_gone"
    return ""


def error_message(e: BaseException, rank: int, timeout_s: float) -> str:
    """The `error` event's message: one line (the rest goes to stderr with the traceback), and
    for a collective that failed because of another rank, which rank saw it and why."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    failure = collective_failure(e)
    if failure == "timeout":
        return (f"[rank {rank}] a collective did not complete within --collective-timeout {timeout_s:g} s "
                f"(another rank died or hangs): {text}")
    if failure == "peer_gone":
        return f"[rank {rank}] a collective failed because another rank has gone (see its error): {text}"
    return text


def _init_process_group(timeout_s: float) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    # Groups made later without a timeout of their own (the shared-memory transport's barrier
    # group, fxzero/runtime/comm/shm.py) take torch's default, 30 minutes for gloo, not the
    # default group's: make that default this timeout too, in this process (a worker's own).
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group("gloo", timeout=timeout)


def main(argv: Optional[list[str]] = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(1)  # one core per rank: the ranks share the machine's cores
    _init_process_group(args.collective_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        train(args, rank, world)
        # Rank 0 writes the artifacts after the last collective. The other ranks wait for it
        # here: a rank that tears its gloo group down while a peer still holds it open can
        # abort ("terminate called without an active exception"), failing a finished run.
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - every failure goes to the launcher as one line
        _emit("error", rank=rank, message=error_message(e, rank, args.collective_timeout),
              collective=collective_failure(e))
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

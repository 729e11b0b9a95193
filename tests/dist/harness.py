"""A small multi-process harness for distributed tests on gloo.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` fresh
processes and returns their results in rank order. It never hangs and never hides a failure:

- every rank's result or traceback travels back in a file (see [Note: results by file]);
- the first rank to fail stops the run: the others are killed (they would otherwise wait in a
  collective for their peer until gloo's own timeout) and the parent raises an AssertionError
  holding the failed rank's traceback;
- past `timeout_s` every child is killed and the parent raises, naming the ranks still running.

A world of one runs `fn` in one spawned process with no process group at all, which is how a
single-process user runs fxzero, so that path gets tested as it is used.

The tests' shared training problem lives here too: `ADAMW`, the optimizer settings every parity
test uses (for `torch.optim.AdamW` and `fxzero.AdamW` alike), and `train`, the one loop that
drives an engine over global batches.

[Note: results by file]
A multiprocessing Queue would need the parent to drain it while children exit (a child blocks
at exit until its queued bytes are read), and torch's Queue pickler shares tensors through file
descriptors that die with the sending child. Each child instead pickles its result with the
plain pickler (tensors by value) into its own file and renames it into place, so the parent can
read it any time after the child ends. Arguments go the same way in reverse: pickled once by
the parent, so every rank gets its own copy and no tensor memory is shared.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from tests.dist.reference import rank_slice

__all__ = ["ADAMW", "free_port", "run_ranks", "train"]

ADAMW: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
"""AdamW settings of the parity tests: keyword arguments of `torch.optim.AdamW` (the eager
references) and of `fxzero.AdamW` (the engine) alike."""

# How long a child gets to die after SIGTERM before it is sent SIGKILL.
_TERMINATE_GRACE_S = 2.0
# Collectives in the children give up after this long; shorter than the harness's own timeout
# so that a rank left waiting for a dead peer fails with gloo's message rather than ours.
_PG_TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_result(path: str, status: str, payload: Any) -> None:
    # Write then rename, so the parent never reads half a file.
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump((status, payload), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _worker(rank: int, world_size: int, port: int, job: bytes, result_path: str) -> None:
    """Entry point of one rank: set up the process group, run the job, report, tear down."""
    try:
        fn, args = pickle.loads(job)
        if world_size > 1:
            # Ranks share the machine's cores; one thread each avoids oversubscription.
            torch.set_num_threads(1)
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
            )
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=_PG_TIMEOUT
            )
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        try:
            _write_result(result_path, "ok", result)
        except Exception as e:  # noqa: BLE001 - report an unpicklable result as a failure
            raise TypeError(
                f"rank {rank} returned a {type(result).__name__} that cannot be pickled ({e}); "
                "return plain Python values and tensors"
            ) from e
    except BaseException:  # noqa: BLE001 - every failure, SystemExit included, goes to the parent
        _write_result(result_path, "error", traceback.format_exc())


def _read_result(path: str) -> tuple[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _stop(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate every live child, then kill what is left after a grace period."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


_PRELOAD = ["torch", "torch.distributed", "fxzero.api", "fxzero.runtime.engine", "tests.dist.harness",
            # (what torch imports at a process's first trace: about 0.8 s a rank on 2 cores)
            "torch._dynamo", "torch._functorch.eager_transforms", "torch.fx.experimental.proxy_tensor"]


def _context() -> multiprocessing.context.BaseContext:
    """[Note: ranks fork from a server that has imported torch]
    Every rank of every run starts as a fork of one forkserver process, started at the first
    run, that has imported torch and fxzero, and what torch imports lazily at the first trace
    (`_PRELOAD`), and done nothing else: no thread pool, no process group, no CUDA. A rank so
    starts in milliseconds where a spawned interpreter takes about 3.7 s to import them (on 2
    cores, seconds of every distributed test), and still starts clean, as a spawned one would. Ranks see the environment as it was when the server
    started: a test passes what a rank must know as arguments, not by changing os.environ."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return results by rank.

    For world_size >= 2 each rank joins a gloo process group (MASTER_ADDR/MASTER_PORT, RANK,
    WORLD_SIZE and LOCAL_RANK are set in its environment) that is destroyed when `fn` returns.
    For world_size == 1, `fn` runs in one spawned process with no process group.

    Args:
        fn: A module-level function (spawned children import it by name).
        world_size: Number of ranks, >= 1.
        *args: Passed to `fn` after rank and world_size; must be picklable.
        timeout_s: Wall-clock limit for the whole run, process start-up included.

    Returns:
        The values `fn` returned, indexed by rank.

    Raises:
        ValueError: for world_size < 1 or a `fn` that children cannot import.
        AssertionError: if a rank raised (the message holds its traceback), died without
            reporting, or the run passed `timeout_s` (every child is killed first).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        job = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(
            f"run_ranks cannot send {fn!r} and its arguments to the ranks ({e}); fn must be a "
            "module-level function (spawned ranks import it by name) and args picklable"
        ) from e
    port = free_port() if world_size > 1 else 0
    ctx = _context()
    name = getattr(fn, "__name__", "fn")

    with tempfile.TemporaryDirectory(prefix="fxzero-ranks-") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, job, paths[r]),
                name=f"{name}-rank{r}",
                # Not daemonic, so fn may start processes of its own; `_stop` in the finally
                # below is what guarantees no rank outlives run_ranks.
                daemon=False,
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            results = _collect(procs, paths, timeout_s, name)
        finally:
            _stop(procs)
    return results


def _collect(
    procs: list[multiprocessing.process.BaseProcess],
    paths: list[str],
    timeout_s: float,
    name: str,
) -> list[Any]:
    """Wait for every rank; fail fast on the first rank that reports an error or dies silently."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        running = {p.sentinel: r for r, p in enumerate(procs) if r not in results}
        remaining = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(running), timeout=max(0.0, remaining))
        if not ready:
            _stop(procs)
            raise AssertionError(
                f"{name}: timed out after {timeout_s:g}s on {len(procs)} rank(s); ranks still "
                f"running {sorted(running.values())} were killed"
            )
        for sentinel in ready:
            rank = running[sentinel]
            procs[rank].join()
            report = _read_result(paths[rank])
            if report is None:
                _stop(procs)
                raise AssertionError(
                    f"{name}: rank {rank} exited with code {procs[rank].exitcode} without "
                    "reporting a result (killed, crashed or called os._exit)"
                )
            status, payload = report
            if status == "error":
                raise AssertionError(_failure_message(procs, paths, name))
            results[rank] = payload
    return [results[r] for r in range(len(procs))]


def _failure_message(
    procs: list[multiprocessing.process.BaseProcess], paths: list[str], name: str
) -> str:
    """Every failed rank's traceback, after giving the others a moment to report theirs.

    When one rank raises, its peers often fail a moment later in a collective ("connection
    closed by peer"); waiting briefly and listing all failures in rank order keeps the root
    cause in the message whichever rank happened to report first.
    """
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    while (live := [p.sentinel for p in procs if p.is_alive()]) and time.monotonic() < deadline:
        multiprocessing.connection.wait(live, timeout=max(0.0, deadline - time.monotonic()))
    _stop(procs)
    failures = []
    for rank, path in enumerate(paths):
        report = _read_result(path)
        if report is not None and report[0] == "error":
            failures.append(f"--- rank {rank} of {len(procs)} failed:\n{report[1]}")
    return f"{name}: {len(failures)} rank(s) failed\n" + "\n".join(failures)


def train(
    engine: Any,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rank: int,
    world_size: int,
    *,
    mean_over_ranks: bool = False,
    after_backward: Optional[Callable[[int], None]] = None,
    after_step: Optional[Callable[[int], None]] = None,
) -> list[float]:
    """Train `engine` one step per global batch, on this rank's rows of each (`rank_slice`).

    Each step is the engine's loop: `loss = loss_fn(engine(x), y); engine.backward(loss);
    engine.step()`.

    Args:
        engine: What `fxzero.compile` returned.
        batches: Global batches (x, y), one per step.
        loss_fn: `loss_fn(output, y)`, the mean loss of this rank's micro-batch.
        rank, world_size: This rank and the number of ranks.
        mean_over_ranks: Return the mean over ranks of each step's local loss (a collective:
            every rank must ask for it). With equal micro-batches and a model without buffers
            that is the loss of one model over the whole global batch.
        after_backward: Called with the step's index after its backward, before its step.
        after_step: Called with the step's index after its step.

    Returns:
        Per step: this rank's loss, or the mean over ranks with `mean_over_ranks`.
    """
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = loss_fn(engine(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
        engine.backward(loss)
        if after_backward is not None:
            after_backward(i)
        engine.step()
        if after_step is not None:
            after_step(i)
        losses.append(loss.detach().reshape(()).cpu().clone())
    stacked = torch.stack(losses) if losses else torch.zeros(0)
    if mean_over_ranks and world_size > 1:
        dist.all_reduce(stacked)
        stacked /= world_size
    return stacked.tolist()

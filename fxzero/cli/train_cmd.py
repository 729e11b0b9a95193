"""`fxzero train MODEL --ranks N --steps K`: train on N local ranks under torchrun, record it all.

The command launches `torchrun --standalone --nproc_per_node=N -m fxzero.cli.train_worker`
and renders what rank 0 reports (one JSON event per line on stdout) as a tqdm progress bar, or as
one line per step when the output is not a terminal. The workers' stderr is kept and shown
only when something fails (with `fxzero --traceback train ...`, in full).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Optional

import click

from fxzero.cli.common import CLIError, reports_errors, slug
from fxzero.viz.fmt import human_bytes, human_count

__all__ = ["train_command"]


def _torchrun_command(model: str, ranks: int, options: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            "-m", "fxzero.cli.train_worker", "--model", model, *options]


def _mem(ranks: list[dict]) -> str:
    return " ".join(human_bytes(r["model_states"] + r["gathered_peak"]) for r in ranks)


def _step_line(ev: dict, steps: int) -> str:
    scale = ""  # float16 loss scaling: the scale, and the steps skipped so far on overflow
    if ev.get("loss_scale") is not None:
        scale = f"  loss scale {ev['loss_scale']:g}, {ev['skipped_steps']} skipped"
    return (f"step {ev['step']:>4}/{steps}  loss {ev['loss']:.4f}  {ev['seconds'] * 1e3:8.1f} ms  "
            f"mem/rank {_mem(ev['ranks'])}{scale}")


class _Progress:
    """A tqdm progress bar on a terminal; plain lines elsewhere (CI logs, pipes, tests)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.tty = sys.stdout.isatty()
        self.bar = None
        self.last: Optional[dict] = None

    def step(self, ev: dict) -> None:
        self.last = ev
        if not self.tty:
            click.echo(_step_line(ev, self.steps))
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, desc="training", unit="step", file=sys.stdout, dynamic_ncols=True)
        self.bar.set_postfix_str(f"loss {ev['loss']:.4f}  {ev['seconds'] * 1e3:.0f} ms/step  "
                                 f"mem/rank {_mem(ev['ranks'])}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            if self.last:
                click.echo(_step_line(self.last, self.steps))


MAX_COLLECTIVE_TIMEOUT_S = 1e7
"""About 116 days: any longer is waiting forever (and overflows the timeout's type)."""


def _check_timeout(ctx, param, value: float) -> float:
    if not 0 < value <= MAX_COLLECTIVE_TIMEOUT_S:  # also rejects nan
        raise click.BadParameter(f"must be a number of seconds > 0 and <= {MAX_COLLECTIVE_TIMEOUT_S:g}, got {value:g}")
    return value


@click.command("train")
@click.argument("model")
@click.option("--ranks", type=click.IntRange(min=1), default=2, show_default=True, help="Local ranks (processes).")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Training steps.")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Micro-batch per rank (default: the example inputs' first dimension).")
@click.option("--stage", type=click.Choice(["1", "2", "3"]), default=None, help="ZeRO stage (default 3, or the --config file's).")
@click.option("--lr", type=float, default=None, help="AdamW learning rate (default: the config's, 1e-3).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A DeepSpeed-style JSON config.")
@click.option("--inputs", "inputs", multiple=True, metavar="SPEC",
              help="Input specs when the model has no example_inputs(), e.g. 'int64[8,64]:0..1000' (positional "
                   "inputs only; the grammar is `fxzero compile --help`'s).")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Artifact directory to write (default artifacts/<MODEL>-train).")
@click.option("--collective-timeout", "collective_timeout", type=float, callback=_check_timeout,
              default=300.0, show_default=True, metavar="SECONDS",
              help="How long a collective waits for the other ranks before the run fails (a rank that "
                   "died or hangs), instead of waiting forever.")
@click.pass_context
def train_command(ctx, model, ranks, steps, batch, stage, lr, config_path, inputs, out_dir, collective_timeout):
    """Train MODEL on --ranks local CPU ranks (torchrun) on a synthetic task.

    Shows loss, step time and per-rank memory (model states + peak gathered) as it goes, and
    writes the artifacts of the program that ran (as `fxzero compile` does) plus run.json and
    the last step's timeline as every rank recorded it, for `fxzero graph DIR` and
    `fxzero schedule DIR --trace t.json` (a trace with one process per rank).
    """
    with reports_errors():  # a MODEL that does not resolve fails here, before any rank starts
        from fxzero.modelspec import build_model, parse_call, parse_model
        from fxzero.modelspec.hf import is_hf_model, is_hf_target

        if is_hf_target(parse_model(model).target) or is_hf_model(build_model(model)):
            raise CLIError(f"fxzero train does not train Hugging Face models ({model}) yet: its synthetic tasks "
                           "call a model with positional inputs. See its program with `fxzero compile`, "
                           "or train it from Python with fxzero.compile(model, config) called the HF way")
        call = parse_call(inputs)
        if call.kwargs:
            raise CLIError(f"fxzero train takes positional --inputs only (its synthetic task reads them), "
                           f"not {call.kwargs[0][0]}=...; e.g. --inputs 'int64[8,64]:0..1000'")
    out_dir = out_dir or os.path.join("artifacts", slug(model) + "-train")
    options = ["--steps", str(steps), "--out", out_dir, "--collective-timeout", repr(float(collective_timeout))]
    for flag, value in (("--batch", batch), ("--stage", stage), ("--lr", lr), ("--config", config_path)):
        if value is not None:
            options += [flag, str(value)]
    for spec in inputs:
        options += ["--inputs", spec]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.Popen(_torchrun_command(model, ranks, options), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    except OSError as e:
        raise CLIError(f"could not start torchrun ({e})") from e
    stderr_lines: list[str] = []
    drain = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)
    drain.start()
    progress = _Progress(steps)
    errors: list[dict] = []
    done = None
    try:
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                click.echo(line.rstrip("\n"))  # the model's own prints
                continue
            if not isinstance(ev, dict) or "event" not in ev:
                click.echo(line.rstrip("\n"))
            elif ev["event"] == "start":
                click.echo(f"training {model} ({human_count(ev['params'])} parameters) with ZeRO-{ev['stage']} "
                           f"on {ev['world']} ranks; compiled in {ev['compile_seconds']:.2f} s")
            elif ev["event"] == "task":
                click.echo(f"task: {ev['describe']}")
            elif ev["event"] == "step":
                progress.step(ev)
            elif ev["event"] == "error":
                errors.append(ev)
            elif ev["event"] == "done":
                done = ev
    except KeyboardInterrupt:
        proc.terminate()
        raise
    finally:
        progress.close()
        rc = proc.wait()
        drain.join(timeout=5)
    if rc != 0 or done is None:
        if ctx.find_root().params.get("traceback"):
            click.echo("".join(stderr_lines), err=True)
        if errors:
            # The cause first: a rank's own error, then a collective that timed out, and only then
            # a rank whose collective failed because a peer had gone (after that peer's error).
            order = {"": 0, "timeout": 1, "peer_gone": 2}
            first = min(errors, key=lambda e: (order.get(e.get("collective", ""), 0), e["rank"]))
            raise CLIError(f"training failed on rank {first['rank']}: {first['message']}")
        # No rank said why (it died outside its error handling: a signal, an abort at exit): the last
        # lines torchrun and the ranks wrote, without its separator rules, name which rank and how.
        tail = [line.rstrip() for line in stderr_lines if line.strip() and line.strip().strip("=-") != ""]
        said = "\n  ".join(tail[-12:]) if tail else "no output"
        raise CLIError(f"torchrun exited with code {rc}{'' if done is None else ' after the run finished'}; "
                       f"its last lines:\n  {said}")
    click.echo(f"wrote {done['out']}/ (the artifacts of the program that ran, run.json, and timeline.json: "
               "when each instruction of the last step ran, per rank)")
    click.echo(f"next: fxzero schedule {done['out']} --trace {done['out']}/trace.json")

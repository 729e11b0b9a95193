"""`fxzero plan MODEL --gpus N --preset P`: the configuration to train MODEL with on a cluster."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import click
import torch

from fxzero import cost
from fxzero.cli.common import CLIError, HARDWARE_DESCRIPTIONS, MODEL_CONFIG_HELP, reports_errors, slug
from fxzero.plan.grid import FXZERO_ONLY, MICRO_BATCH_CAP
from fxzero.viz.fmt import human_bytes, human_count, human_seconds

__all__ = ["plan_command"]

PER_GPU_DEFAULT = 8
"""--global-batch defaults to this many samples per GPU."""


def gpu_presets() -> list[str]:
    """The `fxzero.cost` presets that state a device's memory, which a plan must fit in."""
    return sorted(name for name, p in cost.PRESETS.items() if p.device_memory_bytes)


def _token_input(call) -> Optional[torch.Tensor]:
    """The call's one input of token ids ((B, T) integers), where it is the only tensor."""
    tensors = [t for t in (*call[0], *call[1].values()) if isinstance(t, torch.Tensor)]
    if len(tensors) == 1 and tensors[0].dim() == 2 and not tensors[0].dtype.is_floating_point:
        return tensors[0]
    return None


def _loaded(spec: str, model_config: Optional[str], seq: Optional[int]):
    """(model on the meta device, micro-batch -> (args, kwargs), tokens per sample, what the step is)."""
    from fxzero.cli.estimate_activations import shaped_call
    from fxzero.modelspec import build_model
    from fxzero.plan import NextTokenLoss

    with reports_errors(f"building {spec}"):
        model = build_model(spec, model_config=model_config)
        _, args, kwargs = shaped_call(model, spec, seq, 1)
    token = _token_input((args, kwargs))
    if token is not None and seq is None and spec.startswith("transformers:"):
        raise CLIError(f"--seq is needed: {spec} has no training sequence of its own (its default call is "
                       f"{token.shape[1]} tokens long, a tracing example); give the one you will train at, "
                       "e.g. --seq 4096")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if token is not None and len(args) == 1 and not kwargs and isinstance(vocab, int):
        wrapped, what = NextTokenLoss(model), "logits and the cross-entropy over them, one program"
    else:
        wrapped, what = model, "the model as called; its outputs' gradient is the backward's input (no loss)"

    def call(micro_batch: int):
        _, a, kw = shaped_call(model, spec, seq, micro_batch)
        return ((a[0], a[0]) if wrapped is not model else a), kw

    return wrapped, call, (token.shape[1] if token is not None else 1), what


@click.command("plan")
@click.argument("model")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="GPUs the model trains on (data parallel).")
@click.option("--preset", "preset_name", required=True, metavar="HARDWARE",
              help="The GPU cluster (fxzero.cost.PRESETS): " + ", ".join(gpu_presets()) + ".")
@click.option("--seq", type=click.IntRange(min=1), default=None, metavar="S",
              help="Sequence length (dimension 1 of the token inputs). Default: the model's own (a zoo model's "
                   "seq_len); a transformers: MODEL needs it.")
@click.option("--global-batch", "global_batch", type=click.IntRange(min=1), default=None, metavar="B",
              help=f"Samples per optimizer step over all GPUs = micro-batch x accumulation x GPUs. "
                   f"Default: {PER_GPU_DEFAULT} per GPU (with --micro-batch M: the multiple of M nearest under it).")
@click.option("--max-micro-batch", "max_micro_batch", type=click.IntRange(min=1), default=MICRO_BATCH_CAP,
              show_default=True, help="Largest micro-batch per GPU tried.")
@click.option("--micro-batch", "micro_batch", type=click.IntRange(min=1), default=None, metavar="M",
              help="Plan this micro-batch per GPU only (--global-batch must then be a multiple of GPUs x M).")
@click.option("--model-config", "model_config", default=None, metavar="JSON|PATH", help=MODEL_CONFIG_HELP)
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the best configuration: ds_config.json and fxzero_config.py "
                   "(default plans/<MODEL>-<N>x<HARDWARE>).")
@click.option("--json", "as_json", is_flag=True, help="Print the ranked table and the best configuration as JSON.")
def plan_command(model, gpus, preset_name, seq, global_batch, max_micro_batch, micro_batch, model_config, out_dir,
                 as_json):
    """Rank configurations for training MODEL on --gpus GPUs of --preset, and write the best.

    Each candidate is compiled on fake tensors and its step simulated on the cluster: predicted
    step, tokens/s per GPU, MFU and peak memory per GPU against the device's. What does not fit
    is marked and never chosen. The grid, in bf16 with AdamW: ZeRO-3 and ZeRO-2 x micro-batches
    (the divisors of global batch / GPUs, up to --max-micro-batch) x recompute none, selective,
    unit-attention (unit keeping each fused attention's outputs), unit x offload none, cpu (optimizer states and, at ZeRO-3, parameters); the gradient
    accumulation makes the global batch. A model of repeated blocks is compiled at 2 and 3
    blocks (deeper where its first blocks are unlike the rest) and extrapolated to its depth;
    candidates that need more memory than one that did not fit, or more recompute or offload
    than one that fits, are not compiled. The best is written as a ready ds_config.json and the
    fxzero.Config it reads as (fxzero_config.py). See docs/guides/plan.md.

    \b
      fxzero plan llama3-8b --gpus 8 --preset h100-80gb
      fxzero plan llama3-70b --gpus 64 --preset h100-80gb --global-batch 512
    """
    from fxzero.plan import micro_batches, plan, python_snippet

    if preset_name not in gpu_presets():
        raise CLIError(f"unknown --preset {preset_name!r}: a plan needs a GPU preset that states its memory; "
                       f"choose one of {', '.join(gpu_presets())}")
    hardware = cost.preset(preset_name)
    if global_batch is None:
        global_batch = gpus * (micro_batch * max(1, PER_GPU_DEFAULT // micro_batch) if micro_batch else PER_GPU_DEFAULT)
    try:
        micro_batches(global_batch, gpus, max_micro_batch, micro_batch)
    except ValueError as e:
        raise CLIError(str(e)) from e
    wrapped, call, tokens, step_is = _loaded(model, model_config, seq)
    start = time.perf_counter()
    progress = (lambda label: None) if as_json else (lambda label: click.echo(f"  compiling {label}", err=True))
    with reports_errors(f"planning {model}"):
        result = plan(wrapped, call, gpus=gpus, global_batch=global_batch, hardware=hardware,
                      tokens_per_sample=tokens, max_micro_batch=max_micro_batch, micro_batch=micro_batch, log=progress)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in wrapped.parameters())
    best = result.best
    out_dir = out_dir or os.path.join("plans", f"{slug(model)}-{gpus}x{preset_name}")
    written = []
    if best is not None:
        ds = best.candidate.deepspeed(gpus)
        with reports_errors(f"writing {out_dir}"):
            os.makedirs(out_dir, exist_ok=True)
            for name, text in (("ds_config.json", json.dumps(ds, indent=2) + "\n"),
                               ("fxzero_config.py", python_snippet(best.candidate.config(gpus)))):
                with open(os.path.join(out_dir, name), "w") as f:
                    f.write(text)
                written.append(os.path.join(out_dir, name))
    if as_json:
        click.echo(json.dumps({
            "model": model, "params": params, "gpus": gpus, "preset": preset_name, "seq": tokens if tokens > 1 else None,
            "global_batch": global_batch, "device_memory_bytes": result.device_memory_bytes, "depth": result.depth,
            "base_depths": {f"{stage},{offload}": k for (stage, offload), k in result.bases.items()},
            "step": step_is, "compiles": result.compiles, "seconds": round(seconds, 2),
            "rows": [r.to_json() for r in result.rows], "not_compiled": list(result.not_compiled),
            "best": None if best is None else {**best.to_json(), "ds_config": best.candidate.deepspeed(gpus),
                                               "fxzero_config": python_snippet(best.candidate.config(gpus))},
            "written": written}, indent=1))
    else:
        _print(model, params, gpus, preset_name, hardware, tokens, global_batch, step_is, result, seconds, written)
    if best is None:
        least = min(result.rows, key=lambda r: r.peak_bytes, default=None)
        raise CLIError(f"no configuration fits in {human_bytes(result.device_memory_bytes)} per GPU"
                       + (f" (the least: {human_bytes(least.peak_bytes)}, {least.candidate.label()})" if least else "")
                       + ": give more --gpus, a shorter --seq, or a preset with more memory")


def _print(model, params, gpus, preset_name, hardware, tokens, global_batch, step_is, result, seconds, written):
    memory = result.device_memory_bytes
    described = HARDWARE_DESCRIPTIONS.get(preset_name, preset_name)
    seq = f", sequence {tokens}" if tokens > 1 else ""
    click.echo(f"{model}: {human_count(params)} parameters{seq}, global batch {global_batch} ({global_batch // gpus} "
               f"per GPU); bf16 with AdamW; the step: {step_is}")
    click.echo(f"on {gpus} x {preset_name} ({described}), {human_bytes(memory)} per GPU")
    if result.depth:
        by_base: dict[int, list[str]] = {}
        for (stage, offload), k in sorted(result.bases.items()):
            by_base.setdefault(k, []).append(f"ZeRO-{stage} offload {offload}")
        depth = f"extrapolated to {result.depth} blocks from " + "; ".join(
            f"{k} and {k + 1} ({', '.join(kinds)})" for k, kinds in sorted(by_base.items()))
    else:
        depth = "whole"
    click.echo(f"{result.compiles} programs compiled ({depth}) and simulated in {seconds:.1f} s")
    click.echo("")
    rate = "tokens/s/GPU" if tokens > 1 else "samples/s/GPU"
    click.echo(f"{'rank':>4}  {'stage':<6}{'micro x GA':<11}{'recompute':<16}{'offload':<24}{'step':>9}"
               f"{rate:>14}{'MFU':>7}{'peak/GPU':>11}  fits")
    for n, r in enumerate(result.rows, 1):
        c = r.candidate
        fits = "yes" if r.fits else f"no, {human_bytes(r.peak_bytes - memory)} over"
        click.echo(f"{n if r.fits else '-':>4}  {c.stage:<6}{f'{c.micro_batch} x {c.accumulation}':<11}"
                   f"{c.recompute:<16}{c.offloaded:<24}{human_seconds(r.step_seconds):>9}"
                   f"{r.tokens_per_s_per_gpu:>14,.0f}{100 * r.mfu:>6.1f}%{human_bytes(r.peak_bytes):>11}  {fits}")
    for line in result.not_compiled:
        click.echo(f"not compiled: {line}")
    best = result.best
    if best is None:
        return
    click.echo("")
    click.echo(f"best: {best.candidate.label()}: {human_seconds(best.step_seconds)} a step, "
               f"{best.tokens_per_s_per_gpu:,.0f} {rate}, MFU {100 * best.mfu:.1f}%, "
               f"{human_bytes(best.peak_bytes)} of {human_bytes(memory)} per GPU")
    click.echo(f"wrote {written[0]} (fxzero.initialize(config=...) or deepspeed) and {written[1]} (the fxzero.Config "
               "it reads as)")
    if best.candidate.recompute in FXZERO_ONLY:
        what = {"selective": "selective recompute",
                "unit-attention": "keeping each fused attention's outputs (keep_attention)"}[best.candidate.recompute]
        click.echo(f"note: {what} is fxzero's own; DeepSpeed has no key for it, so ds_config.json says "
                   "activation_checkpointing (every unit recomputed): fxzero_config.py is the exact configuration")

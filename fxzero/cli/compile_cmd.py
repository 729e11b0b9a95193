"""`fxzero compile MODEL -o DIR`: trace and schedule on fake tensors, write the artifacts."""

from __future__ import annotations

import os

import click

from fxzero.cli.common import compile_source, reports_errors, slug, trace_options
from fxzero.viz.fmt import human_bytes, human_count

__all__ = ["compile_command", "pass_trace_lines"]


def pass_trace_lines(pass_trace: list[dict]) -> list[str]:
    """The pass trace as a table: what each pass changed, with counts and times."""
    lines = [f"  {'pass':<24}{'changed':<9}{'nodes':<16}{'seconds':>8}  what it did"]
    for r in pass_trace:
        nodes = f"{r['nodes_before']} -> {r['nodes_after']}"
        summary = ", ".join(f"{k} {v}" for k, v in r.get("summary", {}).items())
        lines.append(f"  {r['name']:<24}{'yes' if r['changed'] else 'no':<9}{nodes:<16}{r['seconds']:>8.3f}  {summary}")
    return lines


@click.command("compile")
@click.argument("model")
@trace_options
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Artifact directory to write (default artifacts/<MODEL>).")
def compile_command(model, world, stage, config_path, model_config, inputs, device, out_dir):
    """Trace MODEL and schedule it for --world ranks, on fake tensors; write the artifacts.

    Nothing is launched and no parameter memory is allocated: the model is built on the meta
    device. DIR then holds the rewritten graph (graph.json, graph.txt), the pass trace
    (pass_trace.json) and the schedule the runtime would execute (schedule.json), for
    `fxzero graph DIR` and `fxzero schedule DIR`.

    MODEL may be a Hugging Face class, built from --model-config and traced as HF models are
    called, by keyword:

    \b
      fxzero compile transformers:GPT2LMHeadModel --model-config '{"n_layer": 2}' \\
          --inputs 'input_ids=int64[2,128]:0..50257 labels=int64[2,128]:0..50257' -o DIR
    """
    result = compile_source(model, world=world, stage=stage, config_path=config_path, inputs=inputs,
                            model_config=model_config, device=device)
    art = result.artifacts
    out_dir = out_dir or os.path.join("artifacts", slug(model))
    with reports_errors():
        art.write(out_dir)
    m, s = art.manifest, art.schedule
    passes = m["pass_seconds"]
    click.echo(
        f"compiled {model} ({human_count(m['params'])} parameters, {m['units']} units) for ZeRO-{s.stage} "
        f"on {s.world_size} ranks in {result.seconds:.2f} s (passes {passes:.2f} s, trace and schedule "
        f"{result.seconds - passes:.2f} s)"
    )
    click.echo("pass trace:")
    for line in pass_trace_lines(art.pass_trace):
        click.echo(line)
    counts = ", ".join(f"{p.name} {len(p.instructions)}" for p in s.programs)
    click.echo(f"schedule: {counts} instructions; peak gathered {human_bytes(s.peak_gathered_bytes)}; "
               f"fingerprint {s.fingerprint}")
    click.echo(f"wrote {out_dir}/ (manifest.json, schedule.json, pass_trace.json, graph.json, graph.txt, memory.json)")
    click.echo(f"next: fxzero graph {out_dir}    fxzero schedule {out_dir}")

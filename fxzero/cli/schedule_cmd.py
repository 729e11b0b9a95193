"""`fxzero schedule DIR|MODEL`: the instruction stream, its Chrome trace and a memory plot."""

from __future__ import annotations

import json

import click

from fxzero import cost
from fxzero.cli.common import CLIError, DEFAULT_HARDWARE, describe_hardware, load_source, reports_errors, trace_options

__all__ = ["schedule_command"]


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


@click.command("schedule")
@click.argument("sources", metavar="DIR|MODEL [DIR_B]", nargs=-1, required=True)
@trace_options
@click.option("--json", "as_json", is_flag=True, help="Print the Schedule JSON the runtime executes, nothing else.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="Write a Chrome/Perfetto trace (JSON): the timeline recorded by `fxzero train` when "
                   "DIR has one (a process per rank), else the simulated one.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG plot of gathered and resident memory over the step.")
@click.option("--simulate", "hw_name", type=click.Choice(sorted(cost.PRESETS)), default=DEFAULT_HARDWARE,
              show_default=True, help="Hardware preset (fxzero.cost.PRESETS) the table's times are simulated for.")
@click.option("--full", is_flag=True, help="One row per instruction (default: runs of compute folded).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Write the schedule explorer: one offline HTML page (timeline per stream and rank, memory, "
                   "unit filter, summary per hardware preset). Two sources are drawn one above the other.")
def schedule_command(sources, world, stage, config_path, model_config, inputs, device, as_json, trace_path, plot_path,
                     hw_name, full, html_path):
    """Show the schedule: per stream, in the order the runtime runs it, with bytes and times.

    Times come from fxzero.cost's simulator for --simulate HARDWARE. The summary gives step
    time, exposed communication, bytes per collective kind and peak memory per rank; for a
    directory written by `fxzero train`, also what each rank measured in its last step.
    With --html OUT and two sources (DIR_A DIR_B), the explorer shows both on one time axis.
    """
    if len(sources) > 2 or (len(sources) == 2 and (not html_path or as_json or trace_path or plot_path)):
        raise CLIError(f"{len(sources)} sources given ({' '.join(sources)}): two are compared only in the explorer, "
                       "`fxzero schedule --html OUT.html DIR_A DIR_B` (no --json, --trace or --plot); "
                       "the other views take one")
    if len(sources) == 2:
        arts = [load_source(s, world=world, stage=stage, config_path=config_path, inputs=inputs,
                            model_config=model_config, device=device) for s in sources]
        _write_explorer(html_path, list(zip(sources, arts)), hw_name)
        return
    (source,) = sources
    from fxzero.viz.table import recorded_lines, schedule_table, summary_lines
    from fxzero.viz.timing import recorded, simulated

    art = load_source(source, world=world, stage=stage, config_path=config_path, inputs=inputs,
                      model_config=model_config, device=device)
    cost_model = cost.preset(hw_name)
    sim = simulated(art.schedule, cost_model)
    with reports_errors():
        ranks = recorded(art)
    step = (art.timeline or {}).get("step", "?")
    if ranks:
        trace_says = f"the timeline recorded on {_ranks(len(ranks))} (step {step}), a process per rank"
    else:
        trace_says = f"the timeline {sim.label}" + ("" if art.run else "; `fxzero train` records real ones")
    if as_json:
        click.echo(art.schedule.dumps())
    else:
        s, m = art.schedule, art.manifest
        click.echo(f"{m.get('model')}: ZeRO-{s.stage} on {s.world_size} ranks, {len(s.units)} units, "
                   f"fingerprint {s.fingerprint}")
        click.echo("")
        lines = schedule_table(art, sim, full=full) + summary_lines(art, sim, describe_hardware(cost_model))
        if ranks:
            lines += recorded_lines(ranks, step)
        lines.append(f"trace (--trace): {trace_says}")
        for line in lines:
            click.echo(line)
    if trace_path:
        from fxzero.viz.chrome_trace import chrome_trace

        trace = (chrome_trace(art, ranks, source="recorded") if ranks
                 else chrome_trace(art, [sim], source="simulated", hardware=cost_model.name))
        with reports_errors():
            with open(trace_path, "w") as f:
                json.dump(trace, f)
        click.echo(f"wrote {trace_path}: {trace_says} (open it at ui.perfetto.dev or chrome://tracing)", err=as_json)
    if plot_path:
        from fxzero.viz.memplot import memory_plot

        with reports_errors():
            memory_plot(art, plot_path)
        click.echo(f"wrote {plot_path}", err=as_json)
    if html_path:
        _write_explorer(html_path, [(source, art)], hw_name, err=as_json)


def _write_explorer(path: str, runs: list, hw_name: str, err: bool = False) -> None:
    import os
    import pathlib

    from fxzero.viz.explorer import explorer_data, render_explorer

    with reports_errors():
        page = render_explorer(explorer_data(runs, cost.PRESETS, default_preset=hw_name, describe=describe_hardware))
    with reports_errors(f"writing {path}"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    click.echo(f"wrote {path} ({os.path.getsize(path):,} bytes): the schedule explorer; open "
               f"{pathlib.Path(path).resolve().as_uri()}", err=err)

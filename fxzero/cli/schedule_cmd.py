"""`fxzero schedule DIR|MODEL`: the instruction stream, its Chrome trace and a memory plot."""

from __future__ import annotations

import json

import click

from fxzero.cli.common import load_source, reports_errors, trace_options
from fxzero.timeline import DEFAULT_HARDWARE, HARDWARE, hardware, instruction_times

__all__ = ["schedule_command"]


@click.command("schedule")
@click.argument("source", metavar="DIR|MODEL")
@trace_options
@click.option("--json", "as_json", is_flag=True, help="Print the Schedule JSON the runtime executes, nothing else.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="Write a Chrome/Perfetto trace (JSON) of the timeline.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG plot of gathered and resident memory over the step.")
@click.option("--simulate", "hw_name", type=click.Choice(sorted(HARDWARE)), default=DEFAULT_HARDWARE,
              show_default=True, help="Hardware preset the times are estimated for.")
@click.option("--full", is_flag=True, help="One row per instruction (default: runs of compute folded).")
def schedule_command(source, world, stage, config_path, inputs, as_json, trace_path, plot_path, hw_name, full):
    """Show the schedule: per stream, in the order the runtime runs it, with bytes and times.

    The summary gives step time, exposed communication, bytes per collective kind and peak
    memory per rank. Times are estimates for --simulate HARDWARE.
    """
    from fxzero.viz.table import schedule_table, summary_lines

    art = load_source(source, world=world, stage=stage, config_path=config_path, inputs=inputs)
    hw = hardware(hw_name)
    times = instruction_times(art.schedule, hw)
    if as_json:
        click.echo(art.schedule.dumps())
    else:
        s, m = art.schedule, art.manifest
        click.echo(f"{m.get('model')}: ZeRO-{s.stage} on {s.world_size} ranks, {len(s.units)} units, "
                   f"fingerprint {s.fingerprint}")
        click.echo("")
        for line in schedule_table(art, times, full=full):
            click.echo(line)
        for line in summary_lines(art, times, hw):
            click.echo(line)
    if trace_path:
        from fxzero.viz.chrome_trace import chrome_trace

        with reports_errors():
            with open(trace_path, "w") as f:
                json.dump(chrome_trace(art, times, hw), f)
        click.echo(f"wrote {trace_path} (open it at ui.perfetto.dev or chrome://tracing)", err=as_json)
    if plot_path:
        from fxzero.viz.memplot import memory_plot

        with reports_errors():
            memory_plot(art, plot_path)
        click.echo(f"wrote {plot_path}", err=as_json)

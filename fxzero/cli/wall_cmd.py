"""`fxzero wall [-o wall.html] [--open]`: the Memory Wall page, one offline HTML file."""

from __future__ import annotations

import os
import pathlib
import webbrowser

import click

from fxzero.cli.common import reports_errors

__all__ = ["wall_command"]


@click.command("wall")
@click.option("-o", "--output", "output", default="wall.html", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the page.")
@click.option("--open", "open_page", is_flag=True, help="Open the page in the default browser once written.")
def wall_command(output: str, open_page: bool) -> None:
    """The Memory Wall: per-GPU model states and activations of DDP and ZeRO-1/2/3 against the GPU's memory.

    One self-contained HTML file (no network request; works from file://) with controls for
    parameters, GPUs, GPU memory, precision, optimizer and offload, and for activations
    (sequence, micro-batch, layers, width, heads, recompute none / unit / selective, fused
    attention, dropout), a chart, the figures, a fits / does-not-fit verdict per stage and the
    formula behind each figure. Model states follow `fxzero estimate --params`; activations
    Megatron's per-layer formula (fxzero.activation_estimate.megatron_per_layer) times the
    layers. The view's state is the address's fragment
    (wall.html#params=7.5e9&gpus=64&seq=2048&mb=1&recompute=unit), so a view can be shared.
    """
    from fxzero.viz.wall import render_wall

    with reports_errors(f"writing {output}"):
        with open(output, "w", encoding="utf-8") as f:
            f.write(render_wall())
    url = pathlib.Path(output).resolve().as_uri()
    click.echo(f"wrote {output} ({os.path.getsize(output):,} bytes); open {url}")
    if open_page and not webbrowser.open(url):
        raise click.ClickException(f"no browser could be started here; open {url} yourself")

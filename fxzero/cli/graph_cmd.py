"""`fxzero graph DIR|MODEL`: a graphviz drawing of the rewritten program."""

from __future__ import annotations

import os
import sys

import click

from fxzero.cli.common import CLIError, load_source, reports_errors, slug, trace_options
from fxzero.viz.dot import to_dot
from fxzero.viz.render import render

__all__ = ["graph_command"]

AUTO_COLLAPSE_NODES = 400
"""Above this many nodes a full drawing is unreadable (and slow to lay out): collapse."""


@click.command("graph")
@click.argument("source", metavar="DIR|MODEL")
@trace_options
@click.option("--format", "fmt", default=None, metavar="FORMAT",
              help="svg, png, pdf, ... (any format `dot` writes), or dot for the DOT source. "
                   "Default: from -o's extension, else svg.")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="File to write ('-' for stdout). Default: graph.FORMAT in DIR, or <MODEL>-graph.FORMAT.")
@click.option("--unit", default=None, metavar="NAME", help="Draw only this unit, in full detail.")
@click.option("--collapse/--no-collapse", default=None,
              help=f"One box per unit and program for the compute (IR nodes stay). Default: on above "
                   f"{AUTO_COLLAPSE_NODES} nodes, unless --unit is given.")
def graph_command(source, world, stage, config_path, model_config, inputs, device, fmt, output, unit, collapse):
    """Draw the rewritten program: one cluster per unit, forward beside backward.

    Nodes are coloured by kind (compute, all-gather, wait, free, reduce-scatter, fetch,
    offload) and the edges of collectives are drawn thick. Rendering uses graphviz's `dot`.
    """
    art = load_source(source, world=world, stage=stage, config_path=config_path, inputs=inputs,
                      model_config=model_config, device=device)
    if fmt is None:
        ext = os.path.splitext(output)[1].lstrip(".") if output and output != "-" else ""
        fmt = ext or "svg"
    fmt = fmt.lower()
    if unit is not None and unit not in art.units:
        raise CLIError(f"no unit {unit!r}; the units are {', '.join(art.units)}")
    n_nodes = len(art.graph["nodes"])
    if collapse is None:
        collapse = unit is None and n_nodes > AUTO_COLLAPSE_NODES
        if collapse:
            click.echo(f"note: {n_nodes} nodes; drawing one box per unit's compute "
                       "(--no-collapse draws every node, --unit NAME one unit)", err=True)
    s = art.schedule
    unit_bytes = {u.name: u.padded_numel * u.itemsize for u in s.units}
    title = (f"{art.manifest.get('model')}: ZeRO-{s.stage} on {s.world_size} ranks"
             + (f", unit {unit}" if unit else "") + (" (compute collapsed per unit)" if collapse else ""))
    with reports_errors():
        data = render(to_dot(art.graph, unit_bytes=unit_bytes, title=title, collapse=collapse, unit=unit), fmt)
    if output is None:
        name = "graph" + (f"-{slug(unit)}" if unit else "") + ("-collapsed" if collapse else "") + f".{fmt}"
        output = os.path.join(art.directory, name) if art.directory else f"{slug(source)}-{name}"
    if output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    with reports_errors():
        with open(output, "wb") as f:
            f.write(data)
    click.echo(f"wrote {output} ({fmt}, {len(data):,} bytes; {len(art.units)} units, {n_nodes} nodes)")

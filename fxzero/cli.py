"""The `fxzero` command line.

The CLI only reads what the compiler produces (schedules, pass traces, reports); it never
drives the compiler's live objects. Options build `fxzero.Config` values and nothing else.
"""

from __future__ import annotations

import click

__all__ = ["main"]


@click.group(invoke_without_command=True)
@click.pass_context
def main(ctx: click.Context) -> None:
    """fxzero: ZeRO-3 as a compiler on torch.fx.

    Inspect what fxzero compiles: the rewritten graph, the schedule it runs and the bytes it
    moves. Run `fxzero COMMAND --help` for a command's options.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@main.command()
def version() -> None:
    """Print the fxzero version."""
    from fxzero import __version__

    click.echo(__version__)


if __name__ == "__main__":
    main()

"""The `fxzero` command line: record what the compiler produces, then view it.

    fxzero compile MODEL -o DIR        trace and schedule on fake tensors; write the artifacts
    fxzero graph DIR|MODEL             graphviz drawing of the rewritten program
    fxzero schedule DIR|MODEL          the instruction stream, a Chrome trace, a memory plot
    fxzero estimate --params N|MODEL   per-rank memory of model states by ZeRO stage
    fxzero plan MODEL --gpus N         rank configurations on a cluster (--preset); write the best
    fxzero train MODEL --ranks N       train on N local ranks (torchrun) and record the artifacts
    fxzero export CKPT_DIR OUT         a checkpoint's model as one safetensors file (HF-loadable)
    fxzero run [--num_gpus N] SCRIPT   a DeepSpeed program, unchanged: `import deepspeed` is fxzero

The viewers only read recorded artifacts (`fxzero.artifacts`); options build `fxzero.Config`
values and nothing else. A person's mistake ends in one line `Error: ...` and exit code 1.
"""

from __future__ import annotations

import click

from fxzero.cli.compile_cmd import compile_command
from fxzero.cli.estimate_cmd import estimate_command
from fxzero.cli.export_cmd import export_command
from fxzero.cli.graph_cmd import graph_command
from fxzero.cli.plan_cmd import plan_command
from fxzero.cli.run_cmd import run_command
from fxzero.cli.schedule_cmd import schedule_command
from fxzero.cli.train_cmd import train_command

__all__ = ["main"]


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--traceback", is_flag=True, help="Show the full Python stack on errors (for bug reports).")
@click.pass_context
def main(ctx: click.Context, traceback: bool) -> None:
    """fxzero: ZeRO-3 as a compiler on torch.fx.

    See the whole program before it runs: what is gathered when, what is freed, what is
    reduced, and what it costs. MODEL is a zoo name (gpt-tiny, gpt2, llama-7b, cnn, ...),
    'pkg.module:factory', 'path/to/file.py:Class' or a Hugging Face class,
    'transformers:GPT2LMHeadModel' (its config from --model-config JSON|PATH), optionally
    with literal arguments: 'gpt-tiny(n_blocks=2)'. Run `fxzero COMMAND --help` for a
    command's options.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@main.command()
def version() -> None:
    """Print the fxzero version."""
    from fxzero import __version__

    click.echo(__version__)


main.add_command(compile_command)
main.add_command(graph_command)
main.add_command(schedule_command)
main.add_command(estimate_command)
main.add_command(plan_command)
main.add_command(train_command)
main.add_command(export_command)
main.add_command(run_command)
from fxzero.cli.wall_cmd import wall_command  # noqa: E402  (the Memory Wall page)
main.add_command(wall_command)

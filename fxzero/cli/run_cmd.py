"""`fxzero run [launcher options] SCRIPT [ARGS]`: a DeepSpeed program, unchanged, on fxzero.

    fxzero run --num_gpus 2 train.py --deepspeed_config ds.json      # DeepSpeed: deepspeed --num_gpus 2 ...

Takes DeepSpeed's launcher options and torchrun's, and starts `torchrun` with them: one process
per device, each running SCRIPT with `import deepspeed` (and `from deepspeed.X import ...`)
resolving to fxzero (`fxzero/deepspeed_alias.py`), and, as DeepSpeed's launcher does,
`--local_rank=N` before the script's own arguments (`--no_local_rank` leaves it out).

DeepSpeed's options map onto torchrun's: `--num_gpus N` (or `--num_accelerators`) ->
`--nproc_per_node N` (default: every GPU; on a CPU-only machine, 1), `--num_nodes` -> `--nnodes`,
`--node_rank`, `--master_addr`, `--master_port` (default 29500, as DeepSpeed). Multi-node runs
start `fxzero run` on every node with `--node_rank` (torchrun's rendezvous); DeepSpeed's
ssh-based launching (`--hostfile`, `--include`, `--exclude`, `--launcher`) is refused with
that advice. Any other option before SCRIPT goes to torchrun as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys

import click

__all__ = ["run_command"]

_DEEPSPEED = {"--num_gpus": "--nproc_per_node", "--num_accelerators": "--nproc_per_node",
              "--num_nodes": "--nnodes", "--node_rank": "--node_rank", "--master_addr": "--master_addr",
              "--master_port": "--master_port"}
"""DeepSpeed's launcher options taking a value -> torchrun's."""

_REFUSED = {"--hostfile", "-H", "--include", "-i", "--exclude", "-e", "--launcher", "--launcher_args",
            "--ssh_port", "--force_multi", "--autotuning", "--elastic_training", "--bind_cores_to_rank",
            "--bind_core_list", "--enable_each_rank_log", "--comment", "--save_pid"}
_FLAGS = {"--no_python", "--module", "-m", "--no_local_rank"}
_TORCHRUN_FLAGS = {"--standalone", "--run-path", "--run_path", "--no-python"}
"""torchrun's options that take no value."""

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_deepspeed_shim")
"""The folder holding the `deepspeed` package that makes every process's `import deepspeed` fxzero."""


def _split(argv: list[str]) -> tuple[list[str], set[str], str, list[str]]:
    """(torchrun options, our flags, the script, its arguments)."""
    torchrun: list[str] = []
    flags: set[str] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return torchrun, flags, arg, argv[i + 1:]
        name, eq, value = arg.partition("=")
        if name in _REFUSED:
            raise click.UsageError(
                f"{name}: fxzero run launches the processes of this node through torchrun; for several nodes, "
                "run `fxzero run --num_nodes N --node_rank R --master_addr HOST ...` on each node")
        if name in _FLAGS:
            flags.add("--module" if name == "-m" else name)
            i += 1
            continue
        takes_value = name in _DEEPSPEED or name.startswith("--") and not eq and i + 1 < len(argv) \
            and not argv[i + 1].startswith("-") and name not in _TORCHRUN_FLAGS
        if not eq and takes_value:
            value, i = argv[i + 1], i + 2
        else:
            i += 1
        name = _DEEPSPEED.get(name, name)
        torchrun.append(f"{name}={value}" if (eq or takes_value) else name)
    raise click.UsageError("no script given: fxzero run [options] SCRIPT [ARGS]")


def _default_processes() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def launch_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment `fxzero run ARGV` starts."""
    torchrun, flags, script, args = _split(argv)
    names = {opt.partition("=")[0] for opt in torchrun}
    if "--nproc_per_node" not in names:
        torchrun.append(f"--nproc_per_node={_default_processes()}")
    if "--master_port" not in names and "--standalone" not in names and "--rdzv_endpoint" not in names:
        torchrun.append("--master_port=29500")
    worker = ["-m", "fxzero.cli.run_worker"]
    if "--no_local_rank" in flags:
        worker.append("--no_local_rank")
    if "--module" in flags:
        worker.append("--module")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SHIM] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return [sys.executable, "-m", "torch.distributed.run", *torchrun, *worker, script, *args], env


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                        "help_option_names": ["-h", "--help"]})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def run_command(argv: tuple[str, ...]) -> None:
    """Run a DeepSpeed program unchanged on fxzero: `import deepspeed` is fxzero in its processes.

    Options before SCRIPT are DeepSpeed's launcher options (--num_gpus, --num_nodes, --node_rank,
    --master_addr, --master_port, --no_local_rank, --module) or torchrun's (passed as they are).
    """
    cmd, env = launch_command(list(argv))
    click.echo("fxzero run: `import deepspeed` is fxzero in this program's processes "
               f"(torchrun {' '.join(cmd[3:cmd.index('fxzero.cli.run_worker') - 1])})",
               err=True)
    sys.exit(subprocess.call(cmd, env=env))

"""One process of `fxzero run`: the DeepSpeed alias installed, then the user's script as __main__.

    python -m fxzero.cli.run_worker [--no_local_rank] [--module] SCRIPT [ARGS]

Started by torchrun (`fxzero/cli/run_cmd.py`), which set RANK, LOCAL_RANK and WORLD_SIZE.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    local_rank, module = True, False
    while argv and argv[0] in ("--no_local_rank", "--module"):
        flag = argv.pop(0)
        local_rank = local_rank and flag != "--no_local_rank"
        module = module or flag == "--module"
    script, *args = argv
    from fxzero.deepspeed_alias import install

    install()
    if local_rank:  # (DeepSpeed's launcher passes it first, before the script's own arguments)
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    sys.argv = [script, *args]
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code in (0, None):
            _leave_together()
        raise
    _leave_together()


def _leave_together() -> None:
    """After the script finished on this rank: wait for the others, then close the process
    groups. A rank whose interpreter tears its gloo group down while a peer still holds it open
    can abort ("terminate called without an active exception"), failing a finished run; scripts
    written for DeepSpeed rarely destroy their group themselves. A failure here (a peer gone)
    leaves the script's own result as it is."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the script has finished; its exit status stands
        pass


if __name__ == "__main__":
    main(sys.argv[1:])

"""`fxzero export CKPT_DIR OUT`: a checkpoint's model as one safetensors file, offline."""

from __future__ import annotations

import json
from typing import Optional

import click

from fxzero.cli.common import CLIError, reports_errors
from fxzero.viz.fmt import human_bytes

__all__ = ["export_command"]


@click.command("export")
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--tag", default=None, help="The checkpoint in CKPT_DIR to export (default: the one `latest` names).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Cast floating tensors to this dtype (default: as saved, the fp32 masters).")
def export_command(ckpt_dir: str, out: str, tag: Optional[str], dtype: Optional[str]) -> None:
    """Write the model of checkpoint CKPT_DIR to OUT/model.safetensors.

    CKPT_DIR is a checkpoint directory (it holds fxzero.json) or the save_dir given to
    engine.save_checkpoint (its `latest`, or --tag, names the checkpoint). The file holds the
    model's state dict under its own names (a tied parameter once), read and written one tensor
    at a time, so the export needs about one tensor's memory. A Hugging Face model also gets
    OUT/config.json: `transformers.<Class>.from_pretrained(OUT)` loads it. No ranks are launched.
    Prints one line per file written, then a JSON summary.
    """
    from fxzero.runtime.checkpoint import CheckpointError
    from fxzero.runtime.checkpoint.export import DTYPES, export_checkpoint

    with reports_errors(f"exporting {ckpt_dir}"):
        try:
            report = export_checkpoint(ckpt_dir, out, tag=tag, dtype=DTYPES[dtype] if dtype else None)
        except CheckpointError as e:
            raise CLIError(f"cannot export: {e}") from e
    for path, nbytes in report["files"].items():
        click.echo(f"wrote {path} ({human_bytes(nbytes)})")
    click.echo(json.dumps(report))

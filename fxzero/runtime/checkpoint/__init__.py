"""Checkpoints: every rank's shards saved in torch.distributed.checkpoint's format, committed by
renames, and re-sliced on load for any world size or stage ([Note: the checkpoint format] in
`format.py`, [Note: a checkpoint is committed by renames] in `files.py`); exported for inference as
one safetensors file (`export.py`)."""

from fxzero.runtime.checkpoint.export import consolidated_16bit_state_dict, export_checkpoint, save_16bit_model
from fxzero.runtime.checkpoint.files import CheckpointError
from fxzero.runtime.checkpoint.load import load_checkpoint, resolve_checkpoint
from fxzero.runtime.checkpoint.reader import CheckpointReader
from fxzero.runtime.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "consolidated_16bit_state_dict", "export_checkpoint", "load_checkpoint",
           "resolve_checkpoint", "save_16bit_model", "save_checkpoint"]

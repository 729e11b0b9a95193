"""PyTorch FSDP2: `fully_shard` on every transformer block, then on the root (embeddings, final
norm and head), as torchtitan and the FSDP2 docs wrap a decoder. Its all-gathers and
reduce-scatters go through the wrapped torch.distributed functions, so they are counted there.

Options: {"mixed_precision": "bf16"} passes `mp_policy=MixedPrecisionPolicy(param_dtype=
torch.bfloat16, reduce_dtype=torch.float32)` to every fully_shard call (fp32 sharded parameters
and AdamW; bf16 all-gathers and compute; fp32 reduce-scatters); every other option is passed to
fully_shard as is, except {"checkpoint": True}: each block's forward goes through
`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` (torch's recommended
variant), wrapped before `fully_shard`, as torchtitan applies activation checkpointing to a
block before sharding it: the block's input is kept, the rest recomputed in the backward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils.checkpoint
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tools.bench.commcount import CommCounter
from tools.bench.common import EagerTrainer, build_model, checkpoint_blocks, checkpoint_report, dtype_option, make_optimizer
from tools.bench.spec import RunSpec


class FSDP2Trainer(EagerTrainer):
    def __init__(self, spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> None:
        options = dict(options)
        param_dtype = dtype_option("fsdp2", "mixed_precision", options.pop("mixed_precision", None))
        if param_dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        self.mp_policy = options.get("mp_policy")
        self.checkpoint = options.pop("checkpoint", False)
        if not isinstance(self.checkpoint, bool):
            raise ValueError(f"fsdp2 runner: checkpoint must be True or False, got {self.checkpoint!r}")
        model = build_model(spec)
        if self.checkpoint:
            checkpoint_blocks(model, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        self.model = model
        self.optimizer = make_optimizer(spec, model.parameters())

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mp_policy": str(self.mp_policy)} if self.mp_policy is not None else {}
        if self.checkpoint:
            out["activation_checkpointing"] = "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) per block"
            out.update(checkpoint_report(self.model))
        return out


def setup(spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> FSDP2Trainer:
    return FSDP2Trainer(spec, counter, options)

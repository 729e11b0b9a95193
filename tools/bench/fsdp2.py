"""PyTorch FSDP2: `fully_shard` on every transformer block, then on the root (embeddings, final
norm and head), as torchtitan and the FSDP2 docs wrap a decoder. Its all-gathers and
reduce-scatters go through the wrapped torch.distributed functions, so they are counted there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tools.bench.commcount import CommCounter
from tools.bench.common import EagerTrainer, build_model, make_optimizer
from tools.bench.spec import RunSpec


class FSDP2Trainer(EagerTrainer):
    def __init__(self, spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> None:
        model = build_model(spec)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        self.model = model
        self.optimizer = make_optimizer(spec, model.parameters())


def setup(spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> FSDP2Trainer:
    return FSDP2Trainer(spec, counter, options)

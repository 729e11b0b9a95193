"""PyTorch DDP: every rank holds the whole model and optimizer; gradients are all-reduced.

DDP's Reducer all-reduces gradient buckets from C++, out of sight of the wrapped Python
collectives, so a comm hook counts each bucket and then runs torch's default
`allreduce_hook` (divide by the world size, all-reduce): the same work DDP does without a hook.

Options: {"autocast": "bf16"} runs the forward and the loss under `torch.autocast("cpu",
dtype=torch.bfloat16)` (parameters, gradients, their all-reduce and AdamW stay fp32); every
other option is passed to DistributedDataParallel as is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tools.bench.commcount import CommCounter
from tools.bench.common import EagerTrainer, build_model, dtype_option, make_optimizer
from tools.bench.spec import RunSpec

COUNTED_BY = "DDP comm hook around torch's default allreduce_hook: one all_reduce per bucket"


class DDPTrainer(EagerTrainer):
    def __init__(self, spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> None:
        options = dict(options)
        self.autocast = dtype_option("ddp", "autocast", options.pop("autocast", None))
        model = build_model(spec)
        self.model = DistributedDataParallel(model, **options)
        self.model.register_comm_hook(counter, _counting_allreduce_hook)
        self.optimizer = make_optimizer(spec, self.model.parameters())

    def report(self) -> dict[str, Any]:
        out = {"comm_counted_by": COUNTED_BY}
        if self.autocast is not None:
            out["autocast"] = str(self.autocast)
        return out


# Unannotated on purpose: DDP compares the annotations with dist.GradBucket and
# Future[Tensor], and under `from __future__ import annotations` they are strings.
def _counting_allreduce_hook(counter, bucket):
    with counter.counted("all_reduce", bucket.buffer()):
        return default_hooks.allreduce_hook(None, bucket)


def setup(spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> DDPTrainer:
    return DDPTrainer(spec, counter, options)

"""The no-communication floor: each rank trains its own copy of the model on its own micro-batch.

What a step costs when nothing is communicated: every rank builds the whole model, as DDP does,
and runs the forward, loss, backward and a torch AdamW step on its micro-batch, with no process
group collective in the step (no gradient all-reduce: the ranks' models drift apart after the
first update, so only the first step's loss compares with a data-parallel system's). All ranks
run at the same time, one thread each, so a step's time is the compute of one rank's step while
the other ranks compute too (they share the machine's memory bandwidth and caches, as the ranks
of every other system do).

To start each step together, the worker calls `align()` (a barrier) before each step, outside
the step's time and with the collective counters off: without it a rank that ran ahead would
compute part of its steps alone, and its peers' steps would look faster than they are.

Options: {"autocast": "bf16"} runs the forward and the loss under `torch.autocast("cpu",
dtype=torch.bfloat16)`, as the "ddp-bf16" system does (fp32 parameters and AdamW).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tools.bench.commcount import CommCounter
from tools.bench.common import EagerTrainer, build_model, dtype_option, make_optimizer
from tools.bench.spec import RunSpec

COUNTED_BY = "nothing to count: no collective in a step (a barrier before each step, outside its time, aligns the ranks)"


class FloorTrainer(EagerTrainer):
    def __init__(self, spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> None:
        options = dict(options)
        self.autocast = dtype_option("floor", "autocast", options.pop("autocast", None))
        if options:
            raise ValueError(f"floor runner: unknown options {sorted(options)}")
        self.model = build_model(spec)
        self.optimizer = make_optimizer(spec, self.model.parameters())

    def align(self) -> None:
        """Called by the worker before each step, untimed and uncounted: start it together."""
        dist.barrier()

    def report(self) -> dict[str, Any]:
        out = {"comm_counted_by": COUNTED_BY}
        if self.autocast is not None:
            out["autocast"] = str(self.autocast)
        return out


def setup(spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> FloorTrainer:
    return FloorTrainer(spec, counter, options)

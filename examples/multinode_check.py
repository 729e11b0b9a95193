"""Train gpt-tiny for a few steps under torchrun and record the losses and who ran where.

One node of three ranks, or two "nodes" of one and two ranks (here both on this host); it
needs a world of two ranks or more (a process group):

    torchrun --standalone --nproc_per_node=3 examples/multinode_check.py out.json

    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=1 --rdzv_backend=c10d \
        --rdzv_endpoint=127.0.0.1:29500 --rdzv_id=demo examples/multinode_check.py out.json &
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 --rdzv_backend=c10d \
        --rdzv_endpoint=127.0.0.1:29500 --rdzv_id=demo examples/multinode_check.py out.json

The batches depend only on the step and the global rank, so any layout of the same world size
trains on the same data and should report the same losses. Global rank 0 writes the JSON to
argv[1] (or $MULTINODE_CHECK_OUT): {"losses": [...], "ranks": [{RANK, LOCAL_RANK, ...}, ...]}.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxzero
from fxzero import zoo

STEPS, MICRO_BATCH = 4, 2
OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MULTINODE_CHECK_OUT", "multinode_check.json")

fxzero.init_distributed()
torch.manual_seed(0)
model = zoo.build("gpt-tiny")
vocab, seq = model.config.vocab_size, model.config.seq_len
engine, *_ = fxzero.initialize(model=model, config={
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3},
})
rank, world = engine.global_rank, engine.world_size

losses = []
for step in range(STEPS):
    # One global batch per step, the same on every rank; each rank trains on its own rows.
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (MICRO_BATCH * world, seq + 1), generator=g)
    mine = tokens[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
    inputs, targets = mine[:, :-1], mine[:, 1:]
    logits = engine(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / world)

me = {
    "RANK": int(os.environ["RANK"]),
    "LOCAL_RANK": int(os.environ["LOCAL_RANK"]),
    "GROUP_RANK": int(os.environ["GROUP_RANK"]),
    "local_rank": engine.local_rank,
    "global_rank": engine.global_rank,
    "world_size": engine.world_size,
    "comm": type(engine.comm).__name__,  # ShmComm: shared memory; Comm: the process group
}
ranks = [None] * world
dist.all_gather_object(ranks, me)
if rank == 0:
    with open(OUT, "w") as f:
        json.dump({"losses": losses, "ranks": ranks}, f, indent=1)
    print(f"losses {losses}; wrote {OUT}")
dist.destroy_process_group()

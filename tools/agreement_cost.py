"""What the per-forward collective agreement costs: one 8-byte all-gather, timed; prints JSON.

    .venv/bin/torchrun --standalone --nproc_per_node=2 tools/agreement_cost.py [--calls 2000]

Times `Engine._agree`'s collective (an int64 per rank, all-gathered) through each transport
fxzero can use here (shared memory, the gloo process group), against a step of the demo's
gpt-tiny at stage 3 for scale. Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import fxzero
from fxzero import zoo
from fxzero.runtime.comm import make_comm


def _time_all_gather(comm, calls: int) -> float:
    mine = torch.tensor([comm.rank], dtype=torch.int64)
    out = torch.empty(comm.world_size, dtype=torch.int64)
    for _ in range(50):  # warm up
        comm.all_gather(out, mine, count=False).wait()
    start = time.perf_counter()
    for _ in range(calls):
        comm.all_gather(out, mine, count=False).wait()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {"world": dist.get_world_size(), "calls": args.calls, "all_gather_8B_s": {}}
    for transport in ("shared_memory", "process_group"):
        out["all_gather_8B_s"][transport] = _time_all_gather(make_comm(transport=transport, timeout_s=60), args.calls)
    engine = fxzero.compile(zoo.build("gpt-tiny"), fxzero.Config(cost_model=None))
    x = torch.randint(0, 96, (8, 16))
    times = []
    for _ in range(12):
        start = time.perf_counter()
        engine.backward(engine(x).float().logsumexp(-1).mean())
        engine.step()
        times.append(time.perf_counter() - start)
    out["gpt_tiny_step_s"] = sorted(times[2:])[len(times[2:]) // 2]
    out["agreement_share_of_step"] = out["all_gather_8B_s"][type(engine.comm).__name__ == "ShmComm" and
                                                           "shared_memory" or "process_group"] / out["gpt_tiny_step_s"]
    if dist.get_rank() == 0:
        print(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a small GPT with fxzero on CPU ranks and print the loss per step.

Launch with torchrun, one process per rank:

    torchrun --standalone --nproc_per_node=2 tools/demo.py --size tiny --steps 20

(`bash scripts/demo.sh` sets up the environment and runs exactly that.) Without torchrun it
runs as a world of one.

The model is built on the meta device, so no rank ever holds all of its parameters: `compile`
materializes each rank's shard from the model's own init (GPT-2's: N(0, 0.02), residual
projections scaled down), so the first loss is near a uniform guess's. The task is
synthetic and learnable: every target token is a fixed permutation of its input token,
`y[t] = perm[x[t]]`, so the loss can fall towards zero; a uniform guess scores ln(vocab_size).
Each rank draws its own batch every step, as data-parallel ranks do.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import fxzero
from fxzero.zoo import gpt

MIB = 2**20

# The permutation behind the task, the same on every rank; batches use other seeds.
TASK_SEED = 1234


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", help="GPT size from fxzero.zoo (default: tiny)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank (default: 8)")
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3), help="ZeRO stage (default: 3)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 1e-2)")
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch must be at least 1")
    return args


def init_distributed() -> None:
    """Join the gloo group torchrun describes, or form a world of one without torchrun."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port for the single-rank rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def make_batch(
    perm: torch.Tensor, step: int, batch: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch for `step`: random tokens and their images under `perm`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(TASK_SEED + 1 + step * world + rank)
    x = torch.randint(perm.numel(), (batch, seq_len), generator=gen)
    return x, perm[x]


def mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.2f}"


def fp32_model_states(phi: int, world: int, stage: int) -> float:
    """Bytes of parameters, gradients and Adam states per rank in fp32 (4 + 4 + 8 per parameter)."""
    return {
        1: 8 * phi + 8 * phi / world,
        2: 4 * phi + 12 * phi / world,
        3: 16 * phi / world,
    }[stage]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core per rank: ranks share the machine's cores
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = gpt(args.size)
        vocab_size, seq_len = model.config.vocab_size, model.config.seq_len

        t0 = time.perf_counter()
        config = fxzero.Config(
            stage=args.stage,
            optimizer=fxzero.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
        )
        engine = fxzero.compile(model, config=config)
        compile_s = time.perf_counter() - t0
        phi = engine.num_params

        perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(TASK_SEED))
        if rank == 0:
            print(
                f"gpt({args.size!r}): {phi:,} parameters, vocab {vocab_size}, seq_len {seq_len}; "
                f"ZeRO-{args.stage} on {world} rank{'s' if world > 1 else ''}, micro-batch {args.batch}; "
                f"compiled in {compile_s:.2f} s; a uniform guess scores {math.log(vocab_size):.3f}",
                flush=True,
            )

        comm_last: dict = {}
        # A bar on rank 0's terminal (none in a log or a pipe); the per-step lines print either way.
        bar = tqdm(total=args.steps, desc="training", unit="step", disable=None if rank == 0 else True,
                   dynamic_ncols=True)
        for step in range(1, args.steps + 1):
            x, y = make_batch(perm, step, args.batch, seq_len)
            t0 = time.perf_counter()
            logits = engine(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            engine.backward(loss)
            mem = engine.memory_report()  # gradients held, optimizer states from earlier steps
            engine.step()
            step_s = time.perf_counter() - t0
            comm_last = engine.comm_report(reset=True)

            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            if rank == 0:
                note = "  (includes tracing)" if step == 1 else ""
                tqdm.write(f"step {step:3d}/{args.steps}  loss {mean_loss.item():.4f}  {step_s * 1e3:7.1f} ms{note}")
                bar.set_postfix_str(f"loss {mean_loss.item():.4f}", refresh=False)
                bar.update(1)
        bar.close()

        if rank == 0:
            keys = ("param_shards", "grad_shards", "optimizer_states", "model_states", "gathered_peak")
            reference = fp32_model_states(phi, world, args.stage)
            print(
                "memory on rank 0 after the last backward (MiB): "
                + "  ".join(f"{key} {mib(mem[key])}" for key in keys)
                + f"  (fp32 model states for ZeRO-{args.stage}: {mib(reference)})",
                flush=True,
            )
            gathered = comm_last["all_gather"]["elements"]
            reduced = comm_last["reduce_scatter"]["elements"]
            expected = 3 if args.stage == 3 else 2
            kept = engine.schedule.kept_for_backward
            why = (f"; {', '.join(kept)} stayed gathered from the forward into the backward "
                   "(Prefetch.keep_for_backward), so they were gathered once" if kept else "")
            print(
                f"comm in the last step on rank 0: all_gather {gathered:,} + reduce_scatter {reduced:,} "
                f"= {gathered + reduced:,} elements = {(gathered + reduced) / phi:.3f} Phi "
                f"(ZeRO-{args.stage} moves {expected} Phi; Phi = {phi:,}, padding adds a little{why})",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

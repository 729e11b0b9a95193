"""Model-state bytes per rank under DeepSpeedExamples' training/bf16_master_weight configs.

    torchrun --standalone --nproc_per_node=2 tools/low_precision_memory.py   # 2 CPU ranks
    .venv/bin/python tools/low_precision_memory.py                            # a world of one

The example compares `configs/baseline.json` (bf16, fp32 masters and Adam states) with
`configs/bf16_full.json` (bf16_master_weights_and_grads, bf16_optimizer_states, torch_autocast),
both ZeRO-3, by the GPU memory each holds. This tool reads the same two files (as stored in
tests/data/deepspeedexamples_configs/, or --configs) with `fxzero.initialize`, trains a zoo GPT a
few steps on each, and reports, per config and rank, what the engine's `memory_report()` counts
after a backward (gradients held, optimizer states made): parameters, gradients, optimizer states,
their sum, and bytes per parameter (this rank's model states / the model's parameter count, so
ZeRO-3 on N ranks shows about (2 + 2 + 12) / N and (2 + 2 + 4) / N); and
`fxzero.estimate.runtime_model_states` for the same layouts, which must agree. One JSON line per
config and rank on stdout; the last line compares the two on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxzero
from fxzero import estimate
from fxzero.zoo import gpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "deepspeedexamples_configs"
DEFAULT = [CONFIGS / f"training__bf16_master_weight__configs__{name}.json" for name in ("baseline", "bf16_full")]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", help="zoo GPT size (default: small, ~25M parameters)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps before measuring (default: 2)")
    parser.add_argument("--configs", nargs="+", type=pathlib.Path, default=DEFAULT,
                        help="DeepSpeed config files (default: the example's baseline and bf16_full)")
    return parser.parse_args()


def measure(path: pathlib.Path, size: str, steps: int) -> dict:
    """Train on `path`'s config; what this rank holds after the next backward."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt(size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the configs' bucket sizes and overlap_comm: no effect, said elsewhere)
        engine, *_ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=str(path))
    rank, world = engine.global_rank, engine.world_size
    gen = torch.Generator().manual_seed(1 + rank)
    cfg = model.config
    batch = engine.train_micro_batch_size_per_gpu()

    def backward() -> None:
        x = torch.randint(cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
        loss = F.cross_entropy(engine(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
        engine.backward(loss)

    for _ in range(steps):
        backward()
        engine.step()
    backward()
    report = engine.memory_report()
    mp = engine.config.mixed_precision
    want = estimate.runtime_model_states(engine.layouts, engine.config.stage, "mixed" if mp else "fp32",
                                         persistent=engine.state.whole, mixed_precision=mp)
    phi = engine.num_params
    engine.destroy()
    return {
        "config": path.name, "rank": rank, "world": world, "stage": engine.config.stage, "parameters": phi,
        "dtypes": {"compute": str(mp.param_dtype)[6:], "grads": str(mp.grad_dtype)[6:],
                   "masters": str(mp.master_dtype)[6:], "optimizer_states": str(mp.optimizer_dtype)[6:]}
        if mp else "fp32",
        "autocast": str(engine.config.autocast.dtype)[6:] if engine.config.autocast else None,
        "param_bytes": report["param_shards"], "grad_bytes": report["grad_shards"],
        "optimizer_bytes": report["optimizer_states"], "model_states": report["model_states"],
        "bytes_per_parameter": round(report["model_states"] / phi, 3),
        "estimate": want.total,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core per rank: ranks share the machine's cores
    rows = [measure(path, args.size, args.steps) for path in args.configs]
    for row in rows:
        print(json.dumps(row), flush=True)
    if rows[0]["rank"] == 0 and len(rows) == 2:
        a, b = rows
        print(json.dumps({"summary": f"{a['config']} -> {b['config']}", "model_states": [a["model_states"],
                          b["model_states"]], "ratio": round(b["model_states"] / a["model_states"], 4),
                          "bytes_per_parameter": [a["bytes_per_parameter"], b["bytes_per_parameter"]]}), flush=True)
    if dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.barrier()


if __name__ == "__main__":
    main()

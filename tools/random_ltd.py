"""Random-LTD's cost and gain on one CPU rank: a GPT-2 (Hugging Face, small config) trained with
every token through every layer, and with random-LTD routing all but the first and last layer
on a fixed number of kept tokens, then on a schedule.

- `plain`: no random-LTD (the config without "data_efficiency");
- `fixed`: random-LTD with min_value = max_value = --kept: every step the same count;
- `schedule`: fixed_linear from --kept to the sequence length over the steps: the kept count
  changes every few steps, one program serves them all ([Note: where random-LTD draws its
  tokens] in `fxzero/runtime/random_ltd/layer.py`).

One JSON line per configuration: the median step time after the warm-up (the first step traces),
the first step's time (the trace), the programs compiled, the kept counts seen, and a summary of
the median steps' ratio to `plain`. Wall times move with other work on a shared box; the ratio
is the figure to read.

    .venv/bin/python tools/random_ltd.py --steps 12 --seq 256 --kept 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

import torch  # noqa: E402

import fxzero  # noqa: E402
from fxzero.runtime.random_ltd.helper import convert_to_random_ltd  # noqa: E402


def _model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=1024,
                                     n_positions=args.seq, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def _config(args, kind: str) -> dict:
    config = {"train_batch_size": args.rows, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3}}
    if kind == "plain":
        return config
    routed = list(range(1, args.layers - 1))
    top = args.kept if kind == "fixed" else args.seq
    config["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": args.layers, "random_ltd_layer_num": len(routed),
        "random_ltd_layer_id": routed, "model_mask_name": "attention_mask", "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": args.kept, "max_value": top, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": args.steps, "seq_per_step": 8}}}}}
    return config


def run(args, kind: str) -> dict:
    import transformers

    model = _model(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=_config(args, kind))
    if kind != "plain":
        engine = convert_to_random_ltd(engine, transformers.models.gpt2.modeling_gpt2.GPT2Block)
    g = torch.Generator().manual_seed(1)
    times, kept = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, 1024, (args.rows, args.seq), generator=g)
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        kept.append(engine.random_ltd_scheduler.get_current_seq() if kind != "plain" else args.seq)
    return {"config": kind, "median_step_s": round(statistics.median(times[2:]), 4), "first_step_s": round(times[0], 3),
            "programs": len(engine._cache), "kept": sorted(set(kept))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--kept", type=int, default=64)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [run(args, kind) for kind in ("plain", "fixed", "schedule")]
    for r in results:
        print(json.dumps(r))
    plain = results[0]["median_step_s"]
    print(json.dumps({"summary": {r["config"]: round(r["median_step_s"] / plain, 3) for r in results[1:]},
                      "routed_layers": args.layers - 2, "layers": args.layers, "seq": args.seq, "kept": args.kept}))


if __name__ == "__main__":
    main()

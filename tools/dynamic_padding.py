"""Dynamic padding against fixed padding: a HelloDeepSpeed-shaped Roberta MLM on 2 CPU ranks.

HelloDeepSpeed (DeepSpeedExamples' `training/HelloDeepSpeed/train_bert_ds.py`) trains an HF
`RobertaModel` with a masked-LM head that predicts only the masked positions: `nonzero` of the
labels that are not padding, `index_select` of the features and of the labels, then
CrossEntropyLoss. Its collate function pads each batch to its longest row, so every step has
another length. This tool trains that model (written here, `RobertaMLM`, after the script) at
ZeRO-3 on the same rows in interleaved rounds (one step of each configuration per round,
each configuration first in turn):

- `fixed`: every batch padded to --max-len (one length: one static program);
- `dynamic`: every batch padded to its longest row (the script's collate function): the first
  length compiles a static program, the second one program symbolic in the length, which serves
  every later length ([Note: any size, one program] in `fxzero/ir/shapes.py`);
- `fixed_symbolic`: the fixed-padding batches through a program symbolic in the length (the dim
  marked with torch._dynamo.mark_dynamic): against `fixed`, what running a symbolic program
  costs at equal sizes (its size computations), apart from the shorter batches' gain.

It prints one JSON line per configuration (median step over the steps after the warm-up, the
compiles and their seconds, the losses) and a summary with the issue's bar: the median step with
dynamic padding within 1.1x of fixed padding. A step's time is the slowest rank's. On a shared
box the wall times move with other work, so the summary also gives the median of each round's
ratio (its steps ran back to back) and the CPU seconds a step took (the busiest rank's), which
other processes disturb far less.

    .venv/bin/python tools/dynamic_padding.py --steps 14
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import fxzero

PAD = 1
"""Roberta's pad token id: padding in the inputs and, in the labels, every position not predicted."""
MASK = 4


def roberta_config(*, layers: int = 6, heads: int = 8, ff: int = 512, hidden: int = 256, vocab: int = 50265,
                   max_len: int = 512, dropout: float = 0.0):
    """HelloDeepSpeed's `create_model` config (its defaults), dropout 0 so runs compare exactly."""
    import transformers

    return transformers.RobertaConfig(
        attention_probs_dropout_prob=dropout, hidden_dropout_prob=dropout, bos_token_id=0, eos_token_id=2,
        hidden_act="gelu", hidden_size=hidden, initializer_range=0.02, intermediate_size=ff, layer_norm_eps=1e-5,
        max_position_embeddings=max_len + 2, num_attention_heads=heads, num_hidden_layers=layers, pad_token_id=PAD,
        type_vocab_size=1, vocab_size=vocab)


class RobertaMLM(nn.Module):
    """An HF RobertaModel and a masked-LM head over the masked positions only, as HelloDeepSpeed's
    `RobertaMLMModel`: the head's decoder is tied to the word embeddings."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import RobertaModel
        from transformers.models.roberta.modeling_roberta import RobertaLMHead

        self.config = config
        self.encoder = RobertaModel(config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)
        self.lm_head.decoder.weight = self.encoder.embeddings.word_embeddings.weight

    def forward(self, src_tokens: torch.Tensor, attention_mask: torch.Tensor, tgt_tokens: torch.Tensor) -> torch.Tensor:
        features, *_ = self.encoder(input_ids=src_tokens, attention_mask=attention_mask, return_dict=False)
        # The positions to predict: labels that are not padding (a data-dependent count).
        masked = torch.nonzero((tgt_tokens != self.config.pad_token_id).view(-1)).view(-1)
        selected = torch.index_select(features.view(-1, features.shape[-1]), 0, masked)
        scores = self.lm_head(selected)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked)
        return nn.CrossEntropyLoss(ignore_index=-1)(scores.view(-1, self.config.vocab_size), target)


def make_rows(n: int, *, min_len: int, max_len: int, vocab: int, mask_prob: float, seed: int) -> list[tuple]:
    """`n` rows of random length in [min_len, max_len]: (masked tokens, labels), labels PAD where
    a position is not predicted (HelloDeepSpeed's `masking_function`, at least one per row)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (), generator=g))
        ids = torch.randint(5, vocab, (length,), generator=g)
        chosen = torch.rand(length, generator=g) < mask_prob
        chosen[int(torch.randint(0, length, (), generator=g))] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, PAD))
        rows.append((torch.where(chosen, torch.full_like(ids, MASK), ids), labels))
    return rows


def collate(rows: list[tuple], pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """HelloDeepSpeed's `collate_function`: padded to the longest row (or to `pad_to`)."""
    length = pad_to or max(len(ids) for ids, _ in rows)
    src = torch.full((len(rows), length), PAD)
    tgt = torch.full((len(rows), length), PAD)
    for i, (ids, labels) in enumerate(rows):
        src[i, : len(ids)], tgt[i, : len(labels)] = ids, labels
    return {"src_tokens": src, "attention_mask": src.ne(PAD).long(), "tgt_tokens": tgt}


MODES = ("fixed", "dynamic", "fixed_symbolic")


def _marked(t: torch.Tensor, dim: int) -> torch.Tensor:
    t = t.detach()
    torch._dynamo.mark_dynamic(t, dim)
    return t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, args, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    cfg = roberta_config(layers=args.layers, heads=args.heads, ff=args.ff, hidden=args.hidden, vocab=args.vocab,
                         max_len=args.max_len)
    torch.manual_seed(0)
    state = RobertaMLM(cfg).state_dict()
    modes = MODES
    engines, compiles = {}, {}
    for mode in modes:
        model = RobertaMLM(cfg)
        model.load_state_dict(state)
        engines[mode] = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-4)))
        compiles[mode] = []
        compile_program = engines[mode]._compile

        def counted(*a, _compile=compile_program, _log=compiles[mode]):
            start = time.perf_counter()
            out = _compile(*a)
            _log.append(time.perf_counter() - start)
            return out

        engines[mode]._compile = counted
    rows = make_rows(args.steps * args.batch * args.ranks, min_len=args.min_len, max_len=args.max_len,
                     vocab=args.vocab, mask_prob=0.15, seed=1)
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    losses = {m: [] for m in modes}
    lengths = []
    for step in range(args.steps):
        mine = rows[(step * args.ranks + rank) * args.batch: (step * args.ranks + rank + 1) * args.batch]
        batches = {"fixed": collate(mine, args.max_len), "dynamic": collate(mine)}
        batches["fixed_symbolic"] = {k: _marked(v, 1) for k, v in batches["fixed"].items()}
        lengths.append(batches["dynamic"]["src_tokens"].shape[1])
        for mode in modes[step % len(modes):] + modes[: step % len(modes)]:  # interleaved, each first in turn
            engine = engines[mode]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = engine(**batches[mode])
            engine.backward(loss)
            engine.step()
            took = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu, loss.item()],
                                dtype=torch.float64)
            dist.all_reduce(took[:2], op=dist.ReduceOp.MAX)
            dist.all_reduce(took[2:])
            times[mode].append(float(took[0]))
            cpu[mode].append(float(took[1]))
            losses[mode].append(float(took[2]) / args.ranks)
    if rank == 0:
        result = {"times": times, "cpu": cpu, "losses": losses, "compiles": compiles, "lengths": lengths,
                  "shapes": {m: engines[m].program.shapes.describe() for m in modes}}
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median (compiles happen there)")
    p.add_argument("--batch", type=int, default=8, help="rows per rank per step (HelloDeepSpeed's batch_size)")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ff", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50265)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(args, _free_port(), out_dir), nprocs=args.ranks, join=True)
        with open(os.path.join(out_dir, "result.json")) as f:
            result = json.load(f)
    medians, cpu = {}, {}
    for mode in MODES:
        medians[mode] = statistics.median(result["times"][mode][args.warmup:])
        cpu[mode] = statistics.median(result["cpu"][mode][args.warmup:])
        print(json.dumps({
            "config": mode, "median_step_s": round(medians[mode], 4), "median_step_cpu_s": round(cpu[mode], 4),
            "fastest_step_s": round(min(result["times"][mode][args.warmup:]), 4),
            "step_times_s": [round(t, 4) for t in result["times"][mode]],
            "compiles": len(result["compiles"][mode]), "compile_s": [round(t, 2) for t in result["compiles"][mode]],
            "program_shapes": result["shapes"][mode], "losses": [round(x, 6) for x in result["losses"][mode]],
            "padded_lengths": result["lengths"] if mode == "dynamic" else [args.max_len] * args.steps}))
    ratio = medians["dynamic"] / medians["fixed"]
    mean_length = statistics.mean(result["lengths"])

    def paired(mode: str) -> float:
        """The median over rounds of mode's step over fixed's in the same round."""
        return statistics.median(a / b for a, b in zip(result["times"][mode][args.warmup:],
                                                      result["times"]["fixed"][args.warmup:]))

    summary = {"summary": "dynamic_padding", "ranks": args.ranks, "stage": 3, "rows_per_rank": args.batch,
               "lengths": [args.min_len, args.max_len], "median_step_s": {k: round(v, 4) for k, v in medians.items()},
               "dynamic_over_fixed": round(ratio, 3), "bar": 1.1, "within_bar": ratio <= 1.1,
               "dynamic_over_fixed_per_round": round(paired("dynamic"), 3),
               "dynamic_over_fixed_cpu": round(cpu["dynamic"] / cpu["fixed"], 3),
               "mean_dynamic_length_over_fixed": round(mean_length / args.max_len, 3),
               "symbolic_over_static_at_equal_length": round(medians["fixed_symbolic"] / medians["fixed"], 3),
               "symbolic_over_static_at_equal_length_per_round": round(paired("fixed_symbolic"), 3),
               "symbolic_over_static_at_equal_length_cpu": round(cpu["fixed_symbolic"] / cpu["fixed"], 3),
               # (the same rows and masked positions, only the padding differs: equal up to rounding)
               "losses_agree_1e-4": all(abs(a - b) <= 1e-4 * abs(b) for m in MODES for a, b in
                                        zip(result["losses"][m], result["losses"]["fixed"]))}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

"""Train a Hugging Face causal LM from its config on several ranks, called the HF way.

    .venv/bin/torchrun --nproc_per_node=2 examples/hf_causal_lm.py [--steps 40] [--model llama|gpt2]

The model is built from a small config (random init, nothing downloaded) and called as a
Hugging Face training loop calls it: `model(input_ids=..., attention_mask=..., labels=...)`, the
loss computed inside the forward, `engine.backward(out.loss)`. The data are sequences of
different lengths, right-padded, with the labels -100 at the padding; each sequence follows a
rule (every token is the previous one plus a per-sequence step, modulo the vocabulary), so the
loss can fall. Each rank prints nothing but rank 0, which prints the loss and the tokens per
second (real tokens, padding excluded, over all ranks) every few steps.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import fxzero

VOCAB, SEQ, MICRO_BATCH = 128, 64, 8


def build(name: str) -> torch.nn.Module:
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


class Sequences(torch.utils.data.Dataset):
    """Arithmetic sequences of 16 to SEQ tokens, padded to SEQ: (input_ids, attention_mask, labels)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.start = torch.randint(0, VOCAB, (n,), generator=g)
        self.step = torch.randint(1, 8, (n,), generator=g)
        self.length = torch.randint(16, SEQ + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (self.start[i] + self.step[i] * torch.arange(SEQ)) % VOCAB
        mask = (torch.arange(SEQ) < self.length[i]).long()
        return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    fxzero.init_distributed()
    torch.manual_seed(0)
    model = build(args.model)
    model.config.use_cache = False  # (a KV cache is no use to a training step)
    config = fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=args.lr, weight_decay=0.0),
                           train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_clipping=1.0,
                           lr_schedule=fxzero.WarmupLR(warmup_num_steps=10, warmup_type="linear"))
    engine, _, loader, _ = fxzero.initialize(model=model, config=config,
                                             training_data=Sequences(args.steps * MICRO_BATCH * 8))
    rank = engine.global_rank
    step, since, tokens = 0, time.perf_counter(), 0
    while step < args.steps:
        for batch in loader:
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            step += 1
            real = batch["attention_mask"].sum()
            if engine.world_size > 1:
                dist.all_reduce(real)
            tokens += int(real)
            if step % 5 == 0 and rank == 0:
                now = time.perf_counter()
                print(f"step {step:3d}  loss {out.loss.item():.4f}  {tokens / (now - since):8.0f} tokens/s", flush=True)
                since, tokens = now, 0
            if step == args.steps:
                break
    engine.close()


if __name__ == "__main__":
    main()

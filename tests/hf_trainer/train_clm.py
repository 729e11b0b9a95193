"""A causal language model trained by Hugging Face's Trainer with a DeepSpeed config, written the
way Trainer's users write it (`HfArgumentParser` over `TrainingArguments`, `--deepspeed ds.json`),
run by `deepspeed` or, unchanged, by `fxzero run` (tools/hf_trainer.py, tests/dist/test_hf_trainer.py).

The model is a small Llama: built from its config, or loaded with `from_pretrained` after the
TrainingArguments, so that at ZeRO-3 Trainer's DeepSpeed integration builds it inside
`deepspeed.zero.Init` as it does for a large checkpoint. The data are random token sequences,
the same on every run. Rank 0 prints Trainer's log (loss, grad_norm, learning_rate per step) and
its train_runtime as one JSON line after "TRAINER_LOG ".

On a machine without an accelerator, accelerate starts DeepSpeed's process group with no backend
(a world of one per process), under DeepSpeed as under fxzero; the script then starts it on gloo,
as DeepSpeed's CPU accelerator does, and has TrainingArguments use that state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional

import torch
from transformers import (AutoModelForCausalLM, HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainingArguments)


@dataclasses.dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = None
    """A saved model to fine-tune (`from_pretrained`); None: a small Llama from its config."""
    seq_len: int = 32
    samples: int = 64
    save_final: Optional[str] = None
    """Where `trainer.save_model` writes the trained model at the end (None: not saved)."""
    evaluate_only: bool = False
    """Only `trainer.evaluate()`, no training (Trainer starts DeepSpeed for inference alone)."""
    lora_r: int = 0
    """> 0: PEFT's LoRA of this rank on the attention's q and v projections (`get_peft_model`),
    with dropout; only the adapters train, and `save_model` writes them alone."""


def small_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples: int, seq_len: int, vocab: int, first: int = 0) -> None:
        self.samples, self.seq_len, self.vocab, self.first = samples, seq_len, vocab, first

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(self.first + i))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
        sys.argv += ["--accelerator_config", json.dumps({"use_configured_state": True})]
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(small_llama())
    if model_args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=model_args.lora_r, lora_alpha=16, lora_dropout=0.1,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    data = RandomTokens(model_args.samples, model_args.seq_len, model.config.vocab_size)
    held_out = RandomTokens(8, model_args.seq_len, model.config.vocab_size, first=model_args.samples)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=held_out)
    if model_args.evaluate_only:
        loss = trainer.evaluate()["eval_loss"]
        if trainer.is_world_process_zero():
            print("TRAINER_LOG " + json.dumps({"log": [], "eval": [{"step": 0, "eval_loss": loss}],
                                               "train_runtime": 0.0}), flush=True)
        return
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if model_args.save_final:
        trainer.save_model(model_args.save_final)
    if trainer.is_world_process_zero():
        keys = ("step", "loss", "grad_norm", "learning_rate")
        log = [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
        evals = [{"step": h["step"], "eval_loss": h["eval_loss"]} for h in trainer.state.log_history if "eval_loss" in h]
        runtime = [h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h]
        print("TRAINER_LOG " + json.dumps({"log": log, "eval": evals, "train_runtime": runtime[-1]}), flush=True)


if __name__ == "__main__":
    main()

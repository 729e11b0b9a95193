"""A causal language model trained with accelerate's own loop and a DeepSpeed config, written the
way accelerate's DeepSpeed examples are (`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`,
`accelerator.prepare`, `accelerator.accumulate`, `accelerator.backward`), run by `deepspeed` or,
unchanged, by `fxzero run` (tools/hf_trainer.py, tests/dist/test_hf_trainer.py).

    train_accelerate.py DS_CONFIG OUTPUT_DIR [--steps N] [--accumulation K] [--moe]

The model, data and the CPU machine's process group are train_clm.py's. Rank 0 prints the loss of
every micro-batch and the learning rate after each update as one JSON line after "TRAINER_LOG ";
at the end the model is saved as accelerate's examples save it
(`unwrap_model(model).save_pretrained(..., state_dict=accelerator.get_state_dict(model))`), and
the accelerator state with `save_state`.

`--moe` trains a small Mixtral (a mixture of experts) instead, its sparse blocks named to the plugin
as accelerate's config names them (`deepspeed_moe_layer_cls_names`: `transformer_moe_cls_names`),
which makes accelerate call `deepspeed.utils.set_z3_leaf_modules` on them; the log then also says
how many modules are flagged as leaves and how many parameters DeepSpeed marks as theirs
(`ds_z3_leaf_module`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_clm import RandomTokens, small_llama  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ds_config")
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)  # (DeepSpeed's launcher passes it)
    args = parser.parse_args()

    from accelerate import Accelerator, DeepSpeedPlugin, PartialState
    from accelerate.utils import DummyOptim, DummyScheduler, set_seed
    from transformers import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    if not torch.cuda.is_available():  # (train_clm.py's docstring: accelerate's CPU machines)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    plugin = DeepSpeedPlugin(hf_ds_config=args.ds_config, gradient_accumulation_steps=args.accumulation,
                             transformer_moe_cls_names="MixtralSparseMoeBlock" if args.moe else None)
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=args.accumulation)
    set_seed(0)
    if args.moe:
        model = MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64, num_local_experts=4,
                                                 num_experts_per_tok=2))
        model.set_experts_implementation("batched_mm")  # (fxzero traces these in float32: docs/hf_models.md)
    else:
        model = LlamaForCausalLM(small_llama())
    data = torch.utils.data.DataLoader(RandomTokens(64, 32, 256), batch_size=2, shuffle=True)
    names_optimizer = "optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config
    if names_optimizer:
        optimizer = DummyOptim(model.parameters(), lr=1e-3)
        scheduler = DummyScheduler(optimizer, total_num_steps=args.steps, warmup_num_steps=1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=args.steps)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    losses, lrs, updates = [], [], 0
    start = time.perf_counter()
    model.train()
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if accelerator.sync_gradients:
            updates += 1
            lrs.append(scheduler.get_last_lr()[0])
            if updates == args.steps:
                break
    runtime = time.perf_counter() - start
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(args.output_dir, "final"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    accelerator.save_state(os.path.join(args.output_dir, "state"))
    extra = {}
    if args.moe:
        from deepspeed.utils import get_z3_leaf_modules, z3_leaf_parameter

        extra = {"leaf_modules": len(get_z3_leaf_modules(unwrapped)),
                 "leaf_parameters": sum(z3_leaf_parameter(p) for p in unwrapped.parameters())}
    if accelerator.is_main_process:
        log = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)]
        print("TRAINER_LOG " + json.dumps({"log": log, "lrs": lrs, "eval": [], "train_runtime": runtime, **extra}),
              flush=True)


if __name__ == "__main__":
    main()

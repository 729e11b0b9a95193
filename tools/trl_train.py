"""One TRL trainer run with a DeepSpeed config, as TRL's users write it; started by
tools/trl_check.py under DeepSpeed and, unchanged, under `fxzero run`.

    trl_train.py --trainer dpo|grpo|rloo|sft|reward|orpo|online_dpo|gkd --model DIR --output_dir DIR [--zero_stage 3]
                 [--precompute_ref_log_probs] [--lora] [--sync_ref_model] [--offload] [--gradient_checkpointing]
                 [--gradient_accumulation_steps K]

The model is tools/hf_trainer.py's small Llama (from_pretrained after the config, so at ZeRO-3
it is built in zero.Init); the tokenizer a word-level one made here, offline; the data
prompt/chosen/rejected strings of its words. Rank 0 prints the trainer's log as one JSON line
after "TRAINER_LOG " and the saved model's fingerprint after "FINGERPRINT ".
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def make_tokenizer(directory: str, vocab_size: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{k}": k for k in range(4, vocab_size)}}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def rows(n: int = 32) -> dict[str, list[str]]:
    g = torch.Generator().manual_seed(0)
    words = lambda k: " ".join(f"w{int(i)}" for i in torch.randint(4, 200, (k,), generator=g))  # noqa: E731
    out = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        out["prompt"].append(words(4))
        out["chosen"].append(" " + words(3))
        out["rejected"].append(" " + words(2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["dpo", "grpo", "rloo", "sft", "reward", "orpo", "online_dpo", "gkd"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--precompute_ref_log_probs", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--sync_ref_model", action="store_true", help="DPO: TR-DPO's reference mixed in every 2 steps")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    if not torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # (tests/hf_trainer/train_clm.py's main)
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    zero = {"stage": args.zero_stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if args.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    if args.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero}
    common = dict(output_dir=args.output_dir, per_device_train_batch_size=2, max_steps=6, logging_steps=1,
                  gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=1e-3,
                  deepspeed=ds_config, report_to=[], save_strategy="no", seed=0, bf16=False, max_grad_norm=1.0,
                  accelerator_config={"use_configured_state": True}, dataloader_drop_last=True,
                  gradient_checkpointing=args.gradient_checkpointing)
    tok = make_tokenizer(args.output_dir, 256)
    data = Dataset.from_dict(rows())
    if args.precompute_ref_log_probs:  # (on disk: the ranks share the precomputed columns' cache file)
        where = os.path.join(args.output_dir, "data")
        if dist.get_rank() == 0:
            data.save_to_disk(where)
        dist.barrier()
        data = load_from_disk(where)
    torch.manual_seed(0)
    if args.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(**common, beta=0.1, precompute_ref_log_probs=args.precompute_ref_log_probs,
                           sync_ref_model=args.sync_ref_model, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        peft = None
        if args.lora:
            from peft import LoraConfig

            peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tok, peft_config=peft)
    elif args.trainer in ("grpo", "rloo"):
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

        Config, Trainer = (GRPOConfig, GRPOTrainer) if args.trainer == "grpo" else (RLOOConfig, RLOOTrainer)
        config = Config(**common, num_generations=2, max_completion_length=8, generation_batch_size=4)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

        def reward_words(completions, **_):
            return [len(c.split()) / 8.0 for c in completions]

        prompts = Dataset.from_dict({"prompt": data["prompt"]})
        trainer = Trainer(model=model, args=config, train_dataset=prompts, processing_class=tok,
                          reward_funcs=reward_words)
    elif args.trainer == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        config = ORPOConfig(**common, beta=0.1, max_length=32)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        trainer = ORPOTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    elif args.trainer == "online_dpo":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        config = OnlineDPOConfig(**common, beta=0.1, max_new_tokens=6)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

        def reward_words(completions, **_):
            return [len(c.split()) / 8.0 for c in completions]

        trainer = OnlineDPOTrainer(model=model, ref_model=reference, reward_funcs=reward_words, args=config,
                                   train_dataset=Dataset.from_dict({"prompt": data["prompt"]}), processing_class=tok)
    elif args.trainer == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        config = GKDConfig(**common, max_length=32, lmbda=0.5, max_new_tokens=6, temperature=0.9)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        torch.manual_seed(1)  # (a teacher other than the student: built from the config, its own init)
        teacher = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        chats = Dataset.from_dict({"messages": [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                                                for p, c in zip(data["prompt"], data["chosen"])]})
        trainer = GKDTrainer(model=model, teacher_model=teacher, args=config, train_dataset=chats,
                             processing_class=tok)
    elif args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, max_length=32)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        text = Dataset.from_dict({"text": [p + c for p, c in zip(data["prompt"], data["chosen"])]})
        trainer = SFTTrainer(model=model, args=config, train_dataset=text, processing_class=tok)
    else:
        from trl import RewardConfig, RewardTrainer

        config = RewardConfig(**common)
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tok.pad_token_id
        trainer = RewardTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    trainer.train()
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)
    if trainer.accelerator.is_main_process:
        log = [{k: v for k, v in e.items() if isinstance(v, (int, float))} for e in trainer.state.log_history]
        print("TRAINER_LOG " + json.dumps(log), flush=True)
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from hf_trainer import fingerprint

        print("FINGERPRINT " + json.dumps(fingerprint(final)), flush=True)


if __name__ == "__main__":
    main()

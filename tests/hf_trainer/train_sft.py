"""Supervised fine-tuning with LoRA, written the way DeepSpeed-Chat's step 1 is (DeepSpeedExamples'
`applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py`): its own argparse with
`deepspeed.add_config_arguments`, its DeepSpeed config built in code, a client optimizer and a
transformers schedule handed to `deepspeed.initialize`, and its ZeRO-3 habits. Run by DeepSpeed
(torchrun) or, unchanged, by `fxzero run` (tools/hf_trainer.py, tests/dist/test_hf_trainer.py).

What it does, as that program does:
- `from deepspeed import get_accelerator`, seeding every rank alike through it;
- at ZeRO-3, `HfDeepSpeedConfig` before `from_pretrained` (the model built in `zero.Init` and
  loaded through GatheredParameters), then `resize_token_embeddings` to a multiple of 8 (under
  ZeRO-3 transformers builds the new embedding and head beside the model and swaps them in
  inside GatheredParameters), dropout set in the config;
- LoRA: each Linear of the decoder layers replaced (`deepspeed.compression.helper`'s
  `recursive_setattr`) by a layer holding the original weight (its size from `ds_shape` where
  the weight has one) and two new low-rank matrices; optionally only those trained;
- parameter groups (decay, no decay, LoRA at its own learning rate), `FusedAdam`, or
  `DeepSpeedCPUAdam` when offloading, and transformers' cosine schedule with warmup;
- `model.gradient_checkpointing_enable()` on the engine, after `initialize`;
- perplexity before and after training (eval mode, no_grad, all-reduced), the engine's
  `tput_timer` read and its epoch counted;
- with `--dpo_beta`, DeepSpeed-Chat's DPO (step2_dpo_finetuning): a second engine in the process, the
  reference model built the same way with a config of no optimizer, in eval mode, its forward
  under no_grad; the loss from both engines' outputs;
- with `--reward`, DeepSpeed-Chat's reward model (step2_reward_model_finetuning): the base model
  (`AutoModel`) under a value head, each batch the chosen rows then the rejected ones, padded at
  their ends; the loss walks the rows in Python, finding each row's end with `nonzero().item()`
  and where the pair diverges, and scores each row by its last token's value (a forward no trace
  can follow: fxzero runs it eagerly at ZeRO-2); evaluated by the mean scores and the accuracy;
- at the end: LoRA fused into the weights inside GatheredParameters(modifier_rank=0) for the
  parameters with `ds_id` that are NOT_AVAILABLE, rank 0 alone saving the module's state dict
  (DeepSpeed gives placeholders there at ZeRO-3), and at ZeRO-3 every rank gathering each
  parameter in turn for rank 0 to save, which overwrites that file.

The data are random token sequences, the same on every run. Rank 0 prints one JSON line after
"TRAINER_LOG ", in the shape of train_clm.py's: each micro-step's loss ("log"), each update's
learning rates ("lrs"), the evaluation loss (log perplexity) before and after ("eval"), the
training loop's seconds, and the throughput timer's samples per second and epoch count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, get_scheduler
from transformers.integrations.deepspeed import HfDeepSpeedConfig

import deepspeed
from deepspeed import get_accelerator
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


ADDED_TOKENS = 5
"""Tokens a tokenizer added to the pretrained model's vocabulary: the embedding is resized to fit them,
rounded up to a multiple of 8."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SFT with LoRA, DeepSpeed-Chat's way")
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--lora_module_name", default="layers.")
    parser.add_argument("--lora_learning_rate", type=float, default=5e-3)
    parser.add_argument("--only_optimize_lora", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--dpo_beta", type=float, default=0.0,
                        help="> 0: DPO against a frozen reference copy (DeepSpeed-Chat's step2_dpo_finetuning)")
    parser.add_argument("--reward", action="store_true",
                        help="train a reward model on chosen/rejected pairs (DeepSpeed-Chat's step2_reward_model_finetuning)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_config(args: argparse.Namespace, world_size: int) -> dict:
    device = "cpu" if args.offload else "none"
    config = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "train_batch_size": args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": args.zero_stage, "overlap_comm": True,
            "offload_param": {"device": device}, "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class LoRALinear(nn.Module):
    """A Linear's weight and bias, kept, plus a low-rank update: x W^T + b + (x R L) * scaling."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, dim: int, scaling: float = 1.0) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        try:
            rows, columns = weight.ds_shape  # (DeepSpeed's ZeRO-3 weight is empty; its whole shape is this)
        except AttributeError:
            rows, columns = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(dim, rows))
        self.lora_scaling = scaling / dim
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_left_weight)
        self.weight.requires_grad = False
        self.fused = False

    def fuse(self) -> None:
        if not self.fused:
            self.weight.data += self.lora_scaling * torch.matmul(self.lora_left_weight.t(), self.lora_right_weight.t())
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.fused:
            return out
        return out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def to_lora(model: nn.Module, part: str, dim: int) -> nn.Module:
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and part in name]
    for name in names:
        module = recursive_getattr(model, name)
        layer = LoRALinear(module.weight, module.bias, dim).to(module.weight.device).to(module.weight.dtype)
        recursive_setattr(model, name, layer)
    return model


def params_to_fetch(params: list) -> list:
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def fuse_lora(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, LoRALinear):
            zero3 = hasattr(module.weight, "ds_id")
            params = [module.weight, module.bias, module.lora_left_weight, module.lora_right_weight]
            with deepspeed.zero.GatheredParameters(params_to_fetch([p for p in params if p is not None]),
                                                   modifier_rank=0, enabled=zero3):
                module.fuse()


def grouped_parameters(model: nn.Module, weight_decay: float, lora_lr: float) -> list[dict]:
    no_decay = ("bias", "norm.weight")
    lora = ("lora_right_weight", "lora_left_weight")
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if p.requires_grad and not any(k in n for k in no_decay) and not any(k in n for k in lora)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if p.requires_grad and not any(k in n for k in no_decay) and any(k in n for k in lora)],
         "weight_decay": weight_decay, "lr": lora_lr},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def save_zero3(model, rank: int, path: str) -> None:
    """Every rank gathers each parameter in turn; rank 0 saves them (not the LoRA matrices)."""
    module = model.module if hasattr(model, "module") else model
    state = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters(params_to_fetch([p]), enabled=True):
                value = p.data.cpu()
        else:
            value = p.cpu()
        if rank == 0 and "lora" not in name:
            state[name] = value
    if rank == 0:
        torch.save(state, path)


def eval_config(args: argparse.Namespace, world_size: int) -> dict:
    """The reference model's config: no optimizer, parameters sharded at ZeRO-3 (else stage 0)."""
    return {"train_micro_batch_size_per_gpu": 2 * args.per_device_train_batch_size,
            "train_batch_size": 2 * args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps,
            "steps_per_print": 10, "gradient_clipping": 1.0, "prescale_gradients": False,
            "zero_optimization": {"stage": args.zero_stage if args.zero_stage == 3 else 0,
                                  "stage3_param_persistence_threshold": 1e4, "memory_efficient_linear": False},
            **({"bf16": {"enabled": True}} if args.dtype == "bf16" else {})}


def pretrained(args: argparse.Namespace, ds_config: dict) -> nn.Module:
    model_config = AutoConfig.from_pretrained(args.model_name_or_path)
    model_config.attention_dropout = args.dropout
    keep = HfDeepSpeedConfig(ds_config) if args.zero_stage == 3 else None  # noqa: F841  (zero.Init in from_pretrained)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=model_config)
    model.resize_token_embeddings(int(8 * math.ceil((model_config.vocab_size + ADDED_TOKENS) / 8.0)))
    return model


class RewardModel(nn.Module):
    """DeepSpeed-Chat's reward model, its way: a value head over the base model's last hidden
    states; the batch is the chosen rows, then the rejected ones."""

    def __init__(self, base: nn.Module, pad_id: int, num_padding_at_beginning: int = 0) -> None:
        super().__init__()
        self.config = base.config
        self.v_head = nn.Linear(base.config.hidden_size, 1, bias=False)
        self.rwtransformer = base
        self.pad_id, self.num_padding_at_beginning = pad_id, num_padding_at_beginning

    def _end(self, ids: torch.Tensor, length: int) -> int:
        """Where the row's padding starts (past the pads it begins with), or its length."""
        pads = (ids == self.pad_id).nonzero()
        return pads[self.num_padding_at_beginning].item() if len(pads) > self.num_padding_at_beginning else length

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                use_cache: bool = False) -> dict:
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, use_cache=use_cache)[0]
        rewards = self.v_head(hidden).squeeze(-1)
        half, length = input_ids.shape[0] // 2, input_ids.shape[1]
        loss, chosen_scores, rejected_scores = 0.0, [], []
        for i in range(half):
            chosen, rejected = input_ids[i], input_ids[half + i]
            chosen_reward, rejected_reward = rewards[i], rewards[half + i]
            chosen_end = self._end(chosen, length)
            diverged = (chosen != rejected).nonzero()
            if len(diverged) == 0:  # (the same text twice: its last score alone)
                end = rejected_reward.size(-1)
                start, rejected_end = end - 1, chosen_end
            else:
                rejected_end = self._end(rejected, length)
                end, start = max(chosen_end, rejected_end), diverged[0]
            loss = loss - F.logsigmoid(chosen_reward[start:end] - rejected_reward[start:end]).mean()
            chosen_scores.append(chosen_reward[chosen_end - 1])
            rejected_scores.append(rejected_reward[rejected_end - 1])
        return {"loss": loss / half, "chosen_mean_scores": torch.stack(chosen_scores),
                "rejected_mean_scores": torch.stack(rejected_scores)}


def reward_pairs(samples: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected rows sharing a prompt, each padded (token 0) from its own length on."""
    g = torch.Generator().manual_seed(9)
    chosen = torch.randint(1, vocab, (samples, seq_len), generator=g)
    rejected = chosen.clone()
    prompt = seq_len // 2
    rejected[:, prompt:] = torch.randint(1, vocab, (samples, seq_len - prompt), generator=g)
    rejected[::4] = chosen[::4]  # (some pairs do not diverge)
    for rows in (chosen, rejected):
        ends = torch.randint(prompt + 2, seq_len + 1, (samples,), generator=g)
        for row, end in zip(rows, ends.tolist()):
            row[end:] = 0
    return chosen, rejected


def response_logps(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Each sequence's log-probability of its tokens from `start` on (the response)."""
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logps[:, start - 1:].sum(-1)


def main() -> None:
    args = parse_args()
    get_accelerator().set_device(max(args.local_rank, 0))
    deepspeed.init_distributed()
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ds_config = train_config(args, world_size)
    torch.manual_seed(args.seed)
    get_accelerator().manual_seed_all(args.seed)
    torch.distributed.barrier()

    vocab = AutoConfig.from_pretrained(args.model_name_or_path).vocab_size + ADDED_TOKENS  # (the tokenizer's size)
    if args.reward:
        return train_reward_model(args, ds_config, rank, world_size, vocab)
    model = pretrained(args, ds_config)
    if args.lora_dim > 0:
        model = to_lora(model, args.lora_module_name, args.lora_dim)
        if args.only_optimize_lora:
            for name, p in model.named_parameters():
                p.requires_grad = "lora_right_weight" in name or "lora_left_weight" in name
            model.enable_input_require_grads()

    data = torch.randint(0, vocab, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(7))
    rejected = data.clone()  # (DPO's pairs: one prompt, two responses)
    prompt = args.seq_len // 2
    rejected[:, prompt:] = torch.randint(0, vocab, (args.samples, args.seq_len - prompt),
                                         generator=torch.Generator().manual_seed(8))
    dataset = TensorDataset(data, rejected)
    train = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=DistributedSampler(dataset))
    evaluation_data = DataLoader(TensorDataset(data[:8]), batch_size=2, sampler=DistributedSampler(TensorDataset(data[:8])))

    def perplexity(engine) -> float:
        engine.eval()
        losses = torch.zeros(())
        for step, (ids,) in enumerate(evaluation_data):
            with torch.no_grad():
                losses += engine(input_ids=ids, labels=ids).loss.float()
        losses = losses / (step + 1)
        torch.distributed.all_reduce(losses)
        return math.exp((losses / world_size).item())

    optimizer_class = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = optimizer_class(grouped_parameters(model, args.weight_decay, args.lora_learning_rate),
                                lr=args.learning_rate, betas=(0.9, 0.95))
    updates = math.ceil(len(train) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=updates)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                              config=ds_config, lr_scheduler=lr_scheduler,
                                                              dist_init_required=True)
    if args.gradient_checkpointing:
        engine.gradient_checkpointing_enable()
    reference = None
    if args.dpo_beta > 0:  # (a second engine in the process: the frozen reference, in eval mode)
        ref_config = eval_config(args, world_size)
        reference, *_ = deepspeed.initialize(model=pretrained(args, ref_config), config=ref_config)
        reference.eval()

    def train_loss(chosen: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if reference is None:
            return engine(input_ids=chosen, labels=chosen, use_cache=False).loss
        both = torch.cat([chosen, other])
        policy = response_logps(engine(input_ids=both, use_cache=False).logits, both, prompt)
        with torch.no_grad():
            ref = response_logps(reference(input_ids=both).logits, both, prompt)
        n = chosen.shape[0]
        margin = (policy[:n] - ref[:n]) - (policy[n:] - ref[n:])
        return -F.logsigmoid(args.dpo_beta * margin).mean()

    log = {"log": [], "lrs": [], "eval": [{"step": 0, "eval_loss": math.log(perplexity(engine))}]}
    engine.train()
    start = time.perf_counter()
    for step, (ids, other) in enumerate(train, 1):
        loss = train_loss(ids, other)
        engine.backward(loss)
        engine.step()
        log["log"].append({"step": step, "loss": loss.item()})
        if step % args.gradient_accumulation_steps == 0:
            log["lrs"] += lr_scheduler.get_last_lr()
    log["train_runtime"] = time.perf_counter() - start
    engine.tput_timer.update_epoch_count()
    log["eval"].append({"step": step, "eval_loss": math.log(perplexity(engine))})
    log["samples_per_sec"] = engine.tput_timer.avg_samples_per_sec()
    log["epochs"] = engine.tput_timer.epoch_count

    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "pytorch_model.bin")
    fuse_lora(engine.module)
    if rank == 0:
        torch.save({k: v for k, v in engine.module.state_dict().items() if "lora" not in k}, path)
    if args.zero_stage == 3:
        save_zero3(engine, rank, path)
    if rank == 0:
        print("TRAINER_LOG " + json.dumps(log), flush=True)


def train_reward_model(args: argparse.Namespace, ds_config: dict, rank: int, world_size: int, vocab: int) -> None:
    model_config = AutoConfig.from_pretrained(args.model_name_or_path)
    model_config.attention_dropout = args.dropout
    base = AutoModel.from_pretrained(args.model_name_or_path, config=model_config)
    base.resize_token_embeddings(int(8 * math.ceil(vocab / 8.0)))
    model = RewardModel(base, pad_id=0)
    chosen, rejected = reward_pairs(args.samples, args.seq_len, vocab)
    dataset = TensorDataset(chosen, rejected)
    train = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=DistributedSampler(dataset))
    held_out = TensorDataset(chosen[:8], rejected[:8])
    evaluation_data = DataLoader(held_out, batch_size=2, sampler=DistributedSampler(held_out))

    def batch(c: torch.Tensor, r: torch.Tensor) -> dict:
        ids = torch.cat([c, r])
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}

    def evaluate(engine) -> dict:
        engine.eval()
        totals = torch.zeros(3)  # (chosen score, rejected score, correct pairs)
        pairs = 0
        for c, r in evaluation_data:
            with torch.no_grad():
                out = engine(**batch(c, r))
            chosen_scores, rejected_scores = out["chosen_mean_scores"].float(), out["rejected_mean_scores"].float()
            totals += torch.stack([chosen_scores.sum(), rejected_scores.sum(),
                                   (chosen_scores > rejected_scores).float().sum()])
            pairs += c.shape[0]
        torch.distributed.all_reduce(totals)
        chosen_mean, rejected_mean, acc = (totals / (pairs * world_size)).tolist()
        engine.train()
        return {"eval_loss": chosen_mean - rejected_mean, "chosen": chosen_mean, "rejected": rejected_mean,
                "acc": acc}

    optimizer = FusedAdam(grouped_parameters(model, args.weight_decay, args.lora_learning_rate),
                          lr=args.learning_rate, betas=(0.9, 0.95))
    updates = math.ceil(len(train) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=updates)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                              config=ds_config, lr_scheduler=lr_scheduler,
                                                              dist_init_required=True)
    log = {"log": [], "lrs": [], "eval": [{"step": 0, **evaluate(engine)}]}
    start = time.perf_counter()
    for step, (c, r) in enumerate(train, 1):
        loss = engine(**batch(c, r), use_cache=False)["loss"]
        engine.backward(loss)
        engine.step()
        log["log"].append({"step": step, "loss": loss.item()})
        if step % args.gradient_accumulation_steps == 0:
            log["lrs"] += lr_scheduler.get_last_lr()
    log["train_runtime"] = time.perf_counter() - start
    log["eval"].append({"step": step, **evaluate(engine)})
    os.makedirs(args.output_dir, exist_ok=True)
    state = engine.module.state_dict()  # (on every rank: at ZeRO-3 it gathers, a collective)
    if rank == 0:
        torch.save(state, os.path.join(args.output_dir, "pytorch_model.bin"))
        print("TRAINER_LOG " + json.dumps(log), flush=True)


if __name__ == "__main__":
    main()

"""Hugging Face's Trainer with a DeepSpeed config, under DeepSpeed 0.19.8 and, unchanged, under `fxzero run`.

    python tools/hf_trainer.py --deepspeed-python .venv-bench/bin/python [--runs zero2-...] \
        [--write tests/hf_trainer/deepspeed_reference.json]

Each run starts tests/hf_trainer/train_clm.py (a Trainer script written as its users write it,
`--deepspeed ds.json`), train_accelerate.py (accelerate's own loop) or train_sft.py (DeepSpeed-Chat's
supervised fine-tuning, its way) on 2 CPU ranks with the same
arguments, once with DeepSpeed on its CPU
accelerator (`DS_ACCELERATOR=cpu`, launched by torchrun) and once with `fxzero run`. Prints one
JSON object per run: each system's Trainer log (loss, grad_norm, learning_rate per step, and
the evaluation loss where the run evaluates), the
fingerprint of the model `trainer.save_model` wrote (each tensor's sum and sum of squares), the
largest differences, and each system's `train_runtime`. With `--write`, DeepSpeed's logs and
fingerprints are stored as the reference tests/dist/test_hf_trainer.py compares fxzero against
(the test needs no DeepSpeed installed; the runs given replace theirs in the file, the others
stay). `.venv-bench` comes from `bash scripts/bench-env.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "tests", "hf_trainer")
SCRIPTS = {"trainer": os.path.join(HERE, "train_clm.py"), "accelerate": os.path.join(HERE, "train_accelerate.py"),
           "sft": os.path.join(HERE, "train_sft.py")}
REFERENCE = os.path.join(HERE, "deepspeed_reference.json")

_COMMON = ["--deepspeed", "{config}", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3",
           "--logging_steps", "1", "--report_to", "none", "--seed", "0", "--output_dir", "{workdir}/out"]
_SAVE = ["--save_final", "{workdir}/final"]

RUNS: dict[str, dict] = {
    # The config names the optimizer and schedule (DeepSpeed builds them from Trainer's values);
    # an evaluation every 2 steps; save_model gathers the 16-bit weights.
    "zero3-config-optimizer": {
        "config": "ds_zero3.json", "save_final": True,
        "args": [*_COMMON, *_SAVE, "--max_steps", "5", "--warmup_steps", "2", "--save_strategy", "no", "--eval_strategy",
                 "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "2"]},
    # No optimizer in the config: Trainer's own (torch.optim.AdamW(fused=True), weight decay in
    # one param group and not the other) and its linear schedule, two micro-steps per update,
    # clipping at Trainer's 1.0; save_model takes the module's state dict.
    "zero2-trainer-optimizer-accumulation": {
        "config": "ds_zero2.json", "save_final": True,
        "args": [*_COMMON, *_SAVE, "--max_steps", "4", "--warmup_steps", "2", "--weight_decay", "0.1",
                 "--gradient_accumulation_steps", "2", "--save_strategy", "no"]},
    # Optimizer states and parameters offloaded to host memory, no optimizer in the config:
    # accelerate turns Trainer's AdamW into DeepSpeedCPUAdam; Trainer's gradient checkpointing
    # (`model.gradient_checkpointing_enable()`) on.
    "zero3-offload-checkpointing": {
        "config": "ds_zero3_offload.json", "save_final": True,
        "args": [*_COMMON, *_SAVE, "--max_steps", "4", "--warmup_steps", "1", "--weight_decay", "0.01",
                 "--gradient_checkpointing", "--save_strategy", "no"]},
    # from_pretrained after the TrainingArguments: at ZeRO-3 the model is built in zero.Init and
    # the checkpoint loaded on rank 0 through GatheredParameters; a checkpoint every 2 steps.
    "zero3-pretrained-checkpoint": {
        "config": "ds_zero3_checkpoint.json", "pretrained": True,
        "args": [*_COMMON, "--max_steps", "4", "--warmup_steps", "1", "--save_strategy", "steps",
                 "--save_steps", "2"]},
    # ... and the same from its step-2 checkpoint: Trainer's resume (the engine's load_checkpoint).
    "zero3-pretrained-resume": {
        "config": "ds_zero3_checkpoint.json", "pretrained": True, "resume_from": "zero3-pretrained-checkpoint",
        "args": [*_COMMON, "--max_steps", "4", "--warmup_steps", "1", "--save_strategy", "no",
                 "--resume_from_checkpoint", "{workdir}/out/checkpoint-2"]},
    # Trainer's evaluate() alone on a model from from_pretrained: DeepSpeed started for inference
    # (no optimizer; the config's scheduler, left in by Trainer, never built).
    "zero3-pretrained-evaluate-only": {
        "config": "ds_zero3.json", "pretrained": True,
        "args": [*_COMMON, "--per_device_eval_batch_size", "2", "--evaluate_only"]},
    # accelerate's own loop (no Trainer): the config's optimizer through DummyOptim and
    # DummyScheduler, 2 micro-batches per update under accelerator.accumulate, the model saved
    # with get_state_dict and the state with save_state.
    "accelerate-zero3-accumulation": {
        "script": "accelerate", "config": "ds_accelerate_zero3.json", "save_final": True,
        "args": ["{config}", "{workdir}", "--steps", "4", "--accumulation", "2"]},
    # ... with a small Mixtral whose sparse blocks accelerate flags as ZeRO-3 leaf modules
    # (transformer_moe_cls_names: deepspeed.utils.set_z3_leaf_modules), as accelerate's MoE users run.
    "accelerate-zero3-moe": {
        "script": "accelerate", "config": "ds_accelerate_zero3.json", "save_final": True,
        "args": ["{config}", "{workdir}", "--steps", "3", "--accumulation", "2", "--moe"]},
    # PEFT's LoRA on a from_pretrained model at ZeRO-3 (get_peft_model before Trainer: its adapters
    # built beside the zero.Init model), adapter dropout, only the adapters trained and saved.
    "zero3-pretrained-peft-lora": {
        "config": "ds_zero3.json", "pretrained": True, "save_final": True,
        "args": [*_COMMON, *_SAVE, "--max_steps", "4", "--warmup_steps", "1", "--save_strategy", "no",
                 "--lora_r", "4"]},
    # ... with a checkpoint every 2 steps: Trainer saves a PEFT model's with
    # save_checkpoint(exclude_frozen_parameters=True) where the engine takes the argument ...
    "zero3-pretrained-peft-lora-checkpoint": {
        "config": "ds_zero3_checkpoint.json", "pretrained": True, "save_final": True,
        "args": [*_COMMON, *_SAVE, "--max_steps", "4", "--warmup_steps", "1", "--save_strategy", "steps",
                 "--save_steps", "2", "--lora_r", "4"]},
    # ... and resumes from step 2 with load_checkpoint(load_module_strict=False).
    "zero3-pretrained-peft-lora-resume": {
        "config": "ds_zero3_checkpoint.json", "pretrained": True, "save_final": True,
        "resume_from": "zero3-pretrained-peft-lora-checkpoint",
        "args": [*_COMMON, *_SAVE, "--max_steps", "4", "--warmup_steps", "1", "--save_strategy", "no",
                 "--lora_r", "4", "--resume_from_checkpoint", "{workdir}/out/checkpoint-2"]},
    # DeepSpeed-Chat's step 1 (supervised fine-tuning), its way (tests/hf_trainer/train_sft.py): at
    # ZeRO-3 from_pretrained in zero.Init, resize_token_embeddings, LoRA layers swapped in, its client
    # FusedAdam and transformers' cosine schedule, dropout, perplexity before and after, LoRA fused
    # under GatheredParameters and the model saved by its gather loop (after rank 0 alone took the
    # module's state dict).
    "sft-zero3-lora": {
        "script": "sft", "pretrained": True, "save_final": True,
        "args": ["--output_dir", "{workdir}/final", "--zero_stage", "3", "--lora_dim", "4"]},
    # ... only the LoRA matrices trained, parameters and optimizer states offloaded to host memory
    # (DeepSpeedCPUAdam), gradient checkpointing enabled on the engine after initialize.
    "sft-zero3-lora-only-offload-checkpointing": {
        "script": "sft", "pretrained": True, "save_final": True,
        "args": ["--output_dir", "{workdir}/final", "--zero_stage", "3", "--lora_dim", "4", "--only_optimize_lora",
                 "--offload", "--gradient_checkpointing"]},
    # ... DPO (DeepSpeed-Chat's step2_dpo_finetuning) at ZeRO-3: a second engine in the process, the
    # frozen reference, from_pretrained in zero.Init too, with no optimizer, in eval mode.
    "sft-zero3-dpo-reference": {
        "script": "sft", "pretrained": True, "save_final": True,
        "args": ["--output_dir", "{workdir}/final", "--zero_stage", "3", "--dpo_beta", "0.1"]},
    # ... at ZeRO-2, no LoRA: rank 0's state dict is the saved model.
    "sft-zero2": {
        "script": "sft", "pretrained": True, "save_final": True,
        "args": ["--output_dir", "{workdir}/final", "--zero_stage", "2"]},
    # ... DeepSpeed-Chat's reward model (step2_reward_model_finetuning) at ZeRO-2: a forward that walks
    # its rows in Python (`nonzero().item()`), which fxzero runs eagerly.
    "sft-zero2-reward": {
        "script": "sft", "pretrained": True, "save_final": True,
        "args": ["--output_dir", "{workdir}/final", "--zero_stage", "2", "--reward"]},
    # ... at ZeRO-3, where fxzero gathers every unit for the eager forward. DeepSpeed 0.19.8 on its CPU
    # accelerator fails there (its gradient defragmentation), so the reference is its ZeRO-2 run: the
    # same arithmetic in fp32.
    "sft-zero3-reward": {
        "script": "sft", "pretrained": True, "save_final": True, "reference": "sft-zero2-reward",
        "args": ["--output_dir", "{workdir}/final", "--zero_stage", "3", "--reward"]},
}
"""name -> {"script" ("trainer", the default, "accelerate" or "sft"), "config" (in tests/hf_trainer/),
"args" ({config}, {workdir} filled in), "save_final" (the model saved in {workdir}/final),
"pretrained" (--model_name_or_path given), "resume_from" (the run whose folder it continues in),
"reference" (the run whose DeepSpeed results this one is compared with: DeepSpeed is not run)}."""


def save_pretrained_model(path: str) -> str:
    """The small Llama `--model_name_or_path` loads, written once (its weights from seed 1)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaForCausalLM

        sys.path.insert(0, HERE)
        from train_clm import small_llama

        torch.manual_seed(1)
        LlamaForCausalLM(small_llama()).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fingerprint(path: str) -> dict[str, list[float]]:
    """Each tensor of a saved model (model.safetensors, else pytorch_model.bin): [sum, sum of
    squares], in float64."""
    saved = [name for name in ("model.safetensors", "adapter_model.safetensors") if os.path.exists(os.path.join(path, name))]
    if saved:  # (a PEFT model's save writes its adapters alone)
        from safetensors.torch import load_file

        tensors = load_file(os.path.join(path, saved[0]))
    else:
        import torch

        tensors = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu")
    return {k: [v.double().sum().item(), v.double().square().sum().item()] for k, v in sorted(tensors.items())}


def launch(system: str, name: str, workdir: str, python: str, pretrained: Optional[str] = None) -> dict:
    """Run `name` under `system` ("deepspeed" or "fxzero") in `workdir`: rank 0's Trainer log, its
    runtime and, where the run saves its final model, the model's fingerprint."""
    run = RUNS[name]
    config = os.path.join(HERE, run["config"]) if "config" in run else None  # (train_sft.py builds its own)
    args = [a.format(workdir=workdir, config=config) for a in run["args"]]
    if run.get("pretrained"):
        args += ["--model_name_or_path", pretrained]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    launcher = ["-m", "fxzero.cli", "run", "--num_gpus=2"] if system == "fxzero" else \
        ["-m", "torch.distributed.run", "--nproc_per_node=2"]
    script = SCRIPTS[run.get("script", "trainer")]
    for attempt in range(2 if system == "deepspeed" else 1):  # (DeepSpeed's ranks on this CPU accelerator
        # sometimes abort at exit, "terminate called without an active exception", after training: run again)
        proc = subprocess.run([python, *launcher, f"--master_port={free_port()}", script, *args], cwd=workdir,
                              env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0:
            break
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TRAINER_LOG ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} {name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    out = json.loads(lines[-1][len("TRAINER_LOG "):])
    if run.get("save_final"):
        out["fingerprint"] = fingerprint(os.path.join(workdir, "final"))
    return out


def run_both(names: list[str], deepspeed_python: str, fxzero_python: str) -> dict[str, dict]:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pretrained = save_pretrained_model(os.path.join(tmp, "pretrained"))
        for system, python in (("deepspeed", deepspeed_python), ("fxzero", fxzero_python)):
            for name in names:
                if system == "deepspeed" and "reference" in RUNS[name]:
                    continue
                workdir = os.path.join(tmp, system, RUNS[name].get("resume_from", name))
                os.makedirs(workdir, exist_ok=True)
                results.setdefault(name, {})[system] = launch(system, name, workdir, python, pretrained)
    return results


def differences(a: dict, b: dict) -> dict[str, float]:
    """The largest differences between two runs' logs (and fingerprints, relative)."""
    out = {key: max(abs(x[key] - y[key]) for x, y in zip(a["log"], b["log"])) for key in ("loss", "grad_norm",
                                                                                       "learning_rate")
           if a["log"] and key in a["log"][0]}
    if a["eval"]:
        out["eval_loss"] = max(abs(x["eval_loss"] - y["eval_loss"]) for x, y in zip(a["eval"], b["eval"]))
    if "fingerprint" in a:
        out["fingerprint_relative"] = max(abs(x - y) / max(abs(x), 1e-30) for k in a["fingerprint"]
                                          for x, y in zip(a["fingerprint"][k], b["fingerprint"][k]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True, help="a Python with DeepSpeed 0.19.8 and accelerate")
    parser.add_argument("--fxzero-python", default=sys.executable)  # (absolute: the runs start in their own folders)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--write", help="store DeepSpeed's results here as the test's reference")
    opts = parser.parse_args()
    names = opts.runs.split(",")
    results = run_both(names, os.path.abspath(opts.deepspeed_python), os.path.abspath(opts.fxzero_python))
    for name in names:
        reference_run = RUNS[name].get("reference", name)
        if reference_run not in results or "deepspeed" not in results[reference_run]:
            raise SystemExit(f"{name} is compared with DeepSpeed's {reference_run}: run that too")
        ds, fx = results[reference_run]["deepspeed"], results[name]["fxzero"]
        print(json.dumps({"run": name, "steps": len(ds["log"]), "max_difference": differences(ds, fx),
                          "train_runtime_s": {"deepspeed": ds["train_runtime"], "fxzero": fx["train_runtime"]},
                          "deepspeed": ds, "fxzero": fx}))
    if opts.write:  # (the runs given replace theirs in the file; the others are kept)
        reference = {"deepspeed": "0.19.8", "runs": {}}
        if os.path.exists(opts.write):
            with open(opts.write) as f:
                reference = json.load(f)
        reference["runs"].update({name: {k: v for k, v in results[name]["deepspeed"].items() if k != "train_runtime"}
                                  for name in names if "deepspeed" in results[name]})
        with open(opts.write, "w") as f:
            json.dump(reference, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DeepSpeedExamples' scripts, unchanged, under DeepSpeed 0.19.8 and under `fxzero run`, side by side.

    python tools/deepspeed_examples.py --deepspeed-python /path/to/venv-with-deepspeed/bin/python \
        [--runs cifar-stage0-fp32-2,...] [--write tests/deepspeed_examples/deepspeed_losses.json]

Each run starts the same script (tests/deepspeed_examples/, upstream files with only their data
sources replaced: see its README) with the same arguments, once with DeepSpeed on its CPU
accelerator (`DS_ACCELERATOR=cpu`, launched by torchrun) and once with `fxzero run`, every rank
seeded alike at start (FXZERO_SEED) and its per-step losses and step times recorded by
tests/deepspeed_examples/record/sitecustomize.py. Prints one JSON object per run: both systems'
losses (rank 0's micro-batch), the largest difference, the median step time of each. With
`--write`, DeepSpeed's losses are stored as the reference tests/dist/test_deepspeed_examples.py
compares fxzero against (the test needs no DeepSpeed installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "tests", "deepspeed_examples")
sys.path.insert(0, EXAMPLES)
import opt_tiny  # noqa: E402  (tests/deepspeed_examples/opt_tiny.py)
from opt_tiny import make_opt_tiny  # noqa: E402
from tokenizer import make_tokenizer  # noqa: E402  (tests/deepspeed_examples/tokenizer.py)

RUNS: dict[str, dict] = {}
"""name -> {"script", "args", "nproc"}: what the test and this tool run."""
for _stage in (0, 1, 2, 3):
    for _dtype in ("fp32", "bf16"):
        for _nproc in (1, 2):
            RUNS[f"cifar-stage{_stage}-{_dtype}-{_nproc}"] = {
                "script": "cifar10_deepspeed.py", "shims": "cifar", "nproc": _nproc,
                "args": ["--epochs", "1", "--dtype", _dtype, "--stage", str(_stage), "--log-interval", "100"]}


_HELLO = ["--num_iterations", "21", "--checkpoint_every", "10", "--log_every", "5", "--batch_size", "8",
          "--num_layers", "2", "--num_heads", "4", "--ff_dim", "256", "--h_dim", "128", "--max_seq_length", "128",
          "--dtype", "bf16"]
"""HelloDeepSpeed's arguments: a 2-layer Roberta of width 128 (its 50,265-token vocabulary), 20 steps of
micro-batch 8 padded to each batch's longest row (at most 128), a checkpoint at step 10 and 20."""
for _nproc in (1, 2):
    RUNS[f"hello-bf16-{_nproc}"] = {"script": "train_bert_ds.py", "shims": "hello", "nproc": _nproc,
                                    "args": ["--checkpoint_dir", "{workdir}/ck", "--tokenizer", "{tokenizer}", *_HELLO]}
    RUNS[f"hello-fixed-bf16-{_nproc}"] = {**RUNS[f"hello-bf16-{_nproc}"], "env": {"FXZERO_WIKITEXT_WORDS": "200"}}


_DSCHAT = ["--data_path", "Dahoas/rm-static", "--data_split", "2,4,4", "--model_name_or_path", "{opt}",
           "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_seq_len", "64",
           "--learning_rate", "1e-3", "--num_train_epochs", "1", "--lr_scheduler_type", "cosine", "--seed", "1234",
           "--dtype", "bf16", "--deepspeed", "--output_dir", "{workdir}/out", "--data_output_path", "{workdir}/data"]
"""DeepSpeed-Chat's arguments (its run_*.sh's, scaled down): the default Dahoas/rm-static (synthetic) split
2,4,4 (step 1 trains on 64 rows, step 2 on 128 pairs), an OPT of width 64 from a pretrained directory
(opt_tiny.py), micro-batch 4 padded to 64 tokens, one epoch, bf16, saving the model at its end."""
_LORA = ["--lora_dim", "8", "--lora_module_name", "decoder.layers.", "--only_optimize_lora", "--lora_learning_rate",
         "1e-3", "--gradient_checkpointing", "--gradient_accumulation_steps", "2", "--compute_fp32_loss"]
"""run_1.3b_lora.sh's LoRA (only the adapters trained), with gradient checkpointing, accumulation, fp32 loss."""
_SFT = "DeepSpeed-Chat/training/step1_supervised_finetuning/main.py"
_DPO = "DeepSpeed-Chat/training/step2_dpo_finetuning/main.py"
_REWARD = "DeepSpeed-Chat/training/step2_reward_model_finetuning/main.py"
for _name, _script, _extra in (("sft-stage2", _SFT, ["--zero_stage", "2"]),
                               ("sft-stage3-lora", _SFT, ["--zero_stage", "3", *_LORA]),
                               ("sft-stage3-offload", _SFT, ["--zero_stage", "3", "--offload",
                                                             "--gradient_accumulation_steps", "2"]),
                               ("reward-stage2", _REWARD, ["--zero_stage", "2"]),
                               ("dpo-stage3", _DPO, ["--zero_stage", "3"])):
    # (not the reward model at ZeRO-3: DeepSpeed 0.19.8 fails its initialize there, its value head
    # being fp32 beside the bf16 model, "assert len(set(t.dtype for t in tensors)) == 1")
    RUNS[f"dschat-{_name}-bf16-2"] = {"script": _script, "shims": "dschat", "nproc": 2, "launcher": "deepspeed",
                                      "args": [*_DSCHAT, *_extra], "saves": ("out/pytorch_model.bin",)}
for _stage in (2, 3):  # (step times at OPT-125m's size: tools/deepspeed_examples.py only, not the test's)
    _args = [a if a != "{opt}" else "{opt125m}" for a in _DSCHAT]
    _args[_args.index("--max_seq_len") + 1] = "256"
    RUNS[f"dschat-sft-opt125m-stage{_stage}-bf16-2"] = {
        "script": _SFT, "shims": "dschat", "nproc": 2, "launcher": "deepspeed",
        "args": [*_args, "--zero_stage", str(_stage), "--print_loss"], "env": {"FXZERO_RM_STATIC_TRAIN": "400"}}
_RLHF = ["--data_path", "Dahoas/rm-static", "--data_split", "2,4,4", "--actor_model_name_or_path", "{opt}",
         "--critic_model_name_or_path", "{critic}", "--num_padding_at_beginning", "1",
         "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
         "--generation_batches", "1", "--ppo_epochs", "1", "--max_answer_seq_len", "32", "--max_prompt_seq_len", "64",
         "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4", "--num_train_epochs", "1",
         "--lr_scheduler_type", "cosine", "--gradient_accumulation_steps", "1", "--actor_dropout", "0.0",
         "--num_warmup_steps", "0", "--deepspeed", "--seed", "1234", "--dtype", "bf16", "--enable_test_mode",
         "--test_stop_step", "2", "--output_dir", "{workdir}/out", "--data_output_path", "{workdir}/data"]
"""DeepSpeed-Chat's step 3 (PPO), as its run_1.3b.sh (scaled down): the actor from the pretrained OPT, the
critic and reward model from a step-2-shaped directory (opt_tiny.make_opt_tiny_critic), generation
batches of 4 prompts answered greedily with up to 32 tokens, 2 PPO steps (its test mode), bf16; four
engines in one process (actor, reference, critic, reward; with --enable_ema a fifth). Without its
--enable_hybrid_engine: DeepSpeed's hybrid engine needs inference kernels its CPU accelerator lacks."""
for _name, _extra, _saves in (("stage2", ["--actor_zero_stage", "2", "--critic_zero_stage", "2"], ("actor", "critic")),
                              ("actor-stage3-ema", ["--actor_zero_stage", "3", "--critic_zero_stage", "2",
                                                    "--enable_ema"], ("actor", "actor_ema", "critic"))):
    # (not the critic at ZeRO-3: DeepSpeed 0.19.8 fails there as for the reward model)
    RUNS[f"dschat-rlhf-{_name}-bf16-2"] = {
        "script": "DeepSpeed-Chat/training/step3_rlhf_finetuning/main.py", "shims": "dschat", "nproc": 2,
        "launcher": "deepspeed", "args": [*_RLHF, *_extra],
        "saves": tuple(f"out/{model}/pytorch_model.bin" for model in _saves)}
_LORA_RLHF = ["--actor_lora_dim", "8", "--critic_lora_dim", "8", "--only_optimize_lora", "--actor_lora_learning_rate",
              "1e-3", "--critic_lora_learning_rate", "1e-3", "--actor_gradient_checkpointing",
              "--critic_gradient_checkpointing", "--offload_reference_model"]
"""run_1.3b_lora.sh's step 3, scaled down: LoRA on both models (only the adapters trained), gradient
checkpointing on both, the reference model's parameters offloaded (a ZeRO-3 engine without optimizer)."""
RUNS["dschat-rlhf-actor-stage3-lora-bf16-2"] = {
    **RUNS["dschat-rlhf-actor-stage3-ema-bf16-2"],
    "args": [*RUNS["dschat-rlhf-actor-stage3-ema-bf16-2"]["args"], *_LORA_RLHF]}
RUNS["dschat-rlhf-actor-stage3-lora-hybrid-bf16-2"] = {
    **RUNS["dschat-rlhf-actor-stage3-lora-bf16-2"], "args": [*RUNS["dschat-rlhf-actor-stage3-lora-bf16-2"]["args"],
                                                            "--enable_hybrid_engine"],
    "compared_with": "dschat-rlhf-actor-stage3-lora-bf16-2"}
RUNS["dschat-rlhf-actor-stage3-ema-hybrid-bf16-2"] = {
    **RUNS["dschat-rlhf-actor-stage3-ema-bf16-2"], "args": [*RUNS["dschat-rlhf-actor-stage3-ema-bf16-2"]["args"],
                                                           "--enable_hybrid_engine"],
    "compared_with": "dschat-rlhf-actor-stage3-ema-bf16-2"}
"""DeepSpeed-Chat's run_1.3b.sh generates with DeepSpeed's hybrid engine (--enable_hybrid_engine), which
DeepSpeed's CPU accelerator cannot run ("This op had not been implemented on CPU backend"): fxzero's
run with it (Config.gather_for_generate: the same tokens, the model gathered once per generate) is
compared with DeepSpeed's run without it."""


def environment(record_dir: str, shims: str) -> dict[str, str]:
    """What every rank of either system gets: the script's data shims, the recorder, the seed."""
    env = dict(os.environ)
    paths = [os.path.join(EXAMPLES, "shims", shims), os.path.join(EXAMPLES, "record")]
    if shims == "dschat":  # (DeepSpeed-Chat's scripts import its `dschat` package, a namespace package)
        paths.append(os.path.join(EXAMPLES, "DeepSpeed-Chat"))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(FXZERO_SEED="0", FXZERO_RECORD_LOSSES=record_dir, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def launch(system: str, run: dict, workdir: str, python: str, port: int) -> dict:
    """Run one script under `system` ("deepspeed" or "fxzero"); rank 0's recorded losses and times."""
    script = os.path.join(EXAMPLES, run["script"])
    made = {"tokenizer": lambda: make_tokenizer(os.path.join(tempfile.gettempdir(), "fxzero-roberta-shaped-tokenizer")),
            "opt": lambda: make_opt_tiny(opt_tiny.directory_for("opt", tempfile.gettempdir())),
            "opt125m": lambda: make_opt_tiny(opt_tiny.directory_for("opt125m", tempfile.gettempdir()), width=768,
                                             layers=12, heads=12, positions=2048),
            "critic": lambda: opt_tiny.make_opt_tiny_critic(opt_tiny.directory_for("critic", tempfile.gettempdir()),
                                                            make_opt_tiny(opt_tiny.directory_for("opt", tempfile.gettempdir())))}
    made = {key: make() for key, make in made.items() if any("{" + key + "}" in a for a in run["args"])}
    args = [a.format(workdir=workdir, **made) for a in run["args"]]
    env = {**environment(workdir, run["shims"]), **run.get("env", {})}
    if system == "fxzero":
        cmd = [python, "-m", "fxzero.cli", "run", f"--num_gpus={run['nproc']}", f"--master_port={port}"]
    elif run.get("launcher") == "deepspeed":  # (the script takes --local_rank, which DeepSpeed's launcher passes)
        cmd = [python, "-m", "deepspeed.launcher.runner", f"--num_gpus={run['nproc']}", f"--master_port={port}"]
    else:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={run['nproc']}", f"--master_port={port}"]
    proc = subprocess.run([*cmd, script, *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} {run['script']} {' '.join(run['args'])} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    with open(os.path.join(workdir, "rank0.json")) as f:
        result = json.load(f)
    if run.get("saves"):
        result["saved"] = {}
        for path in run["saves"]:  # (keys "<file's folder>/<tensor>" where a run saves several models)
            prefix = "" if len(run["saves"]) == 1 else os.path.basename(os.path.dirname(path)) + "/"
            saved = saved_norms(os.path.join(workdir, path), made["opt"])
            result["saved"].update({prefix + key: value for key, value in saved.items()})
    return result


def saved_norms(path: str, pretrained: str) -> dict[str, list]:
    """For every tensor of the model file a script saved (a torch.save'd state dict): its L2 norm,
    and how far training moved it, the norm of its difference from the pretrained tensor of that
    name in the saved one's dtype (DeepSpeed-Chat's reward model holds the base model as
    `rwtransformer.`), or None where the pretrained model has none (the reward model's value head)."""
    import torch
    from safetensors.torch import load_file

    state = torch.load(path, map_location="cpu", weights_only=True)
    initial = load_file(os.path.join(pretrained, "model.safetensors"))
    out = {}
    for key, value in sorted(state.items()):
        start = initial.get(key.replace("rwtransformer.", "model.", 1))
        moved = float((value.double() - start.to(value.dtype).double()).norm()) if start is not None else None
        out[key] = [float(value.double().norm()), moved]
    return out


def moved_norm(saved: dict[str, list]) -> float:
    """How far training moved the whole saved model (`saved_norms`), over the tensors it started from."""
    return sum(moved ** 2 for _, moved in saved.values() if moved is not None) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", required=True, help="a Python with deepspeed==0.19.8 and torch")
    parser.add_argument("--fxzero-python", default=sys.executable)
    parser.add_argument("--runs", default="cifar-stage0-fp32-2,cifar-stage3-fp32-2,cifar-stage0-fp32-1,"
                        "cifar-stage3-bf16-2", help="comma-separated names: " + ", ".join(RUNS))
    parser.add_argument("--write", help="store DeepSpeed's losses here (the test's reference), beside the runs "
                        "the file holds already")
    args = parser.parse_args()
    reference = {}
    for i, name in enumerate(args.runs.split(",")):
        run = RUNS[name]
        out = {"run": name, "script": run["script"], "args": run["args"], "nproc": run["nproc"]}
        ds_name = run.get("compared_with", name)  # (what DeepSpeed runs: without what it cannot run here)
        for system, python in (("deepspeed", args.deepspeed_python), ("fxzero", args.fxzero_python)):
            with tempfile.TemporaryDirectory() as workdir:
                out[system] = launch(system, RUNS[ds_name] if system == "deepspeed" else run, workdir, python,
                                     29600 + 2 * i + (system == "fxzero"))
        ds, fx = out["deepspeed"]["losses"], out["fxzero"]["losses"]
        out["steps"] = len(ds)
        out["max_abs_loss_difference"] = max(abs(a - b) for a, b in zip(ds, fx)) if len(ds) == len(fx) else None
        for system in ("deepspeed", "fxzero"):
            times = out[system]["step_s"][1:]  # (the first step compiles, or warms caches)
            out[f"{system}_median_step_s"] = statistics.median(times) if times else None
        if "saved" in out["deepspeed"]:
            out["saved_moved_norms"] = {system: moved_norm(out[system]["saved"]) for system in ("deepspeed", "fxzero")}
        print(json.dumps(out), flush=True)
        reference[ds_name] = {"args": RUNS[ds_name]["args"], "nproc": run["nproc"], "losses": ds,
                           **({"saved": out["deepspeed"]["saved"]} if "saved" in out["deepspeed"] else {})}
    if args.write:  # (the runs given replace theirs; the file's other runs stay)
        if os.path.exists(args.write):
            with open(args.write) as f:
                reference = {**json.load(f)["runs"], **reference}
        with open(args.write, "w") as f:
            json.dump({"deepspeed": "0.19.8", "note": "rank 0's per-step losses under DeepSpeed on its CPU "
                       "accelerator (and the norms of the model a script saved), written by "
                       "tools/deepspeed_examples.py", "runs": reference}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TRL's trainers with a DeepSpeed config, under DeepSpeed 0.19.8 and, unchanged, under `fxzero run`.

    python tools/trl_check.py --deepspeed-python .venv-bench/bin/python --trl-path DIR [--runs dpo-zero3,...]

Each run starts tools/trl_train.py (TRL's DPOTrainer, GRPOTrainer, RLOOTrainer, SFTTrainer,
RewardTrainer, or the experimental ORPO, online DPO and GKD trainers, on tools/hf_trainer.py's
small Llama, as TRL's users write it) on 2 CPU ranks, once with DeepSpeed on its CPU accelerator (launched by torchrun) and once with `fxzero run`,
and prints one JSON object per run: the largest relative difference of each logged value over
the steps (loss, grad_norm, rewards, log-probabilities, ...; `FLOOR` below), and of the saved
model's weights (each tensor's sum, against its norm, and sum of squares).

TRL and `datasets` are not among the project's packages: TRL 1.16 asks for datasets >= 4.7, whose
dataset fingerprinting fails with this environment's packages (a PicklingError on pyarrow's
MonthDayNano), while datasets 4.0 runs TRL 1.16 here. Install them aside, without their
dependencies (the environments have the rest), and give the folder with `--trl-path`, added to
both Pythons' PYTHONPATH:

    .venv/bin/pip install --target /tmp/trl --no-deps trl==1.16.0
    .venv/bin/pip install --target /tmp/trl --no-deps datasets==4.0.0 dill==0.3.8 pyarrow==21.0.0 \
        multiprocess==0.70.16 pandas==3.1.1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_trainer import free_port, save_pretrained_model  # noqa: E402

RUNS: dict[str, list[str]] = {
    # DPO at ZeRO-3, the reference log-probabilities precomputed before training (TRL hashes the
    # model's state_dict() before initialize, then runs them through a second, inference engine of the
    # same model); TRL's fused LM-head loss reads each parameter's ds_status inside the forward.
    "dpo-zero3-precompute": ["--trainer", "dpo", "--zero_stage", "3", "--precompute_ref_log_probs"],
    # DPO at ZeRO-3, the reference a copy made by TRL in zero.Init, with LoRA (PEFT) on q and v.
    "dpo-zero3-lora": ["--trainer", "dpo", "--zero_stage", "3", "--lora"],
    # ... TR-DPO: every 2 steps the reference becomes the mean of itself and the policy, written on rank 0
    # inside GatheredParameters(both models' parameters, modifier_rank=0) (SyncRefModelCallback).
    "dpo-zero3-sync-reference": ["--trainer", "dpo", "--zero_stage", "3", "--sync_ref_model"],
    # ... at ZeRO-2 (the reference at stage 0), gradient checkpointing and 2 micro-steps.
    "dpo-zero2-checkpointing-accumulation": ["--trainer", "dpo", "--zero_stage", "2", "--gradient_checkpointing",
                                             "--gradient_accumulation_steps", "2"],
    # GRPO at ZeRO-3: generation inside GatheredParameters(model.parameters()) with DeepSpeed's hooks
    # removed and put back (optimizer.parameter_offload), sampling from the global RNG.
    "grpo-zero3": ["--trainer", "grpo", "--zero_stage", "3"],
    # ... parameters and optimizer states offloaded (DeepSpeedCPUAdam), gradient checkpointing.
    "grpo-zero3-offload-checkpointing": ["--trainer", "grpo", "--zero_stage", "3", "--offload",
                                         "--gradient_checkpointing"],
    "rloo-zero3": ["--trainer", "rloo", "--zero_stage", "3"],
    "sft-zero3": ["--trainer", "sft", "--zero_stage", "3"],
    # TRL's experimental trainers: ORPO (no reference), online DPO (a reference engine, generation and a
    # reward function), GKD (a teacher engine, on-policy generation half the time).
    "orpo-zero3": ["--trainer", "orpo", "--zero_stage", "3"],
    "online-dpo-zero3": ["--trainer", "online_dpo", "--zero_stage", "3"],
    "gkd-zero3": ["--trainer", "gkd", "--zero_stage", "3"],
    "reward-zero3": ["--trainer", "reward", "--zero_stage", "3"],
}
"""name -> tools/trl_train.py's arguments."""

_TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}


def launch(system: str, python: str, workdir: str, model: str, trl_path: str, args: list[str]) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (trl_path, os.environ.get("PYTHONPATH")) if p)}
    launcher = ["-m", "fxzero.cli", "run", "--num_gpus=2"] if system == "fxzero" else \
        ["-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd = [python, *launcher, f"--master_port={free_port()}", os.path.join(HERE, "trl_train.py"), "--model", model,
           "--output_dir", workdir, *args]
    for attempt in range(2 if system == "deepspeed" else 1):  # (tools/hf_trainer.py: DeepSpeed's CPU ranks
        # now and then abort at exit after training: run again)
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode == 0:
            break
    found = {tag: json.loads(line[len(tag) + 1:]) for line in proc.stdout.splitlines()
             for tag in ("TRAINER_LOG", "FINGERPRINT") if line.startswith(tag + " ")}
    if proc.returncode != 0 or len(found) != 2:
        raise RuntimeError(f"{system} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {"log": found["TRAINER_LOG"], "fingerprint": found["FINGERPRINT"]}


FLOOR = 1e-4
"""Values smaller than this are compared absolutely: RLOO's and GRPO's losses are sums of
advantages that cancel to about 1e-8, rounding noise on which a relative difference means nothing."""


def differences(a: dict, b: dict) -> dict[str, float]:
    """The largest difference of each logged value over the steps, relative to max(|value|,
    FLOOR); and of the saved model's tensors: their sums' relative to the tensor's norm, their
    sums of squares' relative to themselves."""
    out: dict[str, float] = {}
    for x, y in zip(a["log"], b["log"]):
        for key in x.keys() & y.keys() - _TIMING:
            out[key] = max(out.get(key, 0.0), abs(x[key] - y[key]) / max(abs(x[key]), FLOOR))
    out["weights"] = max(max(abs(sa - sb) / max(qa, 1e-30) ** 0.5, abs(qa - qb) / max(qa, 1e-30))
                         for (sa, qa), (sb, qb) in ((a["fingerprint"][k], b["fingerprint"][k]) for k in a["fingerprint"]))
    return {k: float(f"{v:.2g}") for k, v in sorted(out.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", required=True, help="a Python with DeepSpeed 0.19.8 and accelerate")
    parser.add_argument("--fxzero-python", default=sys.executable)
    parser.add_argument("--trl-path", required=True, help="a folder holding trl and datasets (see above)")
    parser.add_argument("--runs", default=",".join(RUNS))
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_pretrained_model(os.path.join(tmp, "pretrained"))
        for name in opts.runs.split(","):
            results = {}
            for system, python in (("deepspeed", opts.deepspeed_python), ("fxzero", opts.fxzero_python)):
                workdir = os.path.join(tmp, system, name)
                os.makedirs(workdir)
                results[system] = launch(system, os.path.abspath(python), workdir, model,
                                         os.path.abspath(opts.trl_path), RUNS[name])
            ds, fx = results["deepspeed"], results["fxzero"]
            print(json.dumps({"run": name, "steps": sum("loss" in e for e in ds["log"]),
                              "losses": [round(e["loss"], 6) for e in ds["log"] if "loss" in e],
                              "max_difference": differences(ds, fx)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

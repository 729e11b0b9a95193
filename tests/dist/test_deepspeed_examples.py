"""DeepSpeedExamples' scripts run unchanged under `fxzero run` and train as DeepSpeed 0.19.8 does.

`training/cifar/cifar10_deepspeed.py` and `training/HelloDeepSpeed/train_bert_ds.py`, byte for
byte as upstream (tests/deepspeed_examples/, their data sources replaced by synthetic data of the
same shapes through a `torchvision` or a `datasets` on PYTHONPATH, and an offline tokenizer of
roberta-base's shape passed with the script's own --tokenizer), launched by `fxzero run` on 2 CPU
ranks and on 1: the per-step losses of rank 0 over 20 steps (HelloDeepSpeed: its first 10) against
DeepSpeed's own, recorded on its CPU accelerator by tools/deepspeed_examples.py
(tests/deepspeed_examples/deepspeed_losses.json; no DeepSpeed is needed here). fp32 within 1e-4 (the issue's bar); bf16 within one bf16 ulp of the
loss (2.3 for cifar, 10.8 for HelloDeepSpeed, whose dtype is bf16 or fp16 only). HelloDeepSpeed
pads each batch to its longest row and selects the masked positions with `torch.nonzero` and
`index_select` in its forward; it saves checkpoints through its own --checkpoint_every and resumes
through its --load_checkpoint_dir.

DeepSpeed-Chat's three training steps (`applications/DeepSpeed-Chat`, its `dschat` package and
the steps' `main.py`, byte for byte; Dahoas/rm-static and facebook/opt replaced by synthetic rows
and offline OPT directories of the same shapes): their losses, and the models each saves at its
end, against DeepSpeed's.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.dist.harness import free_port

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))
import deepspeed_examples  # noqa: E402  (tools/deepspeed_examples.py: the runs and their environment)

pytestmark = pytest.mark.timeout(600)

with open(os.path.join(deepspeed_examples.EXAMPLES, "deepspeed_losses.json")) as _f:
    REFERENCE = json.load(_f)["runs"]

TOLERANCE = {("cifar", "fp32"): 1e-4, ("cifar", "bf16"): 2 ** -6,  # (bf16: the spacing of values in [2, 4))
             ("hello", "bf16"): 2 ** -4,  # (and in [8, 16))
             ("dschat", "bf16"): 2 ** -6}  # (four spacings in [0.5, 1), the reward model's losses; measured 3)


def _reference(name: str) -> dict:
    """DeepSpeed's run `name` is compared with: its own, or that of the run it differs from only in
    what DeepSpeed cannot run here (`compared_with`: DeepSpeed-Chat's hybrid engine)."""
    run = deepspeed_examples.RUNS[name]
    reference = REFERENCE[run.get("compared_with", name)]
    extra = [a for a in run["args"] if a not in reference["args"]]
    assert [a for a in run["args"] if a not in extra] == reference["args"], "recorded with these arguments"
    assert extra == (["--enable_hybrid_engine"] if "compared_with" in run else []), extra
    return reference


def _compare(name: str, got: list[float], steps: int = 20) -> None:
    """Rank 0's first `steps` losses against DeepSpeed's (recorded over `steps` or more)."""
    run = deepspeed_examples.RUNS[name]
    want = _reference(name)["losses"][:steps]
    assert len(_reference(name)["losses"]) >= steps and len(got) == len(want) == steps
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= TOLERANCE[run["shims"], run["args"][run["args"].index("--dtype") + 1]], (name, worst, got, want)
    assert len(set(want)) >= 3, "the reference is a real run (its losses vary step to step)"


@pytest.mark.parametrize("name", ["cifar-stage0-fp32-2", "cifar-stage3-fp32-1", "cifar-stage3-bf16-2"])
def test_cifar_script_unchanged_trains_as_deepspeed_does(name, tmp_path):
    run = deepspeed_examples.RUNS[name]
    _compare(name, deepspeed_examples.launch("fxzero", run, str(tmp_path), sys.executable, free_port())["losses"])


def test_hello_deepspeed_unchanged_trains_as_deepspeed_does_and_resumes_from_its_own_checkpoint(tmp_path):
    """HelloDeepSpeed on 2 ranks: the losses of DeepSpeed's run over its first 10 steps; then the
    script's --checkpoint_every saved steps 5 and 10 (engine.save_checkpoint with its client_state
    {'checkpoint_step': step}), and --load_checkpoint_dir resumes from the latest (the client_state
    gives the step to continue from), saving again at its end.

    10 steps of the 20 recorded (--num_iterations 11, --checkpoint_every 5): the script's learning
    rate is constant and its data do not depend on either flag, so DeepSpeed's first 10 losses are
    those of its 20-step run. (Each step's bf16 matmuls against the 50,265-token vocabulary take
    about a second on a CPU without AVX-512; the other half of the test is start-up and compile.)"""
    run = deepspeed_examples.RUNS["hello-bf16-2"]
    args = list(run["args"])
    args[args.index("--num_iterations") + 1] = "11"
    args[args.index("--checkpoint_every") + 1] = "5"
    first = deepspeed_examples.launch("fxzero", {**run, "args": args}, str(tmp_path), sys.executable, free_port())
    _compare("hello-bf16-2", first["losses"], steps=10)
    # (The script names its experiment directory by the second each rank reaches it, so ranks can
    # disagree; every rank's shards are saved under rank 0's, which the checkpoint's `latest` marks.)
    (experiment,) = [d for d in (tmp_path / "ck").iterdir() if (d / "latest").exists()]
    assert (experiment / "latest").read_text().strip() == "global_step10"
    i = args.index("--checkpoint_dir")
    args[i:i + 2] = ["--load_checkpoint_dir", str(experiment)]
    args[args.index("--num_iterations") + 1] = "16"
    resumed = deepspeed_examples.launch("fxzero", {**run, "args": args}, str(tmp_path), sys.executable, free_port())
    # The script's last save records the step its loop broke at (11) as `checkpoint_step`, so the
    # resumed run takes steps 12..15 (as under DeepSpeed), and saves once more at its end.
    assert len(first["losses"]) == 10 and len(resumed["losses"]) == 4
    assert (experiment / "latest").read_text().strip() == "global_step14"


NORM_TOLERANCE, MOVED_TOLERANCE = 0.005, 0.01
"""How far fxzero's saved model may be from DeepSpeed's (`_compare_saved`), relative. Measured
(tools/deepspeed_examples.py): the norms within 0.15% (the reward model; the others within 0.06%),
the distance moved within 0.12% (the reward model; the others within 0.06%)."""


def _compare_saved(name: str, got: dict[str, list]) -> None:
    """The model files the script saved at its end against DeepSpeed's: the same tensors, the norm of
    each within NORM_TOLERANCE of DeepSpeed's (relative, or to a twentieth of the whole model's norm
    for the small ones), and the distance training moved the whole model from its pretrained
    weights within MOVED_TOLERANCE of DeepSpeed's: a model saved untrained moved 0, one trained at
    half the rate about half as far. (The pretrained weights are bf16 values, so both systems'
    fp32 masters start alike: tests/deepspeed_examples/opt_tiny.py.)"""
    want = _reference(name)["saved"]
    assert sorted(got) == sorted(want)
    whole = sum(norm ** 2 for norm, _ in want.values()) ** 0.5
    for key, (norm, _) in want.items():
        assert abs(got[key][0] - norm) <= NORM_TOLERANCE * max(norm, 0.05 * whole), (key, got[key][0], norm)
    moved, want_moved = deepspeed_examples.moved_norm(got), deepspeed_examples.moved_norm(want)
    assert want_moved > 0 and abs(moved - want_moved) <= MOVED_TOLERANCE * want_moved, (moved, want_moved)


@pytest.mark.parametrize("name", ["dschat-sft-stage3-lora-bf16-2", "dschat-reward-stage2-bf16-2",
                                  "dschat-rlhf-actor-stage3-ema-hybrid-bf16-2",
                                  "dschat-rlhf-actor-stage3-lora-hybrid-bf16-2"])
def test_deepspeed_chat_unchanged_trains_and_saves_the_models_deepspeed_does(name, tmp_path):
    """DeepSpeed-Chat's three steps on 2 ranks, their scripts unchanged: step 1 (supervised
    fine-tuning; here at ZeRO-3 with LoRA on the decoder layers, only the adapters trained, gradient
    checkpointing, accumulation 2 and the loss in fp32), step 2 (the reward model, whose forward
    picks each row's last scored token in Python: fxzero runs it eagerly) and step 3 (PPO: the actor
    at ZeRO-3 generating its answers with `module.generate(synced_gpus=True)`, a reference model and an
    EMA copy as ZeRO-3 engines without an optimizer, the critic and the reward model at ZeRO-2 and 0,
    five engines in one process; with its --enable_hybrid_engine, which fxzero reads as
    Config.gather_for_generate and DeepSpeed cannot run on its CPU accelerator, against DeepSpeed's
    run without it: the same tokens are generated either way; and as its run_1.3b_lora.sh, with LoRA
    on both models, gradient checkpointing on both and the reference model offloaded). Rank 0's losses (step 3: the actor's and the critic's, in turn)
    within the bf16 tolerance of DeepSpeed's, and the models each saves at its end (at ZeRO-3
    through its save_zero_three_model, which gathers every parameter with GatheredParameters; LoRA
    fused back into the linear layers first) those DeepSpeed's run saved, tensor by tensor."""
    got = deepspeed_examples.launch("fxzero", deepspeed_examples.RUNS[name], str(tmp_path), sys.executable,
                                    free_port())
    _compare(name, got["losses"], steps=len(_reference(name)["losses"]))
    _compare_saved(name, got["saved"])

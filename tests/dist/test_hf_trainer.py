"""Hugging Face's Trainer with `--deepspeed ds.json`, unchanged under `fxzero run`, trains as under DeepSpeed 0.19.8.

tests/hf_trainer/train_clm.py is a Trainer script as its users write it (HfArgumentParser over
TrainingArguments; accelerate drives the engine: `set_gradient_accumulation_boundary`,
`backward(loss, scale_wrt_gas=False)`, `step()` at the boundary, `save_model`, the checkpoint and
its resume). tools/hf_trainer.py runs it on 2 CPU ranks under DeepSpeed on its CPU accelerator
and records rank 0's Trainer log and the fingerprint of the model `save_model` wrote
(tests/hf_trainer/deepspeed_reference.json); here it runs under `fxzero run` and is compared:

- ZeRO-3 with the optimizer and schedule in the config, Trainer's evaluation every 2 steps (the
  engine's forward under no_grad, in eval mode), the 16-bit weights gathered at save;
- ZeRO-2 with Trainer's own optimizer (torch's fused AdamW, weight decay in one group), its linear
  schedule and two micro-steps per update, the module's state dict saved;
- ZeRO-3 with optimizer states and parameters offloaded to host memory, Trainer's optimizer (which
  accelerate turns into DeepSpeedCPUAdam) and Trainer's gradient checkpointing;
- accelerate's own loop (no Trainer; tests/hf_trainer/train_accelerate.py): ZeRO-3 with the
  config's optimizer through DummyOptim/DummyScheduler, `accelerator.accumulate` over 2
  micro-batches, the model saved with `get_state_dict`, the state with `save_state`;
- ZeRO-3 from `from_pretrained` (built in zero.Init, the checkpoint loaded through
  GatheredParameters on rank 0), a checkpoint at step 2, and Trainer's resume from it;
- the same model evaluated alone (`trainer.evaluate()`, DeepSpeed started for inference);
- PEFT's LoRA (`get_peft_model`) on a `from_pretrained` model at ZeRO-3, its adapters alone saved;
- DeepSpeed-Chat's supervised fine-tuning, its way (tests/hf_trainer/train_sft.py): from_pretrained
  and resize_token_embeddings at ZeRO-3 before initialize, LoRA layers swapped in, a client
  FusedAdam (or DeepSpeedCPUAdam, offloading) with transformers' cosine schedule, dropout, LoRA
  fused under GatheredParameters and the model saved by its ZeRO-3 gather loop after rank 0
  alone took the module's state dict; at ZeRO-3 with LoRA, with only LoRA trained and states
  offloaded and gradient checkpointing, at ZeRO-2, and DeepSpeed-Chat's DPO at ZeRO-3 (a second
  engine in the process, the frozen reference with no optimizer); and its reward model at ZeRO-2
  and ZeRO-3, whose forward walks its rows in Python and runs eagerly (at ZeRO-3 compared with
  DeepSpeed's ZeRO-2 run: DeepSpeed's own ZeRO-3 fails there).

Losses within 1e-5 of DeepSpeed's (they have been equal to the last bit), gradient norms and the
saved weights' sums within 1e-5 relative (DeepSpeedCPUAdam's kernel rounds differently from
fxzero's AdamW: 1.7e-6); the saved weights are checked to have moved from the
initial ones, so an untrained model saved cannot pass.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import hf_trainer  # noqa: E402  (tools/hf_trainer.py: the runs, their launch and the fingerprint)

pytestmark = pytest.mark.timeout(900)

with open(hf_trainer.REFERENCE) as _f:
    REFERENCE = json.load(_f)["runs"]


def _close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * max(abs(want), 1e-12)


def _compare(name: str, got: dict) -> None:
    want = REFERENCE[name]
    assert [h["step"] for h in got["log"]] == [h["step"] for h in want["log"]], name
    for g, w in zip(got["log"], want["log"]):
        assert g.keys() == w.keys() and abs(g["loss"] - w["loss"]) <= 1e-5, (name, g, w)
        if "grad_norm" in w:  # (Trainer logs these; accelerate's loop, its learning rates apart)
            assert _close(g["grad_norm"], w["grad_norm"], 1e-5), (name, g, w)
            assert _close(g["learning_rate"], w["learning_rate"], 1e-9), (name, g, w)
    assert all(_close(g, w, 1e-9) for g, w in zip(got.get("lrs", []), want.get("lrs", []))), name
    for key in ("leaf_modules", "leaf_parameters"):  # (accelerate's MoE run: set_z3_leaf_modules' flags)
        assert got.get(key) == want.get(key), (name, key, got.get(key), want.get(key))
    assert not want["log"] or len({h["loss"] for h in want["log"]}) >= 3, "the reference is a real run (its losses vary)"
    assert [h["step"] for h in got["eval"]] == [h["step"] for h in want["eval"]], name
    assert all(abs(g["eval_loss"] - w["eval_loss"]) <= 1e-5 for g, w in zip(got["eval"], want["eval"])), name
    if "fingerprint" in want:
        assert got["fingerprint"].keys() == want["fingerprint"].keys()
        for key, (total, squares) in want["fingerprint"].items():
            got_total, got_squares = got["fingerprint"][key]
            assert _close(got_squares, squares, 1e-5), (name, key)
            # (a sum near 0 is all cancellation: held to the tensor's scale, its norm, where that is larger)
            assert abs(got_total - total) <= 1e-5 * max(abs(total), squares ** 0.5), (name, key)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return hf_trainer.save_pretrained_model(str(tmp_path_factory.mktemp("pretrained")))


def _initial_fingerprint(tmp_path) -> dict:
    """The fingerprint of the model train_clm.py builds from its config, untrained."""
    import torch
    from transformers import LlamaForCausalLM

    sys.path.insert(0, hf_trainer.HERE)
    from train_clm import small_llama

    torch.manual_seed(0)
    LlamaForCausalLM(small_llama()).save_pretrained(str(tmp_path / "initial"))
    return hf_trainer.fingerprint(str(tmp_path / "initial"))


@pytest.mark.parametrize("name", ["zero3-config-optimizer", "zero2-trainer-optimizer-accumulation",
                                  "zero3-offload-checkpointing", "accelerate-zero3-accumulation"])
def test_trainer_trains_and_saves_the_model_as_deepspeed(name, tmp_path, pretrained):
    got = hf_trainer.launch("fxzero", name, str(tmp_path), sys.executable, pretrained)
    _compare(name, got)
    initial = _initial_fingerprint(tmp_path)
    moved = max(abs(a - b) / abs(b) for k in initial for a, b in zip(got["fingerprint"][k], initial[k]) if b)
    assert moved > 1e-3, "the saved model is the trained one, not the initial one"


def test_accelerate_flags_the_experts_blocks_as_zero3_leaves_as_deepspeed(tmp_path, pretrained):
    """accelerate's mixture-of-experts path (`transformer_moe_cls_names`) imports
    `deepspeed.utils.set_z3_leaf_modules` and flags each Mixtral sparse block (an ImportError
    before): the losses, the saved model, and which modules and parameters are leaves, as DeepSpeed's."""
    got = hf_trainer.launch("fxzero", "accelerate-zero3-moe", str(tmp_path), sys.executable, pretrained)
    _compare("accelerate-zero3-moe", got)
    assert (got["leaf_modules"], got["leaf_parameters"]) == (2, 6)  # (a block a layer: its router, its experts' 2)


def test_from_pretrained_at_zero3_checkpoints_and_resumes_as_deepspeed(tmp_path, pretrained):
    first = hf_trainer.launch("fxzero", "zero3-pretrained-checkpoint", str(tmp_path), sys.executable, pretrained)
    _compare("zero3-pretrained-checkpoint", first)  # (step 1's loss: the pretrained weights were loaded)
    assert os.path.isdir(tmp_path / "out" / "checkpoint-2" / "global_step2")  # where Trainer's resume looks
    resumed = hf_trainer.launch("fxzero", "zero3-pretrained-resume", str(tmp_path), sys.executable, pretrained)
    _compare("zero3-pretrained-resume", resumed)
    assert resumed["log"][2:] == first["log"][2:], "steps 3 and 4 after the resume are the uninterrupted run's"


def test_evaluation_alone_from_pretrained_at_zero3(tmp_path, pretrained):
    """`trainer.evaluate()` with no training: Trainer starts DeepSpeed for inference, with no optimizer
    and the training config's scheduler still in it (its steps set to 0), which DeepSpeed never
    builds without an optimizer, nor does fxzero now (it warns once)."""
    got = hf_trainer.launch("fxzero", "zero3-pretrained-evaluate-only", str(tmp_path), sys.executable, pretrained)
    _compare("zero3-pretrained-evaluate-only", got)
    assert got["log"] == [] and len(got["eval"]) == 1


def test_peft_lora_on_a_pretrained_model_at_zero3_trains_checkpoints_and_resumes_as_deepspeed(tmp_path, pretrained):
    """`get_peft_model` on a model from `from_pretrained` at ZeRO-3, before Trainer: PEFT builds its
    adapters on the base weights' device beside the zero.Init model ([Note: parameters made beside
    a held model] in fxzero/zero.py), with dropout; only they train, and `save_model` writes them
    alone (their initial values are the holder's draws, the same as DeepSpeed's every rank draws).
    Trainer checkpoints them every 2 steps with `save_checkpoint(exclude_frozen_parameters=True)`
    and resumes from step 2 with `load_checkpoint(load_module_strict=False)` ([Note: a checkpoint
    without the frozen parameters]), as under DeepSpeed: the steps after the resume, and the
    adapters saved at the end, are the uninterrupted run's."""
    pytest.importorskip("peft")
    first = hf_trainer.launch("fxzero", "zero3-pretrained-peft-lora-checkpoint", str(tmp_path), sys.executable,
                              pretrained)
    _compare("zero3-pretrained-peft-lora-checkpoint", first)
    assert first["fingerprint"] and all("lora_" in k for k in first["fingerprint"])
    assert all(abs(v[0]) > 1e-4 for k, v in first["fingerprint"].items() if "lora_B" in k)  # (zeros at the start)
    with open(tmp_path / "out" / "checkpoint-2" / "global_step2" / "fxzero.json") as f:
        left_out = json.load(f)["excluded_frozen"]
    assert left_out and not any("lora_" in name for name in left_out)  # (the base model is not saved again)
    resumed = hf_trainer.launch("fxzero", "zero3-pretrained-peft-lora-resume", str(tmp_path), sys.executable,
                                pretrained)
    _compare("zero3-pretrained-peft-lora-resume", resumed)
    assert resumed["log"][2:] == first["log"][2:], "steps 3 and 4 after the resume are the uninterrupted run's"
    assert resumed["fingerprint"] == first["fingerprint"]


@pytest.mark.parametrize("name", ["sft-zero3-lora", "sft-zero3-lora-only-offload-checkpointing", "sft-zero2",
                                  "sft-zero3-dpo-reference"])
def test_deepspeed_chat_style_fine_tuning_trains_and_saves_as_deepspeed(name, tmp_path, pretrained):
    """tests/hf_trainer/train_sft.py, DeepSpeed-Chat's supervised fine-tuning written its way: the
    losses (dropout on), learning rates and perplexities DeepSpeed's, the file its save loop wrote
    DeepSpeed's (LoRA fused into the weights), and the engine's throughput timer counting."""
    got = hf_trainer.launch("fxzero", name, str(tmp_path), sys.executable, pretrained)
    _compare(name, got)
    assert got["epochs"] == 1 and 0 < got["samples_per_sec"] < float("inf")
    initial = hf_trainer.fingerprint(pretrained)
    moved = max(abs(got["fingerprint"][k][1] - initial[k][1]) / initial[k][1] for k in initial
                if "embed" not in k and "lm_head" not in k)  # (the resized two have other shapes)
    assert moved > 1e-3, "the saved model is the fine-tuned one (LoRA fused in), not the pretrained one"


def test_deepspeed_chat_style_reward_model_trains_eagerly_as_deepspeed(tmp_path, pretrained):
    """train_sft.py --reward, DeepSpeed-Chat's reward model written its way, at ZeRO-2: its loss
    walks the batch's rows in Python (each row's end found with `nonzero().item()`), a forward no
    trace can follow, which fxzero runs eagerly ([Note: gradients from outside the program]). The
    losses, the scores and the accuracy before and after, and the saved weights are DeepSpeed's."""
    name = "sft-zero2-reward"
    got = hf_trainer.launch("fxzero", name, str(tmp_path), sys.executable, pretrained)
    _compare(name, got)
    for g, w in zip(got["eval"], REFERENCE[name]["eval"]):
        assert g["acc"] == w["acc"] and abs(g["chosen"] - w["chosen"]) <= 1e-5, (g, w)
    initial = hf_trainer.fingerprint(pretrained)
    moved = max(abs(got["fingerprint"]["rwtransformer." + k[len("model."):]][1] - initial[k][1]) / initial[k][1]
                for k in initial if k.startswith("model.") and "embed" not in k)
    assert moved > 1e-3, "the saved model is the trained one"


def test_the_reward_model_at_zero3_gathers_every_unit_for_its_eager_forward(tmp_path, pretrained):
    """The same at ZeRO-3: fxzero gathers every unit for the forward no trace can follow and holds
    them until its backward ends ([Note: a forward run eagerly at ZeRO-3]); the losses, scores and
    accuracy are DeepSpeed's ZeRO-2 run's (DeepSpeed's own ZeRO-3 fails there on its CPU
    accelerator), and the weights saved from `state_dict()` on every rank too."""
    got = hf_trainer.launch("fxzero", "sft-zero3-reward", str(tmp_path), sys.executable, pretrained)
    _compare("sft-zero2-reward", got)
    for g, w in zip(got["eval"], REFERENCE["sft-zero2-reward"]["eval"]):
        assert g["acc"] == w["acc"] and abs(g["chosen"] - w["chosen"]) <= 1e-5, (g, w)

"""tools/deepspeed_config_parity.py without DeepSpeed: how it adapts a config, and its training
program under `fxzero run` on 2 ranks (what it compares against DeepSpeed's run of the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tools.deepspeed_config_parity import CONFIGS, _has_auto, adapt, launch

pytestmark = pytest.mark.timeout(300)


def test_a_config_keeps_everything_but_its_batch_sizes_and_nvme_paths(tmp_path):
    config = {"train_batch_size": 256, "gradient_accumulation_steps": 8, "optimizer": {"type": "Adam"},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}}
    out = adapt(config, str(tmp_path))
    assert out["train_micro_batch_size_per_gpu"] == 2 and out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 2 * 2 * 2
    assert out["zero_optimization"]["offload_param"] == {"device": "nvme", "nvme_path": str(tmp_path)}
    assert out["optimizer"] == {"type": "Adam"} and config["zero_optimization"]["offload_param"]["nvme_path"] == "/local_nvme"
    assert _has_auto({"optimizer": {"params": {"lr": "auto"}}}) and not _has_auto(out)


def test_the_training_program_runs_a_committed_config_under_fxzero(tmp_path):
    config = json.loads((CONFIGS / "training__imagenet__config__ds_fp16_z1_config.json").read_text())
    result = launch("fxzero", sys.executable, adapt(config, str(tmp_path)), str(tmp_path), steps=3)
    assert set(result) == {"losses", "lrs"}, result
    assert len(result["losses"]) == 3 and result["lrs"] == [0.001] * 3
    assert result["losses"][0] == pytest.approx(1.6408636569976807, rel=1e-6)  # (the seeded model's first loss)

"""fxzero's table of DeepSpeed's defaults against DeepSpeed's own source, and the reader against both.

The reference is `tests/data/deepspeed-0.19.8-defaults.json`, which `tools/deepspeed_defaults.py`
extracted from DeepSpeed 0.19.8's sdist (its sha256 is in the file); this test needs neither the
sdist nor DeepSpeed. Every expected figure below is read from that file, never from fxzero's
table, so a wrong default in the table (Adam's weight decay, say) fails here.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from fxzero.config import Adagrad, Adam, AdamW, Config, Cpu, Nvme, notices
from fxzero.config.deepspeed import read_deepspeed
from fxzero.config.deepspeed_defaults import (
    _DEEPSPEED_TYPES, DEEPSPEED_VERSION, DEFAULTS, FIELD_NAMES, OPTIMIZER_DEFAULTS, OPTIMIZER_PARAM_DEFAULTS,
    deepspeed_optimizer)
from fxzero.config.deepspeed_keys import KEYS, SECTION, USED

pytestmark = pytest.mark.timeout(60)

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
SOURCE = json.loads((DATA / f"deepspeed-{DEEPSPEED_VERSION}-defaults.json").read_text())
KEYS_DS = SOURCE["keys"]


def same(a, b) -> bool:
    """Equal as JSON values, where True is not 1 and a tuple is a list."""
    if isinstance(a, tuple):
        a = list(a)
    if isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
        return type(a) is type(b) and a == b if not isinstance(a, list) else (
            isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)))
    return a == b and isinstance(a, bool) == isinstance(b, bool)


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_WARNED", set())
    monkeypatch.setattr(notices, "_PRINTED", set())


def test_the_reference_is_deepspeed_0_19_8s_sdist():
    assert SOURCE["deepspeed"] == {"sdist": "deepspeed-0.19.8.tar.gz", "version": "0.19.8",
                                   "sha256": "9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af"}
    assert SOURCE["torch"].split("+")[0] == torch.__version__.split("+")[0]  # torch.optim's defaults are this torch's


# -- the table against the source -----------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(DEFAULTS))
def test_each_default_is_deepspeeds(path):
    assert path in KEYS_DS, f"{path}: DeepSpeed {DEEPSPEED_VERSION} reads no such key with a default"
    assert same(DEFAULTS[path], KEYS_DS[path]), f"{path}: fxzero says {DEFAULTS[path]!r}, DeepSpeed {KEYS_DS[path]!r}"


def test_every_key_deepspeed_reads_is_in_the_key_table_and_the_defaults():
    # a key under one fxzero reads whole (torch_autocast.enabled under torch_autocast) is in the table
    def covered(path: str) -> bool:
        parts = path.split(".")
        return any(".".join(parts[:i]) in KEYS and KEYS[".".join(parts[:i])].kind != SECTION
                   for i in range(1, len(parts)))

    missing = [p for p in KEYS_DS if p not in KEYS and not covered(p)]
    assert not missing, f"keys DeepSpeed reads that the key table does not have: {missing}"
    no_default = [p for p in KEYS_DS if p in KEYS and p not in DEFAULTS]
    assert not no_default, f"keys DeepSpeed reads with a default that fxzero's table lacks: {no_default}"


def test_every_used_key_reads_through_the_defaults():
    without = [p for p, k in KEYS.items() if k.kind == USED and p not in DEFAULTS]
    # the two sections DeepSpeed gives no default: no "type", no optimizer; no "scheduler", none; and
    # torch_autocast's dtype (missing: the device's autocast default, which fxzero asks to be named)
    # "data_efficiency" is read whole by fxzero/config/random_ltd.py (DeepSpeed's data_pipeline defaults);
    # "activation_checkpointing.cpu_checkpointing" by fxzero/config/deepspeed.py, with the default of
    # deepspeed.checkpointing's own config (False), which the runtime's table does not hold
    # "hybrid_engine" by fxzero/config/deepspeed.py too (_HYBRID_ENGINE: DeepSpeed's HybridEngineConfig)
    assert without == ["optimizer.type", "scheduler", "torch_autocast.dtype",
                       "activation_checkpointing.cpu_checkpointing", "data_efficiency", "hybrid_engine"]
    assert SOURCE["optimizer"]["type"] is None


def test_field_names_are_deepspeeds():
    assert FIELD_NAMES == SOURCE["field_names"]


def test_unsupported_keys_honour_deepspeeds_default():
    # a config that writes out DeepSpeed's default for a feature fxzero lacks still reads
    refused = [p for p, k in KEYS.items() if k.honoured_values and p in DEFAULTS and not k.honours(DEFAULTS[p])]
    assert not refused


@pytest.mark.parametrize("cls", sorted(OPTIMIZER_DEFAULTS))
def test_each_optimizer_classs_defaults_are_its_own(cls):
    source = SOURCE["optimizers"][cls]
    for param, value in OPTIMIZER_DEFAULTS[cls].items():
        assert param in source, f"{cls} takes no {param!r}"
        assert same(value, source[param]), f"{cls}.{param}: fxzero says {value!r}, the source {source[param]!r}"


def test_the_adam_params_read_before_the_class():
    read = SOURCE["optimizer"]["params_read_before_building"]
    assert {k: read[k] for k in OPTIMIZER_PARAM_DEFAULTS} == OPTIMIZER_PARAM_DEFAULTS


def test_the_types_deepspeed_builds_itself():
    assert set(_DEEPSPEED_TYPES) == set(SOURCE["optimizer"]["deepspeed_optimizers"])
    assert deepspeed_optimizer("SGD", {}, offloaded=False) == "torch.optim.SGD"  # any other: torch.optim's
    assert deepspeed_optimizer("Lion", {}, offloaded=True) == "DeepSpeedCPULion"


# -- the reader: a missing key is DeepSpeed's default ------------------------------------------------


def _opt(ds: dict):
    return read_deepspeed(ds).fields["optimizer"]


def _as_policy(cls: str, **given):
    d = {**SOURCE["optimizers"][cls], **given}
    return dict(lr=d["lr"], betas=tuple(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"])


def test_adam_without_params_is_fused_adams_defaults():
    # the audit's case: {"type": "Adam"} trained with weight decay 0.01; DeepSpeed's FusedAdam has 0
    assert SOURCE["optimizers"]["FusedAdam"]["weight_decay"] == 0
    for kind in ("Adam", "AdamW", "adamw"):
        assert _opt({"optimizer": {"type": kind}}) == AdamW(**_as_policy("FusedAdam")), kind
    assert _opt({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}) == Adam(**_as_policy("FusedAdam"))
    assert _opt({"optimizer": {"type": "Adam", "params": {"lr": 0.5}}}) == AdamW(**_as_policy("FusedAdam", lr=0.5))


def test_offloaded_adam_is_cpu_adams_defaults():
    ds = {"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert _opt(ds) == AdamW(**_as_policy("DeepSpeedCPUAdam"))
    ds["zero_optimization"] = {"stage": 2, "cpu_offload": True}  # the deprecated spelling too
    assert _opt(ds) == AdamW(**_as_policy("DeepSpeedCPUAdam"))


def test_torch_adam_is_torchs_defaults():
    # "torch_adam": DeepSpeed builds torch.optim.AdamW, whose weight decay is 0.01
    assert SOURCE["optimizers"]["torch.optim.AdamW"]["weight_decay"] == 0.01
    assert _opt({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}) == \
        AdamW(**_as_policy("torch.optim.AdamW"))
    assert _opt({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}}) == \
        Adam(**_as_policy("torch.optim.Adam"))
    assert _opt({"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "weight_decay": 0.2}}}) == \
        AdamW(**_as_policy("torch.optim.AdamW", weight_decay=0.2))


def test_adagrad_is_torchs_or_cpu_adagrads_defaults():
    torch_ = SOURCE["optimizers"]["torch.optim.Adagrad"]
    want = Adagrad(lr=torch_["lr"], lr_decay=torch_["lr_decay"], weight_decay=torch_["weight_decay"],
                   initial_accumulator_value=torch_["initial_accumulator_value"], eps=torch_["eps"])
    assert _opt({"optimizer": {"type": "Adagrad"}}) == want
    cpu = SOURCE["optimizers"]["DeepSpeedCPUAdagrad"]
    offloaded = _opt({"optimizer": {"type": "Adagrad"}, "zero_optimization": {"stage": 1, "offload_optimizer":
                                                                               {"device": "cpu"}}})
    assert (offloaded.lr, offloaded.eps, offloaded.weight_decay) == (cpu["lr"], cpu["eps"], cpu["weight_decay"])


def test_an_empty_config_is_deepspeeds_defaults(capsys):
    assert (KEYS_DS["zero_optimization.stage"], KEYS_DS["gradient_clipping"], KEYS_DS["steps_per_print"]) == \
        (0, 1.0, None)
    cfg = Config.from_deepspeed({})
    assert cfg.stage == 1  # stage 0 runs as stage 1, said once
    assert "zero_optimization.stage 0, plain data parallelism (DeepSpeed's default" in capsys.readouterr().out
    assert cfg.gradient_clipping == KEYS_DS["gradient_clipping"] and cfg.steps_per_print is None
    assert cfg.optimizer == AdamW()  # no "optimizer" section: DeepSpeed builds none; Config's (or the client's)
    assert cfg.mixed_precision is None and cfg.dataloader_drop_last is KEYS_DS["dataloader_drop_last"]
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (None, None, None)


def test_stage_3s_defaults():
    cfg = Config.from_deepspeed({"zero_optimization": {"stage": 3}})
    assert cfg.persist_threshold == KEYS_DS["zero_optimization.stage3_param_persistence_threshold"]
    assert KEYS_DS["zero_optimization.stage3_max_reuse_distance"] > 0 and cfg.prefetch.keep_for_backward is None


def test_offload_defaults(tmp_path):
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    cfg = Config.from_deepspeed({"zero_optimization": zero})
    assert cfg.offload.params == Nvme(path=str(tmp_path),
                                      threads=KEYS_DS["zero_optimization.offload_param.buffer_count"])
    assert cfg.offload.optimizer == Nvme(path=str(tmp_path),
                                         threads=KEYS_DS["zero_optimization.offload_optimizer.buffer_count"])
    assert KEYS_DS["zero_optimization.offload_param.buffer_count"] != \
        KEYS_DS["zero_optimization.offload_optimizer.buffer_count"]  # (so a mix-up fails)
    cfg = Config.from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.offload.optimizer == Cpu(pin_memory=KEYS_DS["zero_optimization.offload_optimizer.pin_memory"])


def test_fp16_defaults():
    mp = Config.from_deepspeed({"fp16": {"enabled": True}}).mixed_precision
    scale = mp.loss_scale
    assert (scale.initial_scale_power, scale.window, scale.hysteresis, scale.min_scale, scale.static) == (
        KEYS_DS["fp16.initial_scale_power"], KEYS_DS["fp16.loss_scale_window"], KEYS_DS["fp16.hysteresis"],
        KEYS_DS["fp16.min_loss_scale"], None)
    assert KEYS_DS["fp16.loss_scale"] == 0  # (0: dynamic)


@pytest.mark.parametrize("section, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_gradients_are_reduced_in_the_compute_dtype_by_default(section, dtype):
    assert KEYS_DS["communication_data_type"] is None  # DeepSpeed: the gradients' own dtype
    mp = Config.from_deepspeed({section: {"enabled": True}}).mixed_precision
    assert mp.param_dtype is dtype and mp.grad_dtype is dtype
    mp = Config.from_deepspeed({section: {"enabled": True}, "communication_data_type": "fp32"}).mixed_precision
    assert mp.grad_dtype is torch.float32

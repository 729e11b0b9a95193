"""`Config.from_deepspeed`, key by key, and the warnings for settings that change nothing.

Every value read from a DeepSpeed config is a distinct non-default one, so a key that is
ignored (the default kept) fails its test.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest

import fxzero
from fxzero.config import AdamW, Config, Cpu, Device, Nvme, Offload, Prefetch
from fxzero.config import notices
from fxzero.config.effects import IneffectiveSetting, ineffective_settings, warn_ineffective


def _ds(**zero) -> dict:
    return {"zero_optimization": zero}


# -- from_deepspeed ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage(stage):
    assert Config.from_deepspeed(_ds(stage=stage)).stage == stage


def test_defaults_of_an_empty_config():
    cfg = Config.from_deepspeed({})
    # DeepSpeed's defaults where a key is missing: stage 0, run as stage 1 (tests/passes/test_deepspeed_defaults.py)
    assert cfg.stage == 1 and cfg.optimizer == AdamW() and cfg.persist_threshold == 0
    assert Config.from_deepspeed(_ds(stage=3)).persist_threshold == 100_000  # stage3_param_persistence_threshold
    assert cfg.offload == Offload() and cfg.prefetch == Prefetch()


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "adamw"])
def test_optimizer_params_are_read(kind):
    ds = {"optimizer": {"type": kind, "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                 "weight_decay": 0.25}}}
    opt = Config.from_deepspeed(ds).optimizer
    assert opt == AdamW(lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.25)
    # each on its own, the others at their defaults: FusedAdam's, what DeepSpeed builds (weight decay 0)
    defaults = AdamW(weight_decay=0.0)
    for key, value, field in [("lr", 0.5, "lr"), ("betas", [0.5, 0.75], "betas"), ("eps", 0.125, "eps"),
                              ("weight_decay", 0.375, "weight_decay")]:
        got = Config.from_deepspeed({"optimizer": {"type": kind, "params": {key: value}}}).optimizer
        want = tuple(value) if isinstance(value, list) else value
        assert getattr(got, field) == want, key
        for other in ("lr", "betas", "eps", "weight_decay"):
            if other != field:
                assert getattr(got, other) == getattr(defaults, other), (key, other)


def test_unsupported_optimizer_type():
    with pytest.raises(ValueError, match=r"optimizer type 'OneBitAdam' is not supported \(1-bit Adam's compressed "
                                         r"communication is not in fxzero"):
        Config.from_deepspeed({"optimizer": {"type": "OneBitAdam", "params": {"lr": 0.1}}})


def test_persistence_threshold_applies_at_stage_3_only():
    assert Config.from_deepspeed(_ds(stage=3, stage3_param_persistence_threshold=12345)).persist_threshold == 12345
    # DeepSpeed's default stage is 0, run as stage 1: no persistence threshold
    assert Config.from_deepspeed(_ds(stage3_param_persistence_threshold=777)).persist_threshold == 0
    for stage in (1, 2):
        cfg = Config.from_deepspeed(_ds(stage=stage, stage3_param_persistence_threshold=12345))
        assert cfg.persist_threshold == 0, stage
        # so it warns about nothing
        assert ineffective_settings(cfg, world_size=2, cuda=False, initialized_from_seed=True) == []


def test_reuse_distance_maps_to_keep_for_backward():
    assert Config.from_deepspeed(_ds(stage3_max_reuse_distance=0)).prefetch == Prefetch(keep_for_backward=False)
    for distance in (1, 1_000_000_000):
        cfg = Config.from_deepspeed(_ds(stage3_max_reuse_distance=distance))
        assert cfg.prefetch == Prefetch(keep_for_backward=None)
    assert Config.from_deepspeed(_ds()).prefetch.keep_for_backward is None


def test_offload_cpu():
    cfg = Config.from_deepspeed(_ds(stage=3, offload_param={"device": "cpu", "pin_memory": False},
                                    offload_optimizer={"device": "cpu", "pin_memory": True}))
    assert cfg.offload.params == Cpu(pin_memory=False)
    assert cfg.offload.optimizer == Cpu(pin_memory=True)
    # pin_memory defaults to True; "none" is the device
    cfg = Config.from_deepspeed(_ds(stage=3, offload_optimizer={"device": "CPU"}, offload_param={"device": "none"}))
    assert cfg.offload.optimizer == Cpu(pin_memory=True) and cfg.offload.params == Device()


def test_offload_nvme(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = Config.from_deepspeed(_ds(stage=3, offload_param={"device": "nvme", "nvme_path": str(a), "buffer_count": 7},
                                    offload_optimizer={"device": "nvme", "nvme_path": str(b), "buffer_count": 3}))
    assert cfg.offload.params == Nvme(path=str(a), threads=7)
    assert cfg.offload.optimizer == Nvme(path=str(b), threads=3)
    default_threads = Config.from_deepspeed(_ds(offload_optimizer={"device": "nvme", "nvme_path": str(b)}))
    assert default_threads.offload.optimizer == Nvme(path=str(b), threads=4)


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_offload_errors(key):
    with pytest.raises(ValueError, match=rf'zero_optimization\.{key}: device "nvme" needs "nvme_path"'):
        Config.from_deepspeed(_ds(**{key: {"device": "nvme"}}))
    with pytest.raises(ValueError, match=rf"zero_optimization\.{key}\.device must be \"none\", \"cpu\" or \"nvme\", "
                                         r"got 'gpu'"):
        Config.from_deepspeed(_ds(**{key: {"device": "gpu"}}))


def test_offloaded_params_need_stage_3():
    with pytest.raises(ValueError, match="needs stage=3"):
        Config.from_deepspeed(_ds(stage=2, offload_param={"device": "cpu"}))


@pytest.mark.parametrize("as_path", [str, pathlib.Path], ids=["str", "Path"])
def test_reads_a_json_file(tmp_path, as_path):
    ds = {
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.7, 0.9], "eps": 1e-7, "weight_decay": 0.05}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 4096, "stage3_max_reuse_distance": 0,
                              "offload_optimizer": {"device": "cpu", "pin_memory": False}},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    cfg = Config.from_deepspeed(as_path(path))
    assert cfg == Config(stage=3, optimizer=AdamW(lr=2e-4, betas=(0.7, 0.9), eps=1e-7, weight_decay=0.05),
                         persist_threshold=4096, prefetch=Prefetch(keep_for_backward=False),
                         offload=Offload(optimizer=Cpu(pin_memory=False)),
                         gradient_clipping=1.0,  # DeepSpeed's defaults: clipping at 1.0, no log line
                         gradient_division="before")  # (ZeRO-3's reduce-scatter divides first)
    assert Config.from_deepspeed(str(path)) == Config.from_deepspeed(ds)


# -- effects: settings that change nothing --------------------------------------------------------

CONTEXT = dict(world_size=2, cuda=False, initialized_from_seed=True)


def _messages(config: Config, **overrides) -> list[str]:
    return ineffective_settings(config, **{**CONTEXT, **overrides})


def test_the_default_config_is_all_effective():
    assert _messages(Config()) == []
    assert _messages(Config(), world_size=1, cuda=True, initialized_from_seed=False) == []


# (ineffective config, context overrides, words of its message, effective neighbour, its overrides)
CASES = {
    "persist_threshold": (
        Config(stage=2, persist_threshold=100), {},
        ["Config.persist_threshold=100 has no effect at stage 2", "it applies at stage=3"],
        Config(stage=3, persist_threshold=100), {}),
    "keep_for_backward_stage": (
        Config(stage=1, prefetch=Prefetch(keep_for_backward=True)), {},
        ["Prefetch(keep_for_backward=True) has no effect at stage 1", "it applies at stage=3"],
        Config(stage=3, prefetch=Prefetch(keep_for_backward=True)), {}),
    "keep_for_backward_offloaded": (
        Config(stage=3, prefetch=Prefetch(keep_for_backward=True), offload=Offload(params=Cpu())), {},
        ["Prefetch(keep_for_backward=True) has no effect with offloaded parameters", "leave keep_for_backward unset"],
        Config(stage=3, prefetch=Prefetch(keep_for_backward=None), offload=Offload(params=Cpu())), {}),
    "keep_host_memory": (
        Config(keep_host_memory=True), {"cuda": True},
        ["Config.keep_host_memory=True has no effect with CUDA"],
        Config(keep_host_memory=True), {"cuda": False}),
    "lookahead": (
        Config(offload=Offload(lookahead=3)), {},
        ["Offload.lookahead=3 has no effect: no state is offloaded"],
        Config(offload=Offload(optimizer=Cpu(), lookahead=3)), {}),
    "transport": (
        Config(transport="process_group"), {"world_size": 1},
        ["Config.transport='process_group' has no effect in a world of one"],
        Config(transport="process_group"), {"world_size": 2}),
    "seed": (
        Config(seed=7), {"initialized_from_seed": False},
        ["Config.seed=7 has no effect", "this model's values are given"],
        Config(seed=7), {"initialized_from_seed": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_ineffective_setting_has_its_message(case):
    config, overrides, words, effective, effective_overrides = CASES[case]
    messages = _messages(config, **overrides)
    assert len(messages) == 1, messages
    for w in words:
        assert w in messages[0], (w, messages[0])
    assert _messages(effective, **effective_overrides) == []


def test_several_ineffective_settings_give_one_message_each():
    config = Config(stage=1, persist_threshold=5, seed=3, transport="shared_memory", offload=Offload(lookahead=2))
    messages = _messages(config, world_size=1, initialized_from_seed=False)
    assert len(messages) == 4 and len(set(messages)) == 4


def test_warn_ineffective_warns_once_per_message(monkeypatch):
    monkeypatch.setattr(notices, "_WARNED", set())
    first, second = "test_config: first message (fresh)", "test_config: second message (fresh)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_ineffective([first])
        warn_ineffective([first, second])
        warn_ineffective([second, first])
    assert [(str(w.message), w.category) for w in caught] == [(first, IneffectiveSetting),
                                                               (second, IneffectiveSetting)]
    assert issubclass(IneffectiveSetting, UserWarning)


def test_compile_warns_about_an_ineffective_setting(monkeypatch):
    """fxzero.compile hands its config's messages to warn_ineffective."""
    import torch
    import torch.nn as nn

    monkeypatch.setattr(notices, "_WARNED", set())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(IneffectiveSetting, match="Config.persist_threshold=9 has no effect at stage 1"):
        fxzero.compile(model, Config(stage=1, persist_threshold=9, cost_model=None))


@pytest.mark.parametrize("capability, slow", [("AVX2", True), ("DEFAULT", True), ("AVX512", False)])
def test_bfloat16_on_an_x86_cpu_without_avx512_is_said_to_be_slow(monkeypatch, capability, slow):
    """bfloat16 matmuls have no fast CPU kernel below AVX-512 (about 68x slower than float32 on an
    AVX2 EPYC): mixed precision or autocast in bfloat16 there gets a SlowSetting message; CUDA,
    float32 and an AVX-512 CPU get none. (The capability is pinned, not read from this machine.)"""
    import platform

    import torch

    from fxzero.config.effects import slow_settings
    from fxzero.config.precision import Autocast, MixedPrecision

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for config in (Config(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)), Config(autocast=Autocast())):
        messages = slow_settings(config, cuda=False, cpu_capability=capability)
        assert len(messages) == (1 if slow else 0)
        if slow:
            assert f"torch's CPU capability here: {capability}" in messages[0] and "mixed_precision=None" in messages[0]
        assert slow_settings(config, cuda=True, cpu_capability=capability) == []
    assert slow_settings(Config(), cuda=False, cpu_capability=capability) == []

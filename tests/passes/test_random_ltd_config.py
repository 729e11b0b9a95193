"""DeepSpeed's "data_efficiency" section read into `Config.random_ltd`: DeepSpeedExamples' four
random-LTD configs, every key checked, data sampling refused unless off, and the policy's own
checks. (DeepSpeed 0.19.8's reading: runtime/data_pipeline/config.py and constants.py.)"""

from __future__ import annotations

import copy
import json
import pathlib
import warnings

import pytest

from fxzero.config import Config
from fxzero.config.deepspeed import read_deepspeed
from fxzero.config.random_ltd import RandomLTD

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "deepspeedexamples_configs"
EXAMPLES = {
    "training__data_efficiency__gpt_finetuning__config__ds_config_gpt_base_random_ltd.json":
        dict(layer_ids=tuple(range(1, 11)), total_layer_num=12, min_value=128, max_value=1024, require_steps=400,
             model_mask_name="attention_mask"),
    "training__data_efficiency__gpt_finetuning__config__ds_config_gpt_medium_random_ltd.json":
        dict(layer_ids=tuple(range(1, 23)), total_layer_num=24, min_value=128, max_value=1024, require_steps=400,
             model_mask_name="attention_mask"),
    "training__data_efficiency__vit_finetuning__config__ds_config_cifar_random_ltd.json":
        dict(layer_ids=tuple(range(1, 11)), total_layer_num=12, min_value=32, max_value=197, require_steps=3910,
             model_mask_name=None),
    "training__data_efficiency__vit_finetuning__config__ds_config_imagenet_random_ltd.json":
        dict(layer_ids=tuple(range(1, 11)), total_layer_num=12, min_value=32, max_value=197, require_steps=3910,
             model_mask_name=None),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_deepspeedexamples_random_ltd_configs_read(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = Config.from_deepspeed(DATA / name)
    want = RandomLTD(seq_per_step=8, model_type="decoder", hidden_state_order="batch_seq_dim", **EXAMPLES[name])
    assert config.random_ltd == want
    assert config.random_ltd.layer_num == len(want.layer_ids)
    assert config.stage == 1  # (stage 0, run as ZeRO-1)


def _base() -> dict:
    return json.loads((DATA / sorted(EXAMPLES)[0]).read_text())


def _with(path: str, value) -> dict:
    ds = copy.deepcopy(_base())
    *sections, key = path.split(".")
    node = ds
    for s in sections:
        node = node.setdefault(s, {})
    if value is _DROP:
        del node[key]
    else:
        node[key] = value
    return ds


_DROP = object()
LTD = "data_efficiency.data_routing.random_ltd"


@pytest.mark.parametrize("path, value, message", [
    ("data_efficiency.data_sampling", {"enabled": True}, r"data_sampling.enabled=true is not supported.*data sampler"),
    ("data_efficiency.data_sampling", {"enabled": False, "curriculum_learning": {"enabled": True}},
     r"curriculum_learning.enabled=true is not supported by fxzero: curriculum learning"),
    ("data_efficiency.data_sampling", {"dynamic_batching": {"enabled": True}}, r"dynamic batching"),
    (f"{LTD}.layer_token_lr_schedule", {"enabled": True}, r"layer_token_lr_schedule.enabled=true is not supported"),
    (f"{LTD}.random_ltd_layr_id", [1], r"unknown key .*random_ltd_layr_id'; did you mean 'random_ltd_layer_id'"),
    (f"{LTD}.random_ltd_schedule.schedule_config.seq_per_step", _DROP, r"lacks random_ltd_schedule.schedule_config.seq"),
    (f"{LTD}.model_mask_name", _DROP, r"lacks model_mask_name"),
    (f"{LTD}.model_type", "encoder-decoder", r"model_type 'encoder-decoder'.*DeepSpeed has only these two"),
    (f"{LTD}.hidden_state_order", "seq_first", r"hidden_state_order 'seq_first'"),
    (f"{LTD}.random_ltd_schedule.schedule_type", "fixed_root", r"\"fixed_linear\" only"),
    (f"{LTD}.random_ltd_schedule.min_value", 2048, r"min_value 2048 exceeds max_value 1024"),
    (f"{LTD}.model_type", "encoder", None),  # (encoder with a mask name: read)
    (f"{LTD}.random_ltd_layer_id", 3, r"random_ltd_layer_id must be a list"),
])
def test_each_data_efficiency_key_is_checked(path, value, message):
    ds = _with(path, value)
    if message is None:
        assert read_deepspeed(ds).fields["random_ltd"].model_type == value
        return
    with pytest.raises(ValueError, match=message):
        read_deepspeed(ds)


def test_encoder_needs_a_mask_name():
    ds = _with(f"{LTD}.model_type", "encoder")
    ds["data_efficiency"]["data_routing"]["random_ltd"]["model_mask_name"] = None
    with pytest.raises(ValueError, match="encoder.*name the layer's mask argument"):
        read_deepspeed(ds)


def test_a_section_that_switches_nothing_on_reads_to_no_random_ltd():
    """As DeepSpeed: random_ltd.enabled alone turns random-LTD on; the seed only seeds the data
    sampler (warned: no effect)."""
    for section in ({"enabled": False, "seed": 1234}, {"enabled": True},
                    {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {"enabled": False}}},
                    {"data_sampling": {"enabled": False, "curriculum_learning": {"enabled": False, "metrics": {}}}}):
        reading = read_deepspeed({"data_efficiency": section})
        assert "random_ltd" not in reading.fields
        assert any("data_efficiency.seed" in m for m in reading.ineffective) == ("seed" in section)


def test_outer_switches_off_still_run_random_ltd_as_deepspeed_does():
    ds = _with("data_efficiency.enabled", False)
    reading = read_deepspeed(ds)
    assert reading.fields["random_ltd"] is not None
    assert any("runs random-LTD by random_ltd.enabled alone" in n for n in reading.notes)


def test_the_policy_checks_its_fields():
    base = dict(layer_ids=(1, 2), total_layer_num=4, min_value=4, max_value=8, require_steps=10, seq_per_step=2)
    assert RandomLTD(**base).layer_num == 2
    for change, message in [({"layer_ids": ()}, "non-empty tuple"), ({"layer_ids": [1]}, "non-empty tuple"),
                            ({"seq_per_step": 0}, "seq_per_step must be an integer >= 1"),
                            ({"layer_num": 5}, "layer_num 5 exceeds total_layer_num 4"),
                            ({"model_type": "encoder"}, "name the layer's mask argument")]:
        with pytest.raises(ValueError, match=message):
            RandomLTD(**{**base, **change})
    with pytest.raises(TypeError, match="Config.random_ltd must be"):
        Config(random_ltd={"enabled": True})

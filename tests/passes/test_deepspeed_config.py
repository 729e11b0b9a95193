"""A DeepSpeed config read strictly: each mistake is an error (or a named warning) before training.

The expected fields are written out here, not derived from the key table.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from fxzero.config import SGD, Adam, AdamW, Config, Cpu, Lion, RMSprop, notices
from fxzero.config.batch import resolve_batch
from fxzero.config.deepspeed import read_deepspeed
from fxzero.config.notices import IneffectiveSetting
from fxzero.config.schedules import WarmupLR

pytestmark = pytest.mark.timeout(60)

CHAPTER = {  # the textbook chapter's ds_config.json, train_batch_size made consistent with 2 ranks
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.01}},
    "fp16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
}


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_WARNED", set())
    monkeypatch.setattr(notices, "_PRINTED", set())


def test_the_chapter_config_is_read_key_by_key():
    reading = read_deepspeed(CHAPTER)
    f = reading.fields
    assert (f["train_batch_size"], f["train_micro_batch_size_per_gpu"], f["gradient_accumulation_steps"]) == (32, 16, 1)
    assert f["optimizer"] == AdamW(lr=2e-5, weight_decay=0.01)
    assert f["mixed_precision"].param_dtype is torch.float16 and f["mixed_precision"].loss_scale is not None
    assert f["stage"] == 3 and f["persist_threshold"] == 100_000
    assert f["offload"].optimizer == Cpu(pin_memory=True)
    # what changes nothing in fxzero is named, with its reason
    named = {m.split("'")[1] for m in reading.ineffective}
    assert named == {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                     "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"}
    assert any("always overlaps" in m for m in reading.ineffective)
    with pytest.warns(IneffectiveSetting, match="overlap_comm"):
        Config.from_deepspeed(CHAPTER)


def test_a_json_file_reads_as_its_dict(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CHAPTER))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IneffectiveSetting)
        assert Config.from_deepspeed(str(path)) == Config.from_deepspeed(CHAPTER)


@pytest.mark.parametrize("ds, message", [
    ({"train_batch_sizes": 8}, r"unknown key 'train_batch_sizes'; did you mean 'train_batch_size'\?"),
    ({"zero_optimization": {"stage3_param_persistance_threshold": 10}},
     r"unknown key 'zero_optimization.stage3_param_persistance_threshold'; did you mean "
     r"'stage3_param_persistence_threshold'\?"),
    ({"zero_optimization": {"offload_optimizer": {"devce": "cpu"}}},
     r"'zero_optimization.offload_optimizer.devce'; did you mean 'device'\?"),
    ({"fp16": {"enabeld": True}}, r"'fp16.enabeld'; did you mean 'enabled'\?"),
    ({"zero_optimization": {"no_such_thing": 1}}, r"unknown key 'zero_optimization.no_such_thing' in "
                                                   r"'zero_optimization' \(see docs/deepspeed_config.md"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}},
     r"'zero_optimization.stage3_prefetch_bucket_size' is given twice \(as 'prefetch_bucket_size' too\)"),
    ({"optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}}, r"optimizer.params has no 'lrr' for AdamW; did you "
                                                                 r"mean 'lr'\?"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, r"top-level \"gradient_clipping\""),
])
def test_unknown_and_misspelled_keys_are_errors_naming_the_nearest(ds, message):
    with pytest.raises(ValueError, match=message):
        Config.from_deepspeed(ds)


def test_unsupported_optimizer_type():
    with pytest.raises(ValueError, match=r"optimizer type 'OneBitLamb' is not supported"):
        Config.from_deepspeed({"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}}})


def test_adam_is_adamw_unless_adam_w_mode_is_false():
    # DeepSpeed's "Adam" runs FusedAdam with adam_w_mode=True (decoupled decay) by default
    assert type(Config.from_deepspeed({"optimizer": {"type": "Adam", "params": {}}}).optimizer) is AdamW
    opt = Config.from_deepspeed({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False,
                                                                          "weight_decay": 0.1}}}).optimizer
    assert type(opt) is Adam and opt.weight_decay == 0.1
    # "AdamW" is decoupled whatever adam_w_mode says
    assert type(Config.from_deepspeed({"optimizer": {"type": "AdamW",
                                                     "params": {"adam_w_mode": False}}}).optimizer) is AdamW


@pytest.mark.parametrize("ds, message", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"\"bf16\" and \"fp16\" are both enabled"),
    ({"bfloat16": {"enabled": True}, "fp16": {"enabled": True}}, r"both enabled"),
    ({"tensorboard": {"enabled": True, "output_path": "x"}}, r"tensorboard=.* is not supported by fxzero"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     r"offload_optimizer.ratio=0.3 is not supported by fxzero: fxzero offloads all"),
    ({"zero_optimization": {"zero_quantized_weights": True}}, r"zero_quantized_weights=true is not supported"),
    ({"optimizer": {"type": "Muon"}}, r"optimizer type 'Muon' is not supported \(Muon orthogonalizes each "
                                      r"weight matrix whole"),
    ({"optimizer": {"type": "sgd"}}, r"optimizer type 'sgd' is not supported .* 'SGD'"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, r"no 'betas' for SGD"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True, "bias_correction": False}}},
     r"amsgrad=True, bias_correction=False"),
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage must be 0, 1, 2 or 3, got 4"),
    ({"gradient_allreduce_op": "avg"}, r"gradient_allreduce_op must be \"mean\" or \"sum\", got 'avg'"),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp16"}, r"\"communication_data_type\" 'fp16' with "
                                                                     r"bfloat16 compute: fxzero reduces"),
    ({"communication_data_type": "bf16"}, r"'bf16' without a \"bf16\" or \"fp16\" section enabled"),
    ({"fp16": {"enabled": True}, "communication_data_type": "fp16", "prescale_gradients": True},
     r"could overflow float16 where DeepSpeed's divided sum would not; drop \"communication_data_type\""),
    ({"gradient_clipping": -1}, r"gradient_clipping must be a number >= 0"),
    ({"optimizer": {"params": {"lr": 0.1}}}, r"\"optimizer\" has \"params\" but no \"type\""),
])
def test_mistakes_and_unsupported_features_are_errors(ds, message):
    with pytest.raises(ValueError, match=message):
        Config.from_deepspeed(ds)


def test_unsupported_features_switched_off_are_accepted_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.from_deepspeed({"tensorboard": {"enabled": False}, "zero_optimization": {"zero_quantized_weights": False},
                               "optimizer": {"type": "Adam", "params": {"amsgrad": False, "bias_correction": True}},
                               "gradient_allreduce_op": "mean", "bf16": {"enabled": False}})


@pytest.mark.parametrize("ds, message", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, r"optimizer.params.lr is \"auto\""),
    ({"dataloader_drop_last": "auto"}, r"dataloader_drop_last is \"auto\""),
    ({"zero_optimization": {"offload_optimizer": {"device": "auto"}}},
     r"zero_optimization.offload_optimizer.device is \"auto\""),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}, r"warmup_max_lr is \"auto\""),
])
def test_auto_that_cannot_be_resolved_is_an_error(ds, message):
    with pytest.raises(ValueError, match=message + r".*no trainer"):
        Config.from_deepspeed(ds)


def test_auto_that_can_be_resolved_is_printed_once(capsys):
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto", "reduce_bucket_size": "auto"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IneffectiveSetting)
        cfg = Config.from_deepspeed(ds)
        Config.from_deepspeed(ds)
    assert cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.persist_threshold == 100_000
    out = capsys.readouterr().out
    assert out.count("stage3_param_persistence_threshold: \"auto\" -> 100000") == 1
    assert out.count("train_batch_size: \"auto\" -> implied") == 1


def test_the_other_keys_are_read():
    cfg = Config.from_deepspeed({"gradient_clipping": 0.5, "steps_per_print": 7, "dataloader_drop_last": True,
                                 "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
                                 "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.gradient_clipping == 0.5 and cfg.steps_per_print == 7 and cfg.dataloader_drop_last
    assert cfg.lr_schedule == WarmupLR(warmup_num_steps=5)
    assert cfg.offload.optimizer == Cpu() and cfg.stage == 2 and cfg.persist_threshold == 0
    assert Config.from_deepspeed({"gradient_clipping": 0}).gradient_clipping is None  # DeepSpeed: 0 is off


# -- the batch triple -----------------------------------------------------------------------------


@pytest.mark.parametrize("given, world, want", [
    ((32, 16, 1), 2, (32, 16, 1)),
    ((32, 4, None), 2, (32, 4, 4)),
    ((32, None, 2), 2, (32, 8, 2)),
    ((None, 4, 3), 2, (24, 4, 3)),
    ((32, None, None), 4, (32, 8, 1)),
    ((None, 4, None), 3, (12, 4, 1)),
    ((None, None, None), 2, (None, None, 1)),
])
def test_any_two_imply_the_third(given, world, want):
    assert tuple(resolve_batch(*given, world)) == want


@pytest.mark.parametrize("given, world", [((128, 16, 1), 2), ((30, 4, None), 2), ((32, None, 3), 2)])
def test_an_inconsistent_triple_names_all_three_and_the_world(given, world):
    with pytest.raises(ValueError, match=rf"train_batch_size={given[0]}, train_micro_batch_size_per_gpu={given[1]}, "
                                         rf"gradient_accumulation_steps={given[2]}, world size {world}"):
        resolve_batch(*given, world)


# -- configs as people write them -----------------------------------------------------------------


def test_a_top_level_key_deepspeed_does_not_have_is_warned_about_and_ignored():
    # DeepSpeed ignores a top-level key it does not read (training/imagenet's "cuda_visible_devices")
    reading = read_deepspeed({"cuda_visible_devices": 0, "train_batch_size": 8})
    assert reading.fields["train_batch_size"] == 8
    assert reading.ineffective == ["DeepSpeed config key 'cuda_visible_devices' is not a DeepSpeed key: DeepSpeed "
                                   "ignores it, and so does fxzero"]
    with pytest.warns(IneffectiveSetting, match="'cuda_visible_devices' is not a DeepSpeed key"):
        Config.from_deepspeed({"cuda_visible_devices": 0})


# LLaMA-Factory's examples/deepspeed/ds_z3_fp8_config.json (hiyouga/LLaMA-Factory ff6d4d1, Apache-2.0),
# with Hugging Face's Trainer's values in place of its "auto"s: "comms_config" and "monitor_config"
# are no DeepSpeed keys (DeepSpeed reads "comms_logger", and "tensorboard", "wandb", "csv_monitor"
# and "comet" at the top level), so DeepSpeed 0.19.8 ignores both
LLAMA_FACTORY_Z3 = {
    "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": True,
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}, "overlap_comm": False,
        "contiguous_gradients": True, "sub_group_size": 1000000000, "reduce_bucket_size": 12845056,
        "stage3_prefetch_bucket_size": 11560550, "stage3_param_persistence_threshold": 35840,
        "stage3_max_live_parameters": 1000000000, "stage3_max_reuse_distance": 1000000000,
        "stage3_gather_16bit_weights_on_model_save": True},
    "steps_per_print": 10000000, "gradient_accumulation_steps": 1,
    "comms_config": {"verbose": False},
    "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
}


def test_a_top_level_key_of_another_tool_is_warned_about_and_ignored_as_deepspeed_ignores_it():
    reading = read_deepspeed(LLAMA_FACTORY_Z3)
    assert reading.fields["stage"] == 3
    assert reading.fields["offload"].offloaded("optimizer")
    assert reading.fields["persist_threshold"] == 35840
    ignored = [m for m in reading.ineffective if "is not a DeepSpeed key" in m]
    assert ignored == [
        "DeepSpeed config key 'comms_config' is not a DeepSpeed key: DeepSpeed ignores it, and so does fxzero "
        "(the nearest DeepSpeed key is 'comms_logger')",
        "DeepSpeed config key 'monitor_config' is not a DeepSpeed key: DeepSpeed ignores it, and so does fxzero"]


@pytest.mark.parametrize("key, misspelled", [
    ("train_batch_sizes", True), ("zero_optimisation", True), ("gradient_acumulation_step", True),
    ("comms_config", False), ("sequence_parallel", False),  # (5 edits each from a DeepSpeed key)
])
def test_only_a_misspelling_of_a_top_level_key_is_an_error(key, misspelled):
    ds = {key: 1, "train_batch_size": 8}
    if misspelled:
        with pytest.raises(ValueError, match=rf"unknown key '{key}'; did you mean"):
            read_deepspeed(ds)
    else:
        assert any(m.startswith(f"DeepSpeed config key {key!r} is not a DeepSpeed key")
                   for m in read_deepspeed(ds).ineffective)


def test_a_dotted_section_key_at_the_top_level_is_named_and_ignored_as_deepspeed_ignores_it():
    # TRL's prepare_deepspeed (trl/models/utils.py) adds its ZeRO-3 tuning so, at the top level; DeepSpeed reads
    # zero_optimization as a nested object only, so these change nothing there
    reading = read_deepspeed({"zero_optimization": {"stage": 3},
                              "zero_optimization.stage3_param_persistence_threshold": 640})
    assert reading.fields["persist_threshold"] != 640  # (DeepSpeed's default, as DeepSpeed reads it)
    assert reading.ineffective == [
        "DeepSpeed config key 'zero_optimization.stage3_param_persistence_threshold' is a dotted name at the top "
        "level: DeepSpeed reads 'zero_optimization' as a nested object only and ignores this key, and so does "
        "fxzero; to set it, nest it: {'zero_optimization': {'stage3_param_persistence_threshold': ...}}"]
    nested = read_deepspeed({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 640}})
    assert nested.fields["persist_threshold"] == 640 and not nested.ineffective


@pytest.mark.parametrize("given", [{}, {"zero_optimization": {"stage": 0}}])
def test_stage_0_runs_as_stage_1_said_once(given, capsys):
    for _ in range(2):
        assert Config.from_deepspeed(given).stage == 1
    out = capsys.readouterr().out
    assert out.count("zero_optimization.stage 0, plain data parallelism") == 1
    assert ("(DeepSpeed's default: the config has no zero_optimization.stage)" in out) == (given == {})
    assert "runs as ZeRO stage 1: the same averaged gradients and the same update" in out


@pytest.mark.parametrize("ds, reduce_dtype, said", [
    ({"prescale_gradients": True}, None, "prescale_gradients true: DeepSpeed divides the gradients before"),
    ({"gradient_predivide_factor": 8}, None, "gradient_predivide_factor 8: DeepSpeed divides"),
    ({"prescale_gradients": True, "bf16": {"enabled": True}}, torch.bfloat16, "prescale_gradients true"),
    # float16: an fp32 sum, so no overflow where DeepSpeed's divided float16 one has none
    ({"prescale_gradients": True, "fp16": {"enabled": True}}, torch.float32, "reduces the float16 gradients in fp32"),
    ({"gradient_predivide_factor": 2.0, "fp16": {"enabled": True}}, torch.float32, "in fp32"),
    ({"prescale_gradients": True, "fp16": {"enabled": True}, "communication_data_type": "fp32"}, torch.float32,
     "prescale_gradients true"),
    ({"prescale_gradients": False, "gradient_predivide_factor": 1.0, "fp16": {"enabled": True}}, torch.float16, None),
])
def test_prescaled_gradients_are_the_same_average_said_once(ds, reduce_dtype, said):
    reading = read_deepspeed({"zero_optimization": {"stage": 2}, **ds})
    mp = reading.fields["mixed_precision"]
    assert (mp.grad_dtype if mp is not None else None) is reduce_dtype
    if said is None:
        assert not reading.notes
    else:
        assert [n for n in reading.notes if said in n]


def test_auto_in_deepspeeds_pydantic_sections_is_the_default(capsys):
    # DeepSpeed's config models drop "auto" (DeepSpeedConfigModel), so it reads as the default there:
    # bf16 off, as training/tensor_parallel's config reads under DeepSpeed without the HF trainer
    ds = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
          "zero_optimization": {"stage": "auto", "stage3_max_live_parameters": "auto"}, "gradient_clipping": "auto"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IneffectiveSetting)
        cfg = Config.from_deepspeed(ds)
    assert cfg.mixed_precision is None and cfg.stage == 1 and cfg.gradient_clipping == 1.0
    out = capsys.readouterr().out
    for line in ('bf16.enabled: "auto" -> false (DeepSpeed\'s default)', 'zero_optimization.stage: "auto" -> 0',
                 'gradient_clipping: "auto" -> 1.0'):
        assert line in out
    # below those sections DeepSpeed keeps "auto", and a value fxzero uses is refused
    with pytest.raises(ValueError, match=r"offload_param.pin_memory is \"auto\""):
        read_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "auto"}}})
    # a key that changes nothing takes it anywhere
    read_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": "auto"}}})


def test_a_feature_fxzero_lacks_is_named_before_an_auto_it_cannot_fill():
    with pytest.raises(ValueError, match=r"tensor_parallel=.*tensor parallelism \(AutoTP\)"):
        read_deepspeed({"dataloader_drop_last": "auto", "tensor_parallel": {"autotp_size": 4}})


def test_deepspeeds_field_names_for_stage3_keys():
    cfg = Config.from_deepspeed({"zero_optimization": {"stage": 3, "param_persistence_threshold": 77,
                                                       "max_reuse_distance": 0}})
    assert cfg.persist_threshold == 77 and cfg.prefetch.keep_for_backward is False


@pytest.mark.parametrize("section", ["flops_profiler", "compression_training", "amp"])  # data_efficiency: test_random_ltd_config.py
def test_a_section_that_switches_nothing_on_is_accepted(section):
    off = {"flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1},
           "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False},
                                                            "different_groups": {"wq1": {"params": {}}}},
                                    "layer_reduction": {"enabled": False, "keep_number_layer": 5}},
           "amp": {"enabled": False, "opt_level": "O1"}}[section]
    read_deepspeed({section: off})
    on = {**off, "enabled": True} if "enabled" in off else {**off, "layer_reduction": {"enabled": True}}
    with pytest.raises(ValueError, match=rf"{section}=.* is not supported by fxzero"):
        read_deepspeed({section: on})


@pytest.mark.parametrize("ds, want", [
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
     AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=True)),
    ({"optimizer": {"type": "Adam", "params": {"lr": 0.1, "bias_correction": False}}},
     AdamW(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=False)),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}},
     SGD(lr=0.1, momentum=0.9, nesterov=True)),
    ({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99]}}},
     Lion(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)),
    ({"optimizer": {"type": "RMSprop", "params": {"alpha": 0.9}}}, RMSprop(alpha=0.9)),
])
def test_optimizer_types_read_as_deepspeed_builds_them(ds, want):
    """DeepSpeed's own types (Adam with amsgrad or without bias correction, Lion at FusedLion's
    defaults) and torch.optim classes named exactly (their defaults torch's)."""
    assert Config.from_deepspeed(ds).optimizer == want


def test_deepspeeds_enums_as_config_values_read_as_their_values():
    """Programs put DeepSpeed's enums in their config dicts (`OffloadDeviceEnum.cpu`, as
    DeepSpeed's tests and its offload_states example do): a str enum's str() is its name, which
    was read as the device "offloaddeviceenum.cpu" and refused."""
    from fxzero.config.deepspeed_models import OffloadDeviceEnum, ZeroStageEnum

    fields = read_deepspeed({"zero_optimization": {"stage": ZeroStageEnum.weights,
                                                   "offload_optimizer": {"device": OffloadDeviceEnum.cpu},
                                                   "offload_param": {"device": OffloadDeviceEnum.none}}}).fields
    assert fields["stage"] == 3 and type(fields["stage"]) is int
    assert fields["offload"].optimizer == Cpu(pin_memory=True) and fields["offload"].params.tier == "device"


def test_deepspeeds_zero_config_model_reads_a_section_as_deepspeed_does():
    """`deepspeed.runtime.zero.config.DeepSpeedZeroConfig` (DeepSpeed's own test_zero_config.py runs
    unchanged in tests/dist/test_deepspeed_unit_runtime.py); here, what it refuses."""
    from fxzero.config.deepspeed_models import DeepSpeedZeroConfig, OffloadDeviceEnum, ZeroStageEnum

    config = DeepSpeedZeroConfig(**CHAPTER["zero_optimization"])
    assert config.stage is ZeroStageEnum.weights and config.prefetch_bucket_size == 50_000_000
    assert config.offload_optimizer.device is OffloadDeviceEnum.cpu and config.offload_param is None
    assert config.reduce_bucket_size == 50_000_000 and type(config.reduce_bucket_size) is int
    assert DeepSpeedZeroConfig().max_live_parameters == 1_000_000_000  # (DeepSpeed's default)
    with pytest.raises(ValueError, match="'stage3_prefetch_bucket'.*did you mean 'prefetch_bucket_size'"):
        DeepSpeedZeroConfig(stage3_prefetch_bucket=1)
    with pytest.raises(ValueError, match="given twice"):
        DeepSpeedZeroConfig(prefetch_bucket_size=1, stage3_prefetch_bucket_size=2)
    with pytest.raises(ValueError, match="reduce_bucket_size must be an integer >= 0"):
        DeepSpeedZeroConfig(reduce_bucket_size=-1)
    with pytest.raises(ValueError, match='device must be "none", "cpu" or "nvme"'):
        DeepSpeedZeroConfig(offload_param={"device": "gpu"})
    with pytest.raises(AttributeError, match="read-only"):
        config.stage = 2


def test_the_gradient_sum_is_divided_where_deepspeed_divides_it():
    """DeepSpeed's reduce-scatters divide each rank's buffer by the world size before the sum
    (ZeRO-1/2's average_tensor, ZeRO-3's reduce_scatter_coalesced); stage 0's all-reduce and
    ZeRO-1/2 without reduce_scatter divide the sum (tests/dist/test_gradient_division.py shows
    where it matters)."""
    def division(**zero):
        return read_deepspeed({"zero_optimization": zero}).fields["gradient_division"]

    assert division(stage=1) == division(stage=2) == division(stage=3) == "before"
    assert division(stage=0) == division() == "after"
    assert division(stage=3, reduce_scatter=False) == "before"  # (ZeRO-3 always reduce-scatters)
    assert division(stage=2, reduce_scatter=False) == "after"
    assert Config().gradient_division == "after"  # (DDP's and FSDP's)
    with pytest.raises(ValueError, match='gradient_division must be "after" or "before"'):
        Config(gradient_division="pre")

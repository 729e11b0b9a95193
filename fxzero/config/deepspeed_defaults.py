"""DeepSpeed 0.19.8's defaults: what a DeepSpeed config means where it leaves a key out.

The config reader (`fxzero/config/deepspeed.py`) reads every key through `value()`, which falls
back on this table, so no default is assumed anywhere else. The figures are DeepSpeed's own:
`tools/deepspeed_defaults.py` reads them out of DeepSpeed's released sdist into
`tests/data/deepspeed-0.19.8-defaults.json`, and `tests/passes/test_deepspeed_defaults.py` fails
when a figure here differs from it. They are written out here, not loaded from that file, so the
package does not depend on test data and a change to a default is a visible diff.

Some of DeepSpeed's defaults are not what one would guess, and change what trains:
`zero_optimization.stage` is 0 (plain data parallelism), `gradient_clipping` is 1.0 (since
DeepSpeed 0.19: clipped unless the config says 0), `steps_per_print` is None (no log line),
`communication_data_type` is None (gradients are reduced in the compute dtype), and the
optimizer's defaults are those of the class DeepSpeed builds (`OPTIMIZER_DEFAULTS`): FusedAdam's
weight decay is 0, where torch.optim.AdamW's is 0.01.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

__all__ = ["DEEPSPEED_VERSION", "DEFAULTS", "FIELD_NAMES", "OPTIMIZER_DEFAULTS", "OPTIMIZER_PARAM_DEFAULTS",
           "deepspeed_optimizer", "value"]

DEEPSPEED_VERSION = "0.19.8"

DEFAULTS: dict[str, Any] = {
    # runtime/constants.py, as runtime/config.py reads them
    "train_batch_size": None,
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "managed_gradient_accumulation": True,
    "gradient_clipping": 1.0,
    "steps_per_print": None,
    "dataloader_drop_last": False,
    "communication_data_type": None,
    "seq_parallel_communication_data_type": "fp32",
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean",
    "disable_allgather": False,
    "dump_state": False,
    "disable_python_gc": False,
    "wall_clock_breakdown": False,
    "memory_breakdown": False,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "use_data_before_expert_parallelism": False,
    "log_level": None,
    "data_types.grad_accum_dtype": None,
    "data_types.param_dtype": None,
    "data_types.buffer_dtype": None,
    "data_types.keep_in_fp32_modules": "auto",
    # precision_config.py: DeepSpeedFP16Config, DeepSpeedBF16Config
    "fp16.enabled": False,
    "fp16.auto_cast": False,
    "fp16.loss_scale": 0,
    "fp16.initial_scale_power": 16,
    "fp16.loss_scale_window": 1000,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": False,
    "fp16.min_loss_scale": 1,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.enabled": False,
    "bf16.immediate_grad_update": False,
    "bf16.check_grad_overflow": True,
    "bf16.bf16_master_weights_and_grads": False,
    "bf16.bf16_optimizer_states": False,
    "torch_autocast.enabled": False,  # (runtime/constants.py; its dtype has none: the device's autocast default)
    # zero/config.py: DeepSpeedZeroConfig
    "zero_optimization.stage": 0,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.use_multi_rank_bucket_allreduce": True,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.overlap_comm": None,  # (a validator makes it True at stage 3, else False)
    "zero_optimization.compute_grad_norm": True,
    "zero_optimization.load_from_fp32_weights": True,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.offload_param": None,
    "zero_optimization.offload_optimizer": None,
    "zero_optimization.zenflow": None,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.cpu_offload_param": None,
    "zero_optimization.cpu_offload_use_pin_memory": None,
    "zero_optimization.cpu_offload": None,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.stage3_model_persistence_threshold": sys.maxsize,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_max_reuse_distance": 1_000_000_000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": False,
    "zero_optimization.stage3_allgather_sequential": False,
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.round_robin_gradients": False,
    "zero_optimization.parameter_alignment": False,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.memory_efficient_linear": True,
    "zero_optimization.pipeline_loading_checkpoint": False,
    "zero_optimization.override_module_apply": True,
    "zero_optimization.log_trace_cache_warnings": False,
    "zero_optimization.enable_sanity_checks": False,
    "zero_optimization.save_muon_momentum_buffer_in_memory": False,
    "zero_optimization.leaf_module": {},
    # zero/offload_config.py: DeepSpeedZeroOffloadParamConfig, DeepSpeedZeroOffloadOptimizerConfig
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.offload_param.nvme_path": None,
    "zero_optimization.offload_param.buffer_count": 5,
    "zero_optimization.offload_param.buffer_size": 100_000_000,
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000,
    "zero_optimization.offload_param.pin_memory": True,
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.offload_optimizer.nvme_path": None,
    "zero_optimization.offload_optimizer.buffer_count": 4,
    "zero_optimization.offload_optimizer.pin_memory": True,
    "zero_optimization.offload_optimizer.pipeline_read": False,
    "zero_optimization.offload_optimizer.pipeline_write": False,
    "zero_optimization.offload_optimizer.fast_init": False,
    "zero_optimization.offload_optimizer.ratio": 1.0,
    "zero_optimization.offload_optimizer.super_offload": False,
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": 0.8,
}
"""Every config key DeepSpeed reads with a default, by its dotted path."""

FIELD_NAMES: dict[str, str] = {
    f"zero_optimization.{field}": f"zero_optimization.stage3_{field}"
    for field in ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                  "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                  "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")
}
"""DeepSpeed's zero_optimization model names these fields without the "stage3_" of their keys
and accepts either spelling (pydantic's populate_by_name)."""

OPTIMIZER_PARAM_DEFAULTS: dict[str, Any] = {"adam_w_mode": True, "torch_adam": False}
"""The "Adam"/"AdamW" params DeepSpeed reads before it picks the class (runtime/engine.py)."""

_ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    # deepspeed/ops: the classes DeepSpeed builds for its own types
    "FusedAdam": {**_ADAM, "weight_decay": 0.0, "bias_correction": True, "amsgrad": False},
    "DeepSpeedCPUAdam": {**_ADAM, "weight_decay": 0, "bias_correction": True, "amsgrad": False},
    "DeepSpeedCPUAdagrad": {"lr": 0.01, "eps": 1e-10, "weight_decay": 0},
    "FusedLamb": {**_ADAM, "weight_decay": 0.0, "bias_correction": True, "eps_inside_sqrt": False,
                  "max_grad_norm": 0.0, "max_coeff": 10.0, "min_coeff": 0.01, "amsgrad": False},
    "FusedLion": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
    "DeepSpeedCPULion": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0},
    # torch.optim (torch 2.13): "torch_adam", "Adagrad", and any other type, by its class name
    "torch.optim.AdamW": {**_ADAM, "weight_decay": 0.01, "amsgrad": False, "maximize": False},
    "torch.optim.Adam": {**_ADAM, "weight_decay": 0, "amsgrad": False, "maximize": False,
                         "decoupled_weight_decay": False},
    "torch.optim.Adagrad": {"lr": 0.01, "lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0,
                            "eps": 1e-10, "maximize": False},
    "torch.optim.SGD": {"lr": 1e-3, "momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False,
                        "maximize": False},
    "torch.optim.RMSprop": {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0, "momentum": 0,
                            "centered": False, "maximize": False},
    "torch.optim.Adadelta": {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0, "maximize": False},
    "torch.optim.Adamax": {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0, "maximize": False},
    "torch.optim.NAdam": {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0, "momentum_decay": 0.004,
                          "decoupled_weight_decay": False, "maximize": False},
    "torch.optim.RAdam": {**_ADAM, "weight_decay": 0, "decoupled_weight_decay": False, "maximize": False},
    "torch.optim.ASGD": {"lr": 0.01, "lambd": 1e-4, "alpha": 0.75, "t0": 1e6, "weight_decay": 0, "maximize": False},
    "torch.optim.Rprop": {"lr": 0.01, "etas": [0.5, 1.2], "step_sizes": [1e-6, 50], "maximize": False},
}
"""The defaults of each optimizer class DeepSpeed can build for an "optimizer" section (its
`__init__`'s hyperparameters; implementation switches such as foreach left out);
`deepspeed_optimizer()` says which class a section builds."""

_DEEPSPEED_TYPES = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
"""The types DeepSpeed builds itself, matched case-insensitively; any other names a torch.optim
class, case and all (runtime/config.py's DEEPSPEED_OPTIMIZERS)."""


def deepspeed_optimizer(kind: str, params: Mapping[str, Any], offloaded: bool) -> str:
    """The class DeepSpeed builds for an "optimizer" section of type `kind` with these params
    (runtime/engine.py's `_configure_basic_optimizer`): for "adam"/"adamw", torch.optim's
    AdamW/Adam with "torch_adam": true, DeepSpeedCPUAdam when the optimizer states are offloaded,
    FusedAdam otherwise ("adamw", or "adam" with adam_w_mode true, in its decoupled mode); for
    "adagrad", DeepSpeedCPUAdagrad offloaded, torch.optim.Adagrad otherwise; for "lion",
    DeepSpeedCPULion offloaded, FusedLion otherwise; "lamb", FusedLamb; a type DeepSpeed does not
    build itself, torch.optim's class of that name. A key of `OPTIMIZER_DEFAULTS` where listed."""
    name = kind.lower()
    if name in ("adam", "adamw"):
        if params.get("torch_adam", OPTIMIZER_PARAM_DEFAULTS["torch_adam"]):
            decoupled = name == "adamw" or params.get("adam_w_mode", OPTIMIZER_PARAM_DEFAULTS["adam_w_mode"])
            return "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
        return "DeepSpeedCPUAdam" if offloaded else "FusedAdam"
    if name == "adagrad":
        return "DeepSpeedCPUAdagrad" if offloaded else "torch.optim.Adagrad"
    if name == "lion":
        return "DeepSpeedCPULion" if offloaded else "FusedLion"
    if name == "lamb":
        return "FusedLamb"
    if name in _DEEPSPEED_TYPES:  # the others DeepSpeed builds itself (mup's, and its Muon)
        return {"muadam": "mup.MuAdam", "muadamw": "mup.MuAdamW", "musgd": "mup.MuSGD"}.get(name, "MuonWithAuxAdam")
    return f"torch.optim.{kind}"


def value(config: Mapping[str, Any], path: str) -> Any:
    """The value at dotted `path` in a DeepSpeed config, or DeepSpeed's default where the key,
    or a section above it, is missing (or null, as DeepSpeed's Optional sections are)."""
    if path not in DEFAULTS:
        raise KeyError(f"no DeepSpeed default for {path!r}: add it to DEFAULTS")  # our own table's gap
    section: Any = config
    *sections, key = path.split(".")
    for name in sections:
        section = section.get(name) if isinstance(section, Mapping) else None
        if section is None:
            return DEFAULTS[path]
    return section.get(key, DEFAULTS[path]) if isinstance(section, Mapping) else DEFAULTS[path]

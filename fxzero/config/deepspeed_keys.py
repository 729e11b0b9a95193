"""Every DeepSpeed config key (DeepSpeed 0.19), and what fxzero does with it.

One table, read by the config reader (`fxzero/config/deepspeed.py`) and printed as the docs'
key table (`docs/deepspeed_config.md`, rendered by `markdown_table()` and rewritten with
`tools/deepspeed_keys_doc.py`; a test keeps the two equal). Each key is:

- `USED`: it sets what fxzero does, as DeepSpeed means it;
- `NO_EFFECT`: accepted, and named once in an `IneffectiveSetting` warning with the reason (it
  tunes something fxzero does another way, or does always);
- `UNSUPPORTED`: an error naming the key and why, unless its value is one fxzero honours as
  DeepSpeed would (`honoured`: the value that leaves the feature off);
- `SECTION`: an object whose keys are in the table under it (`"zero_optimization.stage"`).

A key missing from the table is an error naming it and the nearest key DeepSpeed has.
`"auto"` (a value a trainer fills in) is resolved to `auto`, DeepSpeed's own default, where
the key has one that fxzero can take without a trainer, and is an error otherwise.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from fxzero.config.schedules import SCHEDULES

__all__ = ["KEYS", "NO_EFFECT", "OPTIMIZER_PARAMS", "OPTIMIZER_TYPES", "SECTION", "UNSUPPORTED", "USED", "Key",
           "markdown_table"]

USED, NO_EFFECT, UNSUPPORTED, SECTION = "used", "no effect", "unsupported", "section"
_NOT_SET = object()


@dataclasses.dataclass(frozen=True)
class Key:
    kind: Literal["used", "no effect", "unsupported", "section"]
    why: str
    honoured: Any = _NOT_SET
    """UNSUPPORTED: the value (or a tuple of values) fxzero honours as DeepSpeed does."""
    auto: Any = _NOT_SET
    """What "auto" resolves to (DeepSpeed's default); unset: "auto" is an error."""

    @property
    def honoured_values(self) -> tuple[Any, ...]:
        """UNSUPPORTED: every value fxzero honours; empty: any value is an error."""
        if self.honoured is _NOT_SET:
            return ()
        return self.honoured if isinstance(self.honoured, tuple) else (self.honoured,)

    def honours(self, value: Any) -> bool:
        """Whether `value` leaves fxzero doing what DeepSpeed does with it (True and 1 differ)."""
        return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.honoured_values)

    @property
    def has_auto(self) -> bool:
        return self.auto is not _NOT_SET


def _used(why: str, auto: Any = _NOT_SET) -> Key:
    return Key(USED, why, auto=auto)


def _none(why: str, auto: Any = _NOT_SET) -> Key:
    return Key(NO_EFFECT, why, auto=auto)


def _off(why: str, honoured: Any = False) -> Key:
    return Key(UNSUPPORTED, why, honoured=honoured)


def _section(why: str) -> Key:
    return Key(SECTION, why)


_OVERLAP = "fxzero always overlaps communication with compute: the schedule issues each collective early"
_BUCKETS = ("fxzero reduces and gathers per unit (a module list's item), or per `fxzero.Bucket` of merged small "
            "units; DeepSpeed's element-count buckets are not translated")
_MONITOR = ("fxzero writes no monitor logs; `steps_per_print` prints the log line, `engine.comm_report()`, "
            "`memory_report()` and `fxzero train --timeline` report the rest")
_PLACEMENT = "where the states live: fxzero.Offload(params=..., optimizer=...) (Cpu, Nvme)"
_QUANT = "fxzero gathers and reduces unquantized values"
_PARALLEL = "fxzero is data parallel (ZeRO) only"

KEYS: dict[str, Key] = {
    # -- batch and steps ----------------------------------------------------------------------
    "train_batch_size": _used("Config.train_batch_size; with the two below, one triple checked against the "
                              "world size (any two imply the third)", auto=None),
    "train_micro_batch_size_per_gpu": _used("Config.train_micro_batch_size_per_gpu: the batch of the dataloader "
                                            "fxzero.initialize returns", auto=None),
    "gradient_accumulation_steps": _used("Config.gradient_accumulation_steps: engine.step() updates every n-th "
                                         "call; gradients accumulate in the fp32 gradient shards", auto=None),
    "gradient_clipping": _used("Config.gradient_clipping: the global norm over all ranks' shards, one scalar "
                               "all-reduce, as torch.nn.utils.clip_grad_norm_"),
    "steps_per_print": _used("Config.steps_per_print: each rank's log line (step, loss, lr, loss scale, step "
                             "time, memory)", auto=10),
    "dataloader_drop_last": _used("the dataloader fxzero.initialize returns drops the last incomplete batch"),
    "optimizer": _section("the optimizer run on each rank's shards (its type and params)"),
    "optimizer.type": _used("\"Adam\"/\"AdamW\" (Adam with adam_w_mode false: fxzero.Adam, L2 decay) or "
                            "\"Adagrad\" (fxzero.Adagrad)"),
    "optimizer.params": _section("the optimizer's hyperparameters (see the optimizer params below)"),
    "optimizer.legacy_fusion": _none("fxzero's update is one per unit shard, not fused across units"),
    "scheduler": _used("Config.lr_schedule: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, "
                       "read strictly (fxzero/config/schedules.py) and stepped at each optimizer step"),
    "zero_allow_untested_optimizer": _none("fxzero runs only its own sharded optimizers, each tested"),
    "zero_force_ds_cpu_optimizer": _none("fxzero's optimizer runs where its states live, on any tier"),
    # -- precision ----------------------------------------------------------------------------
    "fp16": _section("float16 compute with fp32 masters and dynamic loss scaling"),
    "fp16.enabled": _used("MixedPrecision(param_dtype=torch.float16, loss_scale=LossScale(...))"),
    "fp16.loss_scale": _used("0: dynamic scaling; > 0: LossScale(static=...)"),
    "fp16.initial_scale_power": _used("LossScale.initial_scale_power (the first scale is 2**power)"),
    "fp16.loss_scale_window": _used("LossScale.window: overflow-free steps before the scale doubles"),
    "fp16.hysteresis": _used("LossScale.hysteresis: overflows tolerated before the scale halves"),
    "fp16.min_loss_scale": _used("LossScale.min_scale"),
    "fp16.consecutive_hysteresis": _off("fxzero's hysteresis is DeepSpeed's default (not reset by good steps)"),
    "fp16.auto_cast": _off("fxzero casts parameters to float16, not the model's inputs: pass float16 inputs "
                           "where the model needs them"),
    "fp16.fp16_master_weights_and_grads": _off("fxzero keeps fp32 masters and gradients (what the update reads)"),
    "bf16": _section("bfloat16 compute with fp32 masters (\"bfloat16\" is the same section)"),
    "bf16.enabled": _used("MixedPrecision(param_dtype=torch.bfloat16)"),
    "bf16.immediate_grad_update": _none("fxzero reduces each unit's gradient as the backward produces it"),
    "bf16.check_grad_overflow": _none("fxzero checks the loss for non-finite values at every bfloat16 step"),
    "bf16.bf16_master_weights_and_grads": _off("fxzero keeps fp32 masters and gradients (what the update reads)"),
    "bf16.bf16_optimizer_states": _off("fxzero keeps the optimizer states in fp32"),
    "communication_data_type": _used("\"fp32\": gradients reduced in fp32 (the default); \"bf16\"/\"fp16\": in "
                                     "the compute dtype (MixedPrecision.reduce_dtype=None)"),
    "seq_parallel_communication_data_type": _none(_PARALLEL),
    "torch_autocast": _off("fxzero's mixed precision casts parameters (\"bf16\"/\"fp16\" sections); use those, or "
                           "torch.autocast in the model", honoured=({}, {"enabled": False})),
    "data_types": _section("dtypes of accumulation buffers"),
    "data_types.grad_accum_dtype": _off("fxzero accumulates gradients in fp32", honoured=(None, "fp32")),
    "data_types.param_dtype": _off("fxzero's compute dtype is the \"bf16\"/\"fp16\" section's", honoured=None),
    "data_types.buffer_dtype": _off("fxzero keeps buffers in the model's own dtype", honoured=None),
    "data_types.keep_in_fp32_modules": _off("fxzero casts every floating parameter of a unit",
                                            honoured=("auto", None)),
    "prescale_gradients": _off("fxzero averages gradients in the reduce-scatter"),
    "gradient_predivide_factor": _off("fxzero averages gradients in the reduce-scatter", honoured=(1, 1.0)),
    "gradient_allreduce_op": _off("fxzero averages gradients (\"mean\")", honoured="mean"),
    "fp32_allreduce": _none("gradients are reduced in fp32 by default (communication_data_type)"),
    "sparse_gradients": _off("fxzero reduces dense gradients (nn.Embedding(sparse=True) is not supported)"),
    "amp": _off("apex AMP is not used: use the \"bf16\" or \"fp16\" section", honoured=({}, {"enabled": False})),
    # -- ZeRO ---------------------------------------------------------------------------------
    "zero_optimization": _section("ZeRO stage, offload and persistence"),
    "zero_optimization.stage": _used("Config.stage (1, 2 or 3; DeepSpeed's stage 0, plain data parallelism, is "
                                     "an error: use stage 1, which trains identically)"),
    "zero_optimization.contiguous_gradients": _none("fxzero's gradients are flat, contiguous per unit already"),
    "zero_optimization.reduce_scatter": _none("fxzero chooses reduce-scatter or all-reduce per unit by its cost "
                                              "model (Config.cost_model)"),
    "zero_optimization.reduce_bucket_size": _none(_BUCKETS, auto=500_000_000),
    "zero_optimization.allgather_partitions": _none("ZeRO-1/2 re-gather the updated parameters with all-gathers "
                                                    "always"),
    "zero_optimization.allgather_bucket_size": _none(_BUCKETS, auto=500_000_000),
    "zero_optimization.use_multi_rank_bucket_allreduce": _none(_BUCKETS),
    "zero_optimization.overlap_comm": _none(_OVERLAP),
    "zero_optimization.compute_grad_norm": _none("the norm is computed where gradient_clipping needs it"),
    "zero_optimization.load_from_fp32_weights": _none("no checkpoint loading yet (the checkpoint issue)"),
    "zero_optimization.elastic_checkpoint": _none("no checkpoint loading yet (the checkpoint issue)"),
    "zero_optimization.offload_param": _section("ZeRO-Infinity: parameter shards on cpu or nvme"),
    "zero_optimization.offload_param.device": _used("\"cpu\": Offload(params=Cpu()); \"nvme\": Nvme(path=...)"),
    "zero_optimization.offload_param.nvme_path": _used("Nvme.path"),
    "zero_optimization.offload_param.buffer_count": _used("Nvme.threads (I/O requests in flight)"),
    "zero_optimization.offload_param.buffer_size": _none("fxzero's I/O buffers are one unit's shard each"),
    "zero_optimization.offload_param.max_in_cpu": _none("fxzero keeps no parameter cache in host memory"),
    "zero_optimization.offload_param.pin_memory": _used("Cpu.pin_memory"),
    "zero_optimization.offload_optimizer": _section("ZeRO-Offload: optimizer states (and gradients) on cpu/nvme"),
    "zero_optimization.offload_optimizer.device": _used("\"cpu\": Offload(optimizer=Cpu()); \"nvme\": Nvme(...)"),
    "zero_optimization.offload_optimizer.nvme_path": _used("Nvme.path"),
    "zero_optimization.offload_optimizer.buffer_count": _used("Nvme.threads (I/O requests in flight)"),
    "zero_optimization.offload_optimizer.pin_memory": _used("Cpu.pin_memory"),
    "zero_optimization.offload_optimizer.pipeline_read": _none("fxzero always prefetches states (Offload.lookahead)"),
    "zero_optimization.offload_optimizer.pipeline_write": _none("fxzero always writes behind the update"),
    "zero_optimization.offload_optimizer.pipeline": _none("fxzero always pipelines state I/O"),
    "zero_optimization.offload_optimizer.fast_init": _none("fxzero writes the initial states unit by unit"),
    "zero_optimization.offload_optimizer.ratio": _off("fxzero offloads all of the optimizer states or none",
                                                      honoured=(1, 1.0)),
    "zero_optimization.offload_optimizer.super_offload": _off("not in fxzero"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _none("fxzero's update uses torch's threads"),
    "zero_optimization.cpu_offload": _used("(deprecated) true: offload_optimizer on cpu"),
    "zero_optimization.cpu_offload_param": _used("(deprecated) true: offload_param on cpu"),
    "zero_optimization.cpu_offload_use_pin_memory": _used("(deprecated) Cpu.pin_memory"),
    "zero_optimization.zenflow": _off("not in fxzero", honoured=None),
    "zero_optimization.sub_group_size": _none("fxzero updates one unit's shard at a time"),
    "zero_optimization.stage3_prefetch_bucket_size": _none("fxzero's prefetch is bounded in bytes by "
                                                           "Prefetch.max_live_bytes, sized from the schedule",
                                                           auto=50_000_000),
    "zero_optimization.stage3_param_persistence_threshold": _used(
        "Config.persist_threshold, per unit: a unit with fewer parameters is held whole. DeepSpeed's is per "
        "parameter; fxzero warns when a unit it shards holds parameters DeepSpeed would keep whole", auto=100_000),
    "zero_optimization.stage3_model_persistence_threshold": _none("fxzero bounds persistence per unit only"),
    "zero_optimization.stage3_max_live_parameters": _none("fxzero's prefetch is bounded in bytes by "
                                                          "Prefetch.max_live_bytes", auto=1_000_000_000),
    "zero_optimization.stage3_max_reuse_distance": _used("0: every unit is gathered again for the backward "
                                                         "(Prefetch(keep_for_backward=False)); > 0: kept where "
                                                         "the prefetch budget allows", auto=1_000_000_000),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _none("engine.full_state_dict() gathers the "
                                                                         "full parameters; export is the "
                                                                         "checkpoint issue"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _none("(deprecated) as "
                                                                        "stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization.stage3_module_granularity_threshold": _none("fxzero's units are its UnitsPolicy's"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _off("fxzero gathers parameters with all-gathers"),
    "zero_optimization.stage3_allgather_sequential": _none("fxzero's gathers are ordered by its schedule"),
    "zero_optimization.ignore_unused_parameters": _none("fxzero trains with parameters no output depends on "
                                                        "(their gradients are zero, their states untouched)"),
    "zero_optimization.legacy_stage1": _none("fxzero has one stage-1 implementation"),
    "zero_optimization.round_robin_gradients": _none("fxzero's gradient shards are contiguous per unit"),
    "zero_optimization.parameter_alignment": _none("fxzero aligns its flat shards itself"),
    "zero_optimization.zero_hpz_partition_size": _off("fxzero shards over the whole world (no hpZ)", honoured=1),
    "zero_optimization.zero_quantized_weights": _off(_QUANT),
    "zero_optimization.zero_quantized_nontrainable_weights": _off(_QUANT),
    "zero_optimization.zero_quantized_gradients": _off(_QUANT),
    "zero_optimization.mics_shard_size": _off("fxzero shards over the whole world (no MiCS)", honoured=(-1,)),
    "zero_optimization.mics_hierarchical_params_gather": _off("fxzero shards over the whole world (no MiCS)"),
    "zero_optimization.memory_efficient_linear": _none("fxzero traces the model's own linear layers"),
    "zero_optimization.pipeline_loading_checkpoint": _none("no checkpoint loading yet (the checkpoint issue)"),
    "zero_optimization.override_module_apply": _none("fxzero does not patch modules"),
    "zero_optimization.log_trace_cache_warnings": _none("fxzero traces one static program per input signature"),
    "zero_optimization.enable_sanity_checks": _none("fxzero validates every schedule it builds"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": _none("fxzero has no Muon optimizer"),
    "zero_optimization.leaf_module": _none("fxzero traces one graph; units come from Config.units"),
    # -- features fxzero does not have (an error where they would change training) ------------
    "activation_checkpointing": _none("configures deepspeed.checkpointing, which a model calls itself; fxzero "
                                      "has no activation checkpointing yet (planned)"),
    "aio": _none("fxzero's NVMe I/O uses O_DIRECT and its own thread pool (Nvme.threads)"),
    "checkpoint": _none("no checkpoints yet (the checkpoint issue)"),
    "flops_profiler": _off(_MONITOR, honoured=({}, {"enabled": False})),
    "tensorboard": _off(_MONITOR, honoured=({}, {"enabled": False})),
    "wandb": _off(_MONITOR, honoured=({}, {"enabled": False})),
    "csv_monitor": _off(_MONITOR, honoured=({}, {"enabled": False})),
    "comet": _off(_MONITOR, honoured=({}, {"enabled": False})),
    "comms_logger": _off(_MONITOR, honoured=({}, {"enabled": False})),
    "wall_clock_breakdown": _none(_MONITOR),
    "memory_breakdown": _none(_MONITOR),
    "dump_state": _none(_MONITOR),
    "timers": _none(_MONITOR),
    "log_level": _none("fxzero logs through Python's logging and warnings"),
    "disable_allgather": _off("ZeRO-1/2 re-gather the updated parameters"),
    "elasticity": _off("fxzero's world is fixed at launch", honoured=({}, {"enabled": False})),
    "autotuning": _off("fxzero's compiler picks its own schedule", honoured=({}, {"enabled": False})),
    "compression_training": _off("not in fxzero", honoured={}),
    "data_efficiency": _off("not in fxzero", honoured=({}, {"enabled": False})),
    "curriculum_learning": _off("not in fxzero", honoured=({}, {"enabled": False})),
    "sparse_attention": _off("not in fxzero", honoured=None),
    "pipeline": _none("configures DeepSpeed's PipelineModule, which fxzero does not have"),
    "hybrid_engine": _off("not in fxzero", honoured=({}, {"enabled": False})),
    "tensor_parallel": _off(_PARALLEL, honoured={}),
    "expert_parallel": _off(_PARALLEL, honoured={}),
    "sequence_parallel_size": _off(_PARALLEL, honoured=1),
    "weight_quantization": _off(_QUANT),
    "nebula": _off("fxzero writes no Nebula checkpoints", honoured=({}, {"enabled": False})),
    "datastates": _off("fxzero writes no DataStates checkpoints", honoured=({}, {"enabled": False})),
    "compile": _off("fxzero is the compiler: DeepSpeed's compile section configures torch.compile of the module",
                    honoured={}),
    "vocabulary_size": _none("only DeepSpeed's tensor-core alignment warning reads it"),
    "use_data_before_expert_parallelism": _none(_PARALLEL),
    "disable_python_gc": _none("fxzero leaves Python's garbage collector alone"),
    "memory_efficient_linear": _none("fxzero traces the model's own linear layers"),
}

OPTIMIZER_PARAMS: dict[str, dict[str, Key]] = {
    "adam": {
        "lr": _used("AdamW.lr / Adam.lr (the initial lr of every param group)"),
        "betas": _used("betas"),
        "eps": _used("eps"),
        "weight_decay": _used("weight_decay: decoupled for AdamW (adam_w_mode true), L2 for Adam"),
        "adam_w_mode": _used("true (DeepSpeed's default, also for \"Adam\"): AdamW; false: Adam with L2 decay"),
        "torch_adam": _none("fxzero's update has torch.optim's arithmetic either way"),
        "fused": _none("fxzero's update is one per unit shard"),
        "bias_correction": _off("fxzero's Adam corrects the moments' bias, as torch.optim does", honoured=True),
        "amsgrad": _off("fxzero's Adam has no AMSGrad variant", honoured=False),
        "fp32_optimizer_states": _none("fxzero keeps the optimizer states in fp32 always"),
    },
    "adagrad": {
        "lr": _used("Adagrad.lr (the initial lr of every param group)"),
        "eps": _used("eps"),
        "weight_decay": _used("weight_decay: L2, added to the gradient (torch.optim.Adagrad's)"),
        "lr_decay": _used("lr_decay: the n-th step runs with lr / (1 + (n - 1) * lr_decay)"),
        "initial_accumulator_value": _used("initial_accumulator_value: what the sum of squared gradients "
                                           "starts from"),
    },
}
"""Each optimizer type's params ("adamw" reads as "adam")."""


OPTIMIZER_TYPES: dict[str, tuple[str, ...]] = {"adam": ("Adam", "AdamW"), "adagrad": ("Adagrad",)}
"""The "optimizer" "type" values that read each `OPTIMIZER_PARAMS` table (case-insensitively)."""


# -- the docs' tables ---------------------------------------------------------------------------

def _json(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _effect(key: Key) -> str:
    """What fxzero does with a key that is given (the "fxzero" column)."""
    if key.kind == USED:
        return "used"
    if key.kind == NO_EFFECT:
        return "no effect (warned once)"
    if key.kind == SECTION:
        return "section"
    if not key.honoured_values:
        return "error"
    return "error unless " + " or ".join(_json(v) for v in key.honoured_values)


def _auto(key: Key) -> str:
    """What `"auto"` resolves to (the "auto" column)."""
    if not key.has_auto:
        return "error"
    return "implied by the other two" if key.auto is None else _json(key.auto)


def _key_rows(keys: dict[str, Key]) -> list[str]:
    rows = ['| key | fxzero | "auto" | why |', "|---|---|---|---|"]
    for path, key in keys.items():
        rows.append(f"| `{path}` | {_cell(_effect(key))} | {_cell(_auto(key))} | {_cell(key.why)} |")
    return rows


def _schedule_rows() -> list[str]:
    rows = ['| `"type"` | `"params"` | default |', "|---|---|---|"]
    for name, cls in SCHEDULES.items():
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = "required" if required else _json(f.default)
            rows.append(f"| {_json(name)} | `{f.name}` | {_cell(default)} |")
    return rows


def markdown_table() -> str:
    """The docs' generated key tables (`docs/deepspeed_config.md` between its markers): every key
    of `KEYS` in order, the optimizer params per type, and the scheduler types with their params."""
    out = ["<!-- generated from fxzero/config/deepspeed_keys.py by tools/deepspeed_keys_doc.py: do not edit -->",
           "", "### Keys", ""]
    out += _key_rows(KEYS)
    for table, keys in OPTIMIZER_PARAMS.items():
        types = " or ".join(f'`"{t}"`' for t in OPTIMIZER_TYPES.get(table, (table,)))
        out += ["", f"### Optimizer params (`optimizer.type` {types})", ""]
        out += _key_rows({f"optimizer.params.{name}": key for name, key in keys.items()})
    out += ["", "### Scheduler types and params", "",
            'The `"scheduler"` section is `{"type": ..., "params": {...}}`; a param not given takes the default '
            "shown (DeepSpeed's), a required one is an error when missing, and `\"auto\"` is an error.", ""]
    for name, cls in SCHEDULES.items():
        out.append(f"- {_json(name)}: {' '.join((cls.__doc__ or '').split())}")
    out += [""] + _schedule_rows()
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")

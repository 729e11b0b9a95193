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

A key missing from the table is an error naming it and the nearest key DeepSpeed has; at the top
level, where DeepSpeed ignores keys it does not read, only a misspelling of a key (within two
edits) is an error, and any other key is warned about and ignored. A key that
is missing takes DeepSpeed's default (`fxzero/config/deepspeed_defaults.py`, checked against
DeepSpeed's source). `"auto"` (a value a trainer fills in) is resolved where fxzero can do without
the trainer (`Key.auto`): to DeepSpeed's default, as DeepSpeed itself reads it in the sections it
validates with pydantic (`zero_optimization`, `fp16`, `bf16`), for keys that change nothing in
fxzero, and for `gradient_clipping` and `steps_per_print`; to what the other two imply for the
batch triple. It is an error elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from fxzero.config.deepspeed_defaults import DEEPSPEED_VERSION, DEFAULTS, OPTIMIZER_DEFAULTS
from fxzero.config.optimizers import ASGD, SGD, Adadelta, Adamax, Lamb, Lion, NAdam, RAdam, RMSprop, Rprop
from fxzero.config.schedules import SCHEDULES

__all__ = ["AUTO_DEFAULT", "AUTO_IMPLIED", "KEYS", "NO_EFFECT", "OPTIMIZER_PARAMS", "OPTIMIZER_TYPES", "SECTION",
           "UNSUPPORTED", "USED", "Key", "markdown_table"]

ELEMENTWISE_TORCH = (SGD, Adamax, NAdam, RAdam, RMSprop, Adadelta, ASGD, Rprop)
"""torch.optim classes a DeepSpeed "optimizer" section may name (DeepSpeed builds them by name),
whose update fxzero runs on shards exactly."""

USED, NO_EFFECT, UNSUPPORTED, SECTION = "used", "no effect", "unsupported", "section"
AUTO_DEFAULT, AUTO_IMPLIED = "DeepSpeed's default", "implied"
"""What `"auto"` resolves to: the key's DeepSpeed default, or what the other batch sizes imply."""
_NOT_SET = object()
_PYDANTIC_SECTIONS = ("zero_optimization.", "fp16.", "bf16.")
"""Sections DeepSpeed validates with its pydantic models, which drop an "auto" value (so the
field keeps its default: `DeepSpeedConfigModel.__init__`); in a section nested below them, and at
the top level, DeepSpeed keeps "auto" as it is."""


@dataclasses.dataclass(frozen=True)
class Key:
    kind: Literal["used", "no effect", "unsupported", "section"]
    why: str
    honoured: Any = _NOT_SET
    """UNSUPPORTED: the value (or a tuple of values) fxzero honours as DeepSpeed does."""
    auto: Any = _NOT_SET
    """What "auto" resolves to: AUTO_DEFAULT (DeepSpeed's default for the key) or AUTO_IMPLIED (the
    batch triple); unset: "auto" is an error."""

    @property
    def honoured_values(self) -> tuple[Any, ...]:
        """UNSUPPORTED: every value fxzero honours; empty: any value is an error."""
        if self.honoured is _NOT_SET:
            return ()
        return self.honoured if isinstance(self.honoured, tuple) else (self.honoured,)

    def honours(self, value: Any) -> bool:
        """Whether `value` leaves fxzero doing what DeepSpeed does with it (True and 1 differ); for
        a section honoured when empty, any section that switches nothing on (`_switched_off`)."""
        if any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.honoured_values):
            return True
        return self.honours_switched_off and _switched_off(value)

    @property
    def honours_switched_off(self) -> bool:
        return any(isinstance(v, dict) for v in self.honoured_values)

    @property
    def has_auto(self) -> bool:
        return self.auto is not _NOT_SET


def _switched_off(value: Any) -> bool:
    """Whether a section turns nothing on: `{}`, `"enabled": false` (whatever else it sets), or
    made only of such sections (compression_training's techniques, each with its switch in
    "shared_parameters")."""
    if not isinstance(value, dict):
        return False
    if "enabled" in value:
        return value["enabled"] is False
    if "shared_parameters" in value:
        return _switched_off(value["shared_parameters"])
    return all(_switched_off(v) for v in value.values())


def _used(why: str, auto: Any = _NOT_SET) -> Key:
    return Key(USED, why, auto=auto)


def _none(why: str) -> Key:
    return Key(NO_EFFECT, why, auto=AUTO_DEFAULT)  # nothing depends on its value


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
                              "world size (any two imply the third)", auto=AUTO_IMPLIED),
    "train_micro_batch_size_per_gpu": _used("Config.train_micro_batch_size_per_gpu: the batch of the dataloader "
                                            "fxzero.initialize returns", auto=AUTO_IMPLIED),
    "gradient_accumulation_steps": _used("Config.gradient_accumulation_steps: engine.step() updates every n-th "
                                         "call; gradients accumulate in the fp32 gradient shards", auto=AUTO_IMPLIED),
    "managed_gradient_accumulation": _off("fxzero's engine.step() updates at every gradient_accumulation_steps-th "
                                          "call, as DeepSpeed's default does; a client-owned boundary is not in "
                                          "fxzero", honoured=True),
    "gradient_clipping": _used("Config.gradient_clipping: the global norm over all ranks' shards, one scalar "
                               "all-reduce, as torch.nn.utils.clip_grad_norm_; 0: no clipping. DeepSpeed clips at "
                               "1.0 where the key is missing (\"auto\": that default, also the HF trainer's)",
                               auto=AUTO_DEFAULT),
    "steps_per_print": _used("Config.steps_per_print: each rank's log line (step, loss, lr, loss scale, step "
                             "time, memory); missing or null: no log line, as DeepSpeed", auto=AUTO_DEFAULT),
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
    "fp16.auto_cast": _none("fxzero casts the floating inputs to float16 always (the cast is the program's first "
                            "node), as auto_cast true does; with false DeepSpeed leaves them as given"),
    "fp16.fp16_master_weights_and_grads": _off("float16 master weights and gradients are not in fxzero, which keeps "
                                               "fp32 masters and gradients (what the update reads)"),
    "bf16": _section("bfloat16 compute, with fp32 or bfloat16 masters (\"bfloat16\" is the same section)"),
    "bf16.enabled": _used("MixedPrecision(param_dtype=torch.bfloat16)"),
    "bf16.immediate_grad_update": _none("fxzero reduces each unit's gradient as the backward produces it"),
    "bf16.check_grad_overflow": _none("fxzero checks the loss for non-finite values at every bfloat16 step"),
    "bf16.bf16_master_weights_and_grads": _used("true: MixedPrecision(master_dtype=torch.bfloat16): the bfloat16 "
                                                "parameters are the masters the update writes (no fp32 copy), their "
                                                "gradients bfloat16 (reduced in bf16 unless communication_data_type "
                                                "is \"fp32\"); ZeRO stages 1-3, as DeepSpeed. Without "
                                                "bf16_optimizer_states the states stay fp32, on any tier (DeepSpeed: "
                                                "only offloaded to the cpu; said once)"),
    "bf16.bf16_optimizer_states": _used("true: MixedPrecision(optimizer_dtype=torch.bfloat16): the optimizer's "
                                        "states in bfloat16, on any tier; needs bf16_master_weights_and_grads, "
                                        "as DeepSpeed"),
    "communication_data_type": _used("missing or null (DeepSpeed's default): gradients reduced in the compute dtype "
                                     "(MixedPrecision.reduce_dtype=None), as DeepSpeed; \"fp32\": in fp32; "
                                     "\"bf16\"/\"fp16\": the compute dtype, named"),
    "seq_parallel_communication_data_type": _none(_PARALLEL),
    "torch_autocast": _section("the engine's forward under torch.autocast (fxzero.Autocast)"),
    "torch_autocast.enabled": _used("true: Config.autocast=Autocast(dtype): every engine call runs under "
                                    "torch.autocast(<device type>, dtype), the caller's autocast replaced, as "
                                    "DeepSpeed's engine does; the program is traced under it"),
    "torch_autocast.dtype": _used("Autocast.dtype: \"bfloat16\" (any of DeepSpeed's names for it), or "
                                  "\"float16\" with \"fp16\" enabled (its loss scaling); required (DeepSpeed's "
                                  "missing dtype is the device's autocast default)"),
    "torch_autocast.lower_precision_safe_modules": _none("fxzero gathers and reduces every parameter in the dtype it "
                                                         "is held in; DeepSpeed moves these modules' parameters and "
                                                         "gradients (Linear, Conv by default) in the autocast dtype, "
                                                         "which differs only for an fp32 model"),
    "data_types": _section("dtypes of accumulation buffers"),
    "data_types.grad_accum_dtype": _off("fxzero accumulates gradients in fp32", honoured=(None, "fp32")),
    "data_types.param_dtype": _off("fxzero's compute dtype is the \"bf16\"/\"fp16\" section's", honoured=None),
    "data_types.buffer_dtype": _off("fxzero keeps buffers in the model's own dtype", honoured=None),
    "data_types.keep_in_fp32_modules": _off("fxzero casts every floating parameter of a unit",
                                            honoured=("auto", None)),
    "prescale_gradients": _used("true: DeepSpeed's stage 0 divides each gradient by the world size before the "
                                "sum, fxzero after it (Config.gradient_division; at stages 1-3 both divide before, "
                                "as DeepSpeed's reduce-scatters do): the same average (in fp32, dividing by a "
                                "power-of-two world before or after the sum rounds alike). "
                                "Under fp16 with no communication_data_type fxzero then reduces in fp32, so the "
                                "sum cannot overflow where DeepSpeed's divided one would not (said once)"),
    "gradient_predivide_factor": _used("f != 1: DeepSpeed divides by f before the sum and by world/f after, fxzero "
                                       "by the world after: the same average, reduced in fp32 under fp16 as for "
                                       "prescale_gradients (said once)"),
    "gradient_allreduce_op": _used("Config.gradient_reduction: \"mean\" (DeepSpeed's default) averages the "
                                   "gradients over ranks, \"sum\" sums them (at every stage; DeepSpeed refuses "
                                   "it at stage 3)"),
    "fp32_allreduce": _none("DeepSpeed 0.19 does not read it either: communication_data_type sets the dtype "
                            "gradients are reduced in"),
    "sparse_gradients": _off("sparse gradient compression of embeddings (removed from DeepSpeed 0.19 too): fxzero "
                             "reduces dense gradients"),
    "amp": _off("apex AMP (removed from DeepSpeed 0.19 too): use the \"bf16\" or \"fp16\" section",
                honoured=({}, {"enabled": False})),
    # -- ZeRO ---------------------------------------------------------------------------------
    "zero_optimization": _section("ZeRO stage, offload and persistence"),
    "zero_optimization.stage": _used("Config.stage 1, 2 or 3. Stage 0 (plain data parallelism; DeepSpeed's default "
                                     "where the key is missing) runs as ZeRO stage 1, said once: the same averaged "
                                     "gradients and the same update, with the optimizer states sharded"),
    "zero_optimization.contiguous_gradients": _none("fxzero's gradients are flat, contiguous per unit already"),
    "zero_optimization.reduce_scatter": _used("where ZeRO-1/2 divide the gradient sum by the world size "
                                              "(Config.gradient_division): true (DeepSpeed's default) divides each "
                                              "rank's gradient before the sum, false after it (an all-reduce, "
                                              "postscaled); whether a unit is reduce-scattered or all-reduced fxzero's "
                                              "cost model chooses"),
    "zero_optimization.reduce_bucket_size": _none(_BUCKETS),
    "zero_optimization.allgather_partitions": _none("ZeRO-1/2 re-gather the updated parameters with all-gathers "
                                                    "always"),
    "zero_optimization.allgather_bucket_size": _none(_BUCKETS),
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
    "zero_optimization.offload_optimizer.super_offload": _off("SuperOffload (Superchip CPU offload) is not in "
                                                              "fxzero"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _none("fxzero's update uses torch's threads"),
    "zero_optimization.cpu_offload": _used("(deprecated) true: offload_optimizer on cpu"),
    "zero_optimization.cpu_offload_param": _used("(deprecated) true: offload_param on cpu"),
    "zero_optimization.cpu_offload_use_pin_memory": _used("(deprecated) Cpu.pin_memory"),
    "zero_optimization.zenflow": _off("ZenFlow (offload with top-k gradient updates between full ones) is not in "
                                      "fxzero", honoured=None),
    "zero_optimization.sub_group_size": _none("fxzero updates one unit's shard at a time"),
    "zero_optimization.stage3_prefetch_bucket_size": _none("fxzero's prefetch is bounded in bytes by "
                                                           "Prefetch.max_live_bytes, sized from the schedule"),
    "zero_optimization.stage3_param_persistence_threshold": _used(
        "Config.persist_threshold, per unit: a unit with fewer parameters is held whole. DeepSpeed's is per "
        "parameter; fxzero warns when a unit it shards holds parameters DeepSpeed would keep whole"),
    "zero_optimization.stage3_model_persistence_threshold": _none("fxzero bounds persistence per unit only"),
    "zero_optimization.stage3_max_live_parameters": _none("fxzero's prefetch is bounded in bytes by "
                                                          "Prefetch.max_live_bytes"),
    "zero_optimization.stage3_max_reuse_distance": _used("0: every unit is gathered again for the backward "
                                                         "(Prefetch(keep_for_backward=False)); > 0: kept where "
                                                         "the prefetch budget allows"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _used(
        "engine.zero_gather_16bit_weights_on_model_save() answers it, as DeepSpeed's engine does: Hugging Face's "
        "Trainer and accelerate save the 16-bit weights when true, a checkpoint when false. fxzero's own "
        "save_16bit_model() and engine.full_state_dict() gather in either case"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _used("(deprecated) as "
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
    "zero_optimization.mics_shard_size": _off("MiCS (removed from DeepSpeed 0.19 too): fxzero shards over the whole "
                                              "world", honoured=(-1,)),
    "zero_optimization.mics_hierarchical_params_gather": _off("MiCS (removed from DeepSpeed 0.19 too): fxzero shards "
                                                              "over the whole world"),
    "zero_optimization.zeropp_loco_param": _off("LoCo-ZeRO++ (removed from DeepSpeed 0.19 too): fxzero gathers and "
                                                "reduces unquantized values", honoured=None),
    "zero_optimization.memory_efficient_linear": _none("fxzero traces the model's own linear layers"),
    "zero_optimization.pipeline_loading_checkpoint": _none("no checkpoint loading yet (the checkpoint issue)"),
    "zero_optimization.override_module_apply": _none("fxzero does not patch modules"),
    "zero_optimization.log_trace_cache_warnings": _none("fxzero traces one static program per input signature"),
    "zero_optimization.enable_sanity_checks": _none("fxzero validates every schedule it builds"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": _none("fxzero has no Muon optimizer"),
    "zero_optimization.leaf_module": _used(
        "Config.leaf_modules (fxzero.LeafModules: classes, names, name_suffixes, DeepSpeed's default classes kept "
        "beside names given): modules whose parameters are never split across units, read whole by "
        "fxzero/config/deepspeed.py"),
    # -- features fxzero does not have (an error where they would change training) ------------
    "activation_checkpointing": _section("activation checkpointing: fxzero recomputes every unit's forward in the "
                                         "backward (Activations(recompute=\"unit\")) with no model edits, where "
                                         "DeepSpeed's needs the model to call deepspeed.checkpointing.checkpoint"),
    "activation_checkpointing.partition_activations": _none(
        "splits each checkpoint over model-parallel ranks; fxzero has no model parallelism: each rank keeps its own "
        "micro-batch's unit inputs"),
    "activation_checkpointing.cpu_checkpointing": _used(
        "Activations(offload=fxzero.Cpu()): what each unit keeps waits in host memory between its forward and its "
        "backward (on a CPU rank it is there already, which fxzero says once)"),
    "activation_checkpointing.contiguous_memory_optimization": _none(
        "copies checkpoints into one preallocated buffer; fxzero keeps the program's own tensors"),
    "activation_checkpointing.number_checkpoints": _none("sizes that buffer; fxzero keeps one input per unit"),
    "activation_checkpointing.synchronize_checkpoint_boundary": _none(
        "synchronizes the device at each checkpoint, for profiling; fxzero adds no host sync"),
    "activation_checkpointing.profile": _none(
        "times the checkpointed forwards for DeepSpeed's log; fxzero's timeline is `fxzero schedule --trace`"),
    "aio": _none("fxzero's NVMe I/O uses O_DIRECT and its own thread pool (Nvme.threads)"),
    "checkpoint": _none("options of DeepSpeed's own checkpoint format (tag validation, universal checkpoints, "
                        "node-local storage, parallel writing); fxzero writes torch.distributed.checkpoint's "
                        "(docs/checkpoints.md), which loads at another world size without a conversion"),
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
    "elasticity": _off("elastic training (removed from DeepSpeed 0.19 too): fxzero's world is fixed at launch",
                       honoured=({}, {"enabled": False})),
    "autotuning": _none("configures DeepSpeed's autotuner (`deepspeed --autotuning`), which runs the script under "
                        "candidate configs and stops each after its profiled steps; fxzero's compiler picks its "
                        "schedule with its cost model, and this run trains with the config's own values"),
    "compression_training": _off("DeepSpeed's compression library, quantization-aware training, pruning and layer "
                                 "reduction (removed from DeepSpeed 0.19 too), is not in fxzero", honoured={}),
    "data_efficiency": _used("random layer-token drop (data_routing.random_ltd) runs as Config.random_ltd "
                             "(fxzero.config.random_ltd.RandomLTD); the section is read whole, key by key, by "
                             "fxzero/config/random_ltd.py (docs/random_ltd.md); data sampling (curriculum learning, "
                             "dynamic batching) is an error unless switched off"),
    "curriculum_learning": _off("curriculum learning (removed from DeepSpeed 0.19 too) is not in fxzero",
                                honoured=({}, {"enabled": False})),
    "progressive_layer_drop": _off("progressive layer dropping (removed from DeepSpeed 0.19 too) is not in fxzero",
                                   honoured=({}, {"enabled": False})),
    "quantize_training": _off("Mixture-of-Quantization, MoQ (removed from DeepSpeed 0.19 too), is not in fxzero",
                              honoured=({}, {"enabled": False})),
    "eigenvalue": _off("eigenvalue-based MoQ (removed from DeepSpeed 0.19 too) is not in fxzero",
                       honoured=({}, {"enabled": False})),
    "graph_harvesting": _off("graph harvesting (removed from DeepSpeed 0.19 too) is not in fxzero"),
    "sparse_attention": _off("sparse attention (removed from DeepSpeed 0.19 too) is not in fxzero", honoured=None),
    "pipeline": _none("configures DeepSpeed's PipelineModule, which fxzero does not have"),
    "hybrid_engine": _used("enabled: Config.gather_for_generate, the model's generate gathers the ZeRO-3 model once "
                           "per call (DeepSpeed's hybrid engine, without its inference kernels); "
                           "inference_tp_size other than 1 is an error (no tensor-parallel generation); "
                           "max_out_tokens, release_inference_cache, pin_parameters, tp_gather_partition_size and "
                           "enable_cuda_graph size or tune its inference kernels: no effect"),
    "tensor_parallel": _off(f"tensor parallelism (AutoTP): {_PARALLEL}", honoured={}),
    "expert_parallel": _off(f"expert parallelism: {_PARALLEL}", honoured={}),
    "sequence_parallel_size": _off(f"sequence parallelism: {_PARALLEL}", honoured=1),
    "weight_quantization": _off(_QUANT),
    "nebula": _off("Nebula checkpoints (removed from DeepSpeed 0.19 too) are not in fxzero",
                   honoured=({}, {"enabled": False})),
    "datastates": _off("fxzero writes no DataStates checkpoints", honoured=({}, {"enabled": False})),
    "compile": _off("DeepCompile and torch.compile of the module (DeepSpeed's engine.compile()) are not in fxzero, "
                    "which compiles the model into its own programs", honoured={}),
    "vocabulary_size": _none("only DeepSpeed's tensor-core alignment warning reads it"),
    "use_data_before_expert_parallelism": _none(_PARALLEL),
    "disable_python_gc": _none("fxzero leaves Python's garbage collector alone"),
    "memory_efficient_linear": _none("fxzero traces the model's own linear layers"),
}


def _auto_in_pydantic_sections(keys: dict[str, Key]) -> dict[str, Key]:
    """KEYS with "auto" resolving to the default for each key directly in a section DeepSpeed
    drops "auto" from (_PYDANTIC_SECTIONS), where it has a default."""
    out = {}
    for path, key in keys.items():
        direct = any(path.startswith(p) and "." not in path[len(p):] for p in _PYDANTIC_SECTIONS)
        if direct and key.kind != SECTION and not key.has_auto and path in DEFAULTS:
            key = dataclasses.replace(key, auto=AUTO_DEFAULT)
        out[path] = key
    return out


KEYS = _auto_in_pydantic_sections(KEYS)

OPTIMIZER_PARAMS: dict[str, dict[str, Key]] = {
    "adam": {
        "lr": _used("AdamW.lr / Adam.lr (the initial lr of every param group)"),
        "betas": _used("betas"),
        "eps": _used("eps"),
        "weight_decay": _used("weight_decay: decoupled for AdamW (adam_w_mode true), L2 for Adam; missing: the "
                              "default of the class DeepSpeed builds (0, or torch.optim.AdamW's 0.01 with "
                              "torch_adam)"),
        "adam_w_mode": _used("true (DeepSpeed's default, also for \"Adam\"): AdamW; false: Adam with L2 decay"),
        "torch_adam": _used("true: DeepSpeed builds torch.optim.AdamW (or Adam), so its defaults apply to the "
                            "params not given; fxzero's update has torch.optim's arithmetic either way"),
        "fused": _none("fxzero's update is one per unit shard"),
        "bias_correction": _used("false: AdamW/Adam(bias_correction=False), the moments used uncorrected as "
                                 "FusedAdam and DeepSpeedCPUAdam do"),
        "amsgrad": _used("amsgrad: AdamW/Adam with torch.optim's AMSGrad (the running maximum of the second "
                         "moment)"),
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


def _policy_params(policy: type) -> dict[str, Key]:
    """An element-wise optimizer's params: its policy's fields, each used as torch.optim names it."""
    return {f.name: _used(f"{policy.__name__}.{f.name}") for f in dataclasses.fields(policy)}


OPTIMIZER_PARAMS["lion"] = _policy_params(Lion)
OPTIMIZER_PARAMS["lamb"] = {
    **_policy_params(Lamb),
    "amsgrad": _off("FusedLamb has no AMSGrad (it raises for true)"),
}
for _policy in ELEMENTWISE_TORCH:
    OPTIMIZER_PARAMS[_policy.TORCH] = _policy_params(_policy)

OPTIMIZER_TYPES: dict[str, tuple[str, ...]] = {"adam": ("Adam", "AdamW"), "adagrad": ("Adagrad",), "lion": ("Lion",),
                                               "lamb": ("Lamb",), **{p.TORCH: (p.TORCH,) for p in ELEMENTWISE_TORCH}}
"""The "optimizer" "type" values that read each `OPTIMIZER_PARAMS` table: DeepSpeed's own types
case-insensitively; a torch.optim class by its exact name, as DeepSpeed looks it up."""


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
    off = " (or any section whose every `enabled` is false)" if key.honours_switched_off else ""
    return "error unless " + " or ".join(_json(v) for v in key.honoured_values) + off


def _auto(path: str, key: Key) -> str:
    """What `"auto"` resolves to (the "auto" column)."""
    if not key.has_auto:
        return "error"
    if key.auto == AUTO_IMPLIED:
        return "implied by the other two"
    return _json(DEFAULTS[path]) if path in DEFAULTS else "accepted"


def _default(path: str) -> str:
    """DeepSpeed's default (the "default" column); empty where DeepSpeed reads none."""
    return _json(DEFAULTS[path]) if path in DEFAULTS else ""


def _key_rows(keys: dict[str, Key]) -> list[str]:
    rows = ['| key | fxzero | default | "auto" | why |', "|---|---|---|---|---|"]
    for path, key in keys.items():
        rows.append(f"| `{path}` | {_cell(_effect(key))} | {_cell(_default(path))} | {_cell(_auto(path, key))} "
                    f"| {_cell(key.why)} |")
    return rows


def _optimizer_default_rows() -> list[str]:
    rows = ["| class | defaults |", "|---|---|"]
    for cls, defaults in OPTIMIZER_DEFAULTS.items():
        rows.append(f"| `{cls}` | " + ", ".join(f"`{p}` {_cell(_json(v))}" for p, v in defaults.items()) + " |")
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
           "", "### Keys", "",
           f"The default column is DeepSpeed {DEEPSPEED_VERSION}'s, what a missing key means "
           "(`fxzero/config/deepspeed_defaults.py`, checked against DeepSpeed's source).", ""]
    out += _key_rows(KEYS)
    for table, keys in OPTIMIZER_PARAMS.items():
        types = " or ".join(f'`"{t}"`' for t in OPTIMIZER_TYPES.get(table, (table,)))
        out += ["", f"### Optimizer params (`optimizer.type` {types})", ""]
        out += _key_rows({f"optimizer.params.{name}": key for name, key in keys.items()})
    out += ["", "### Optimizer defaults", "",
            "A param the config leaves out takes the default of the class DeepSpeed builds for the section: for "
            '`"Adam"`/`"AdamW"`, `torch.optim.AdamW` (or `Adam` with `"adam_w_mode": false`) with `"torch_adam": '
            'true`, `DeepSpeedCPUAdam` with the optimizer states offloaded, `FusedAdam` otherwise; for '
            '`"Adagrad"`, `DeepSpeedCPUAdagrad` offloaded, `torch.optim.Adagrad` otherwise; `"Lion"`, '
            '`DeepSpeedCPULion` or `FusedLion`; `"Lamb"`, `FusedLamb`; a type DeepSpeed does not build itself, the '
            "`torch.optim` class of that name (`fxzero.config.deepspeed_defaults.deepspeed_optimizer`).", ""]
    out += _optimizer_default_rows()
    out += ["", "### Scheduler types and params", "",
            'The `"scheduler"` section is `{"type": ..., "params": {...}}`; a param not given takes the default '
            "shown (DeepSpeed's), a required one is an error when missing, and `\"auto\"` is an error.", ""]
    for name, cls in SCHEDULES.items():
        out.append(f"- {_json(name)}: {' '.join((cls.__doc__ or '').split())}")
    out += [""] + _schedule_rows()
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")

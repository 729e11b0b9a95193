"""`Config`: everything `fxzero.compile` needs besides the model.

A `Config` says how a model is split into units, which ZeRO stage to run and how the
optimizer behaves. Stages 1, 2 and 3 are not separate code paths: they are different
settings of the same passes (see `fxzero/passes/README.md`):

====== ======================== =========================== =========================
stage  parameters between uses  gradients after backward    optimizer states
====== ======================== =========================== =========================
1      full, persistent         full flat buffer kept;      this rank's shard
                                rank's slice reduced
2      full, persistent         shard only (full freed)     this rank's shard
3      shard; gathered per use  shard only                  this rank's shard
====== ======================== =========================== =========================
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any, Literal, Optional, Union

import torch

from fxzero.config.activations import Activations
from fxzero.config.deepspeed import read_deepspeed
from fxzero.config.notices import print_once, warn_ineffective
from fxzero.config.placement import Offload
from fxzero.config.precision import Autocast, MixedPrecision
from fxzero.config.policies import (OPTIMIZERS, AdamW, Bucket, LeafModules, LinkEmulation, OptimizerPolicy, Prefetch,
                                    UnitsPolicy)
from fxzero.config.random_ltd import RandomLTD
from fxzero.config.tiling import Tiling

__all__ = ["TRANSPORTS", "Config"]


TRANSPORTS = ("auto", "shared_memory", "process_group")
"""Values of `Config.transport`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Everything `fxzero.compile` needs besides the model."""

    stage: Literal[1, 2, 3] = 3
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    units: UnitsPolicy = UnitsPolicy()
    """How parameters are grouped into units (the sharding granularity)."""
    leaf_modules: LeafModules = LeafModules()
    """Modules flagged as leaves when the engine starts, never split across units (DeepSpeed's
    `zero_optimization.leaf_module`; by default its classes, the sparse mixture-of-experts blocks of
    Mixtral, Qwen2-MoE and Qwen3-MoE). `LeafModules(classes=())` flags none."""
    optimizer: OptimizerPolicy = AdamW()
    """The optimizer run on each rank's shard: one of `fxzero.config.OPTIMIZERS` (AdamW, Adam,
    Adagrad, SGD, Lion and torch.optim's other element-wise ones, and Lamb), whose declared states
    the step program keeps per element (two for AdamW, Adam and Lamb, one for Adagrad, ...)."""
    seed: int = 0
    """Seed for initializing a model built on the meta device by its own init code (each layer's
    `reset_parameters()`, then the model's `_init_weights`): the values eager construction after
    `torch.manual_seed(seed)` gives."""
    prefetch: Optional[Prefetch] = Prefetch()
    """ZeRO-3: how far ahead all-gathers start; None issues each right before its first use."""
    persist_threshold: int = 0
    """ZeRO-3: units with fewer parameters than this stay gathered for the whole step (like
    stage3_param_persistence_threshold): no per-layer gathers, re-gathered after the step."""
    bucket: Optional[Bucket] = None
    """Merge adjacent small units into buckets (off by default: units are the buckets)."""
    link_emulation: Optional[LinkEmulation] = None
    """Emulate a slower link for every collective (for studying overlap on one box)."""
    transport: str = "auto"
    """How collectives move their data. "auto": through shared memory when every rank runs on
    this host with gloo (CPU buffers; `fxzero/runtime/comm/shm.py`), else the process group;
    "shared_memory": that, or an error before training; "process_group": torch.distributed's
    collectives (gloo over loopback TCP, NCCL) always."""
    collective_timeout: float = 300.0
    """Seconds any collective waits for the other ranks before it is an error naming the rank,
    the program, the instruction and its unit (a rank that died or went another way)."""
    offload: Offload = Offload()
    """Where parameter shards, gradients and optimizer states live between uses (cpu, nvme)."""
    activations: Activations = Activations()
    """What the forward keeps for the backward: everything (default), or with
    `Activations(recompute="unit")` each unit's inputs, its forward recomputed in the backward
    ([Note: recomputing a unit] in `fxzero/config/activations.py`)."""
    tiling: Optional[Tiling] = None
    """ZeRO-3: compute each Linear or Embedding whose gathered weight exceeds `Tiling.max_bytes` as
    tiles of its weight's rows, each gathered, used and freed on its own (memory-centric tiling; docs/tiling.md);
    None: every operator's weight is gathered whole."""
    gradient_accumulation_steps: Optional[int] = None
    """Micro-steps per optimizer step: `engine.step()` updates at every n-th call; the gradients of
    the calls between accumulate in the gradient shards (each backward's loss divided by n, as
    DeepSpeed does). None: implied by the two batch sizes below when both are given, else 1."""
    gradient_accumulation: Literal["sharded", "local"] = "sharded"
    """How micro-steps accumulate. "sharded" (DeepSpeed's and FSDP2's default): every micro-step
    reduce-scatters and adds into the fp32 gradient shard, 16 Phi / N bytes of model states and a
    reduce-scatter per micro-step. "local" (FSDP2's `set_requires_gradient_sync(False)`): the
    micro-steps before the boundary add into a full gradient this rank keeps (4 Phi bytes more in
    fp32) and only the boundary's backward reduces: one reduce-scatter per optimizer step."""
    train_batch_size: Optional[int] = None
    """Samples per optimizer step over all ranks (DeepSpeed's); with the two fields around it, one
    triple checked against the world size when the engine starts (`fxzero/config/batch.py`)."""
    train_micro_batch_size_per_gpu: Optional[int] = None
    """Samples per rank per forward: the batch `fxzero.initialize`'s dataloader yields."""
    nonfinite: Literal["error", "skip"] = "error"
    """What a step whose loss is not finite on some rank does (bfloat16, fp32; float16's
    overflowing gradients always skip, and back off the loss scale): "error" raises on every
    rank naming the step and the first unit whose gradient is not finite; "skip" warns so and
    skips the update on every rank (counted in `engine.skipped_steps`)."""
    gradient_reduction: Literal["mean", "sum"] = "mean"
    """How each gradient is combined over the ranks: "mean" (the average, as DDP, FSDP and
    DeepSpeed's default) or "sum" (DeepSpeed's `gradient_allreduce_op: "sum"`: world size times
    the average; each rank's backward is run with its output gradients times the world size
    before the averaging reduction, exact for a power-of-two world)."""
    gradient_division: Literal["after", "before"] = "after"
    """Where the average's division by the world size happens: "after" the sum (DDP, DeepSpeed's
    stage 0), or "before" it, each rank's gradient divided first (DeepSpeed's ZeRO-1/2/3, whose
    reduce-scatters divide their buffers before reducing them: what `from_deepspeed` sets there). The same average in fp32 and bf16 for a power-of-two world, where dividing by it
    is exact; in float16 a sum can overflow after where it does not before, which is a skipped
    step and a halved loss scale under one and not the other."""
    gradient_clipping: Optional[float] = None
    """Clip the gradient's global norm (over all ranks' shards) to this before each update, as
    torch.nn.utils.clip_grad_norm_ (DeepSpeed's gradient_clipping); None: no clipping."""
    lr_schedule: Any = None
    """The learning rate over the optimizer steps: one of DeepSpeed's schedules
    (`fxzero.WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`, `LRRangeTest`), stepped by
    the engine at each boundary; None: constant (or a torch scheduler the user steps)."""
    random_ltd: Optional[RandomLTD] = None
    """Random layer-token drop (`fxzero.config.random_ltd.RandomLTD`, DeepSpeed's
    data_efficiency.data_routing.random_ltd): the layers a script converts run on a scheduled
    number of random tokens in training; None: off. See docs/random_ltd.md."""
    gather_for_generate: bool = False
    """At ZeRO-3, the model's `generate` (a Hugging Face model's) gathers the whole model once, in the
    compute dtype, for the call, and releases it at its end, where a model called directly gathers
    each layer at each forward, once per generated token ([Note: calling a ZeRO-3 model directly]).
    DeepSpeed's hybrid engine (`hybrid_engine.enabled`, DeepSpeed-Chat's --enable_hybrid_engine)
    does so, and then generates with its inference kernels; fxzero runs the model's own forward, so
    the tokens are those the model computes without it. The rank holds the whole model in the
    compute dtype while it generates. No effect below ZeRO-3."""
    dataloader_drop_last: bool = False
    """Whether the dataloader `fxzero.initialize` returns drops each epoch's last, incomplete batch."""
    steps_per_print: Optional[int] = None
    """Every n optimizer steps, each rank logs the step, loss, lr, loss scale, step time and memory
    (DeepSpeed's log line); None: no log line."""
    mixed_precision: Optional[MixedPrecision] = None
    """Compute and gather in bfloat16 or float16, with fp32 master shards or masters in that dtype
    (`fxzero.MixedPrecision`); None trains in the model's own dtype (fp32)."""
    autocast: Optional[Autocast] = None
    """Run the model under torch.autocast (`fxzero.Autocast`, DeepSpeed's "torch_autocast");
    None: under whatever autocast the caller entered, if any."""
    program_cache_size: int = 16
    """Compiled programs an engine keeps: one per input structure, constants, shapes, module
    modes, autocast and grad mode it was called with. Past it the least recently used program is
    evicted (a warning says so: a workload cycling through more call signatures than this
    recompiles)."""
    keep_host_memory: bool = False
    """On a machine without CUDA, keep freed host memory in the process instead of unmapping it
    (glibc; see fxzero/runtime/host_memory.py): the per-unit buffers then cost no page faults,
    but freed blocks of other sizes are kept too, so resident memory grows (1B offloaded to
    NVMe, 2 ranks: step 45 -> 39.5 s, peak RSS per rank 2.5 -> 8.5 GB). Off by default."""
    cost_model: Any = "measure"
    """What prices the compiler's choices (e.g. reduce-scatter vs all-reduce): "measure"
    calibrates this machine when the engine starts (rank 0's figures, shared by all ranks), a
    preset name from `fxzero.cost.PRESETS`, a `fxzero.cost.CostModel`, or None (native
    collectives, no choices). Checked when the engine starts (`fxzero.cost.resolve`), where the
    cost models live."""

    deepspeed_source: Optional[dict[str, Any]] = dataclasses.field(default=None, compare=False, repr=False)
    """The DeepSpeed config this Config was read from (`from_deepspeed`; a copy), which `get`
    answers from; None for a Config built in Python. Not compared: two Configs that train alike
    are equal however they were written."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"Config.stage must be 1, 2 or 3, got {self.stage!r}")
        if self.random_ltd is not None and not isinstance(self.random_ltd, RandomLTD):
            raise TypeError(f"Config.random_ltd must be a fxzero.config.random_ltd.RandomLTD or None, got "
                            f"{type(self.random_ltd).__name__}")
        if self.tiling is not None and not isinstance(self.tiling, Tiling):
            raise TypeError(f"Config.tiling must be a fxzero.Tiling or None, got {type(self.tiling).__name__}")
        if not isinstance(self.program_cache_size, int) or self.program_cache_size < 1:
            raise ValueError(f"Config.program_cache_size must be an int >= 1, got {self.program_cache_size!r}")
        if not isinstance(self.units, UnitsPolicy):
            raise TypeError(f"Config.units must be a fxzero.UnitsPolicy, got {type(self.units).__name__}")
        if not isinstance(self.leaf_modules, LeafModules):
            raise TypeError(f"Config.leaf_modules must be a fxzero.LeafModules, got {type(self.leaf_modules).__name__}")
        if not isinstance(self.optimizer, OptimizerPolicy):
            raise TypeError(f"Config.optimizer must be an fxzero optimizer policy ("
                            f"{', '.join('fxzero.' + p.__name__ for p in OPTIMIZERS)}), got "
                            f"{type(self.optimizer).__name__}")
        if self.prefetch is not None and not isinstance(self.prefetch, Prefetch):
            raise TypeError(f"Config.prefetch must be a fxzero.Prefetch or None, got {type(self.prefetch).__name__}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"Config.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.offload, Offload):
            raise TypeError(f"Config.offload must be a fxzero.Offload, got {type(self.offload).__name__}")
        if self.offload.offloaded("param") and self.stage != 3:
            raise ValueError(
                f"Config.offload.params={self.offload.params!r} needs stage=3: at stage {self.stage} "
                "every rank holds the whole parameters; offload the optimizer states instead "
                "(Offload(optimizer=...)), or use stage=3"
            )
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            raise TypeError(
                f"Config.mixed_precision must be a fxzero.MixedPrecision or None, got {type(self.mixed_precision).__name__}"
            )
        mp = self.mixed_precision
        if self.autocast is not None and not isinstance(self.autocast, Autocast):
            raise TypeError(f"Config.autocast must be a fxzero.Autocast or None, got {type(self.autocast).__name__}")
        if self.autocast is not None and self.autocast.dtype is torch.float16 and (
                mp is None or mp.param_dtype is not torch.float16):
            raise ValueError("Config(autocast=Autocast(dtype=torch.float16)) needs loss scaling to keep float16 "
                             "gradients representable, which fxzero gives with "
                             "mixed_precision=MixedPrecision(param_dtype=torch.float16); set that, or autocast to "
                             "torch.bfloat16")
        if self.autocast is not None and mp is not None and self.autocast.dtype is not mp.param_dtype:
            raise ValueError(f"Config.autocast.dtype {self.autocast.dtype} and mixed_precision.param_dtype "
                             f"{mp.param_dtype} differ: autocast to the compute dtype")
        if mp is not None and mp.loss_scale is not None and self.offload.step_in_backward:
            raise ValueError(
                "Config(mixed_precision=MixedPrecision(param_dtype=torch.float16)) checks every step's gradients "
                "for overflow before anything is updated, so its updates must run in step(): drop "
                "Offload(step_in_backward=True), or use bfloat16"
            )
        for name in ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"Config.{name} must be an int >= 1 (or None), got {value!r}")
        if self.gradient_accumulation not in ("sharded", "local"):
            raise ValueError(f"Config.gradient_accumulation must be \"sharded\" or \"local\", got "
                             f"{self.gradient_accumulation!r}")
        if self.gradient_division not in ("after", "before"):
            raise ValueError(f"Config.gradient_division must be \"after\" or \"before\", got {self.gradient_division!r}")
        if self.gradient_reduction not in ("mean", "sum"):
            raise ValueError(f"Config.gradient_reduction must be \"mean\" or \"sum\", got {self.gradient_reduction!r}")
        if self.nonfinite not in ("error", "skip"):
            raise ValueError(f"Config.nonfinite must be \"error\" or \"skip\", got {self.nonfinite!r}")
        if self.steps_per_print is not None and not (isinstance(self.steps_per_print, int) and self.steps_per_print >= 1):
            raise ValueError(f"Config.steps_per_print must be an int >= 1 (or None: no log line), got "
                             f"{self.steps_per_print!r}")
        if (self.gradient_accumulation_steps or 1) > 1 and self.offload.step_in_backward:
            raise ValueError(
                "Config(gradient_accumulation_steps > 1) updates once per accumulation, after the last micro-step, "
                "and Offload(step_in_backward=True) updates in every backward: drop one of them")
        if self.gradient_clipping is not None and self.offload.step_in_backward:
            raise ValueError(
                "Config(gradient_clipping=...) scales every gradient by the global norm, known only after the whole "
                "backward, and Offload(step_in_backward=True) updates each unit during it: drop one of them")
        if self.gradient_clipping is not None and not self.gradient_clipping > 0:
            raise ValueError(f"Config.gradient_clipping must be > 0 (None: no clipping), got {self.gradient_clipping!r}")
        if not (isinstance(self.collective_timeout, (int, float)) and 0 < self.collective_timeout <= 1e7):
            raise ValueError(f"Config.collective_timeout must be seconds in (0, 1e7], got {self.collective_timeout!r}")
        if self.persist_threshold < 0:
            raise ValueError(f"Config.persist_threshold must be >= 0 parameters, got {self.persist_threshold}")

    def persistent(self, numel: int) -> bool:
        """Whether a unit of `numel` parameters is held whole for the whole step."""
        return self.stage in (1, 2) or numel < self.persist_threshold

    @classmethod
    def from_deepspeed(cls, ds: Union[dict[str, Any], str, os.PathLike]) -> "Config":
        """Build a Config from a DeepSpeed config dict or JSON file, read strictly (every key used,
        warned about once where it changes nothing, or an error; see `fxzero.config.deepspeed`).
        The "auto" values it resolves, and how it gives what a key asks by other means (stage 0 as
        stage 1), are printed once."""
        reading = read_deepspeed(ds)
        warn_ineffective(reading.ineffective)
        print_once(reading.resolved + reading.notes)
        if not isinstance(ds, dict):
            with open(ds) as f:
                ds = json.load(f)
        return cls(**reading.fields, deepspeed_source=copy.deepcopy(ds))

    def get(self, key: str, default: Any = None) -> Any:
        """DeepSpeed's top-level config key `key` as the DeepSpeed config this Config was read
        from gives it (a copy), else `default`. DeepSpeed's `engine.config` is that dict, and code
        written for DeepSpeed reads it so (Hugging Face's Trainer:
        `engine.config.get("zero_optimization", {}).get("stage")`).

        Raises:
            ValueError: this Config was built in Python, not read from a DeepSpeed config.
        """
        if self.deepspeed_source is None:
            raise ValueError(f"Config.get({key!r}) reads the DeepSpeed config a Config was read from, and this one "
                             "was built in Python: read its fields instead (config.stage, config.optimizer, ...)")
        return copy.deepcopy(self.deepspeed_source.get(key, default))

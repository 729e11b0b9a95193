"""The configurations `fxzero plan` considers, and each as a DeepSpeed config and a `fxzero.Config`.

[Note: the plan's grid]
A candidate is a ZeRO stage, a micro-batch per GPU (with the gradient accumulation that makes
the global batch: global = micro-batch x accumulation x GPUs), what the backward recomputes
(`Activations(recompute="none" | "selective" | "unit")`, and "unit-attention": unit with
`keep_attention=True`, each unit's fused attention kept so its backward recomputes the rest) and where the model states wait
between uses (offload "none", or "cpu": the optimizer states, with the gradients, and at
ZeRO-3 the parameter shards too, in host memory, as DeepSpeed's offload_optimizer and
offload_param with device "cpu"). The grid is

    stages {3, 2} x micro-batches {the divisors of global / GPUs, up to --max-micro-batch (8)}
    x recompute {none, selective, unit-attention, unit} x offload {none, cpu}

in bf16 mixed precision with AdamW (fp32 masters and states, gradients reduced in bf16: what a
DeepSpeed config with "bf16" enabled trains). Left out, and why:
- ZeRO-1: fxzero runs it as ZeRO-2's program that keeps the full gradient buffer besides
  (`insert_reduce_scatter`'s keep_full): the same collectives and compute, more memory, so it
  is never the better choice;
- the prefetch budget: DeepSpeed's keys for it (stage3_max_live_parameters,
  stage3_prefetch_bucket_size) have no effect in fxzero, so a ds_config could not carry another
  than the default, which sizes it from the schedule (`Prefetch`: one unit of lookahead);
- NVMe offload and `gradient_accumulation="local"`: no DeepSpeed key says the one (a path is
  the user's), nor the other.

Every candidate is first a DeepSpeed config (`Candidate.deepspeed`); its `Config` is what
`Config.from_deepspeed` reads from that, so the ds_config.json the plan writes gives the
configuration it priced. Selective recompute and keeping attention are fxzero's own and DeepSpeed
has no key for them: their ds_config says "activation_checkpointing" (every unit recomputed, the
nearest), and the `Config` (`python_snippet`) is the exact one (`FXZERO_ONLY`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from fxzero.config import Activations, Config
from fxzero.config.deepspeed import read_deepspeed

__all__ = ["ACTIVATIONS", "FXZERO_ONLY", "MICRO_BATCH_CAP", "OFFLOADS", "RECOMPUTES", "STAGES", "Candidate",
           "micro_batches", "python_snippet"]

STAGES = (3, 2)
"""The ZeRO stages planned ([Note: the plan's grid]: why not 1)."""
RECOMPUTES = ("none", "selective", "unit-attention", "unit")
"""What the backward recomputes (`ACTIVATIONS`), from the least memory saved (and compute added)
to the most: selective keeps the matmuls' and attentions' outputs, unit-attention only the
attentions' (and each unit's inputs), unit only each unit's inputs."""
ACTIVATIONS = {
    "none": Activations(),
    "selective": Activations(recompute="selective"),
    "unit-attention": Activations(recompute="unit", keep_attention=True),
    "unit": Activations(recompute="unit"),
}
"""Each of `RECOMPUTES` as the policy a candidate compiles with (the names of `fxzero estimate
--activations`)."""
FXZERO_ONLY = frozenset({"selective", "unit-attention"})
"""The recomputes no DeepSpeed key says: their ds_config says "activation_checkpointing"."""
OFFLOADS = ("none", "cpu")
"""Where the model states wait: all on the device, or the optimizer's (and ZeRO-3's parameter
shards) in host memory."""
MICRO_BATCH_CAP = 8
"""The largest micro-batch per GPU tried by default (`--max-micro-batch`)."""

OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
"""The optimizer the plan prices (its states are what the memory counts): AdamW with
`fxzero.AdamW()`'s values, written out so the ds_config is ready to run; set your own lr."""


def micro_batches(global_batch: int, gpus: int, cap: int = MICRO_BATCH_CAP, only: Optional[int] = None) -> list[int]:
    """The micro-batches per GPU that make `global_batch` on `gpus` GPUs with a whole number of
    accumulation steps: the divisors of global_batch / gpus, up to `cap`; or `only`.

    Raises:
        ValueError: where global_batch is not a multiple of gpus (x `only`).
    """
    unit = gpus * (only or 1)
    if global_batch % unit:
        what = f"--gpus {gpus} x --micro-batch {only}" if only else f"--gpus {gpus}"
        raise ValueError(f"--global-batch {global_batch} is not divisible by {what} (global batch = micro-batch x "
                         f"accumulation x GPUs): give a multiple of {unit}, e.g. --global-batch "
                         f"{max(1, global_batch // unit) * unit}")
    if only:
        return [only]
    per_gpu = global_batch // gpus
    return [b for b in range(1, min(cap, per_gpu) + 1) if per_gpu % b == 0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration of the grid ([Note: the plan's grid])."""

    stage: Literal[2, 3]
    micro_batch: int
    """Samples per GPU per forward."""
    accumulation: int
    """Micro-steps per optimizer step."""
    recompute: Literal["none", "selective", "unit-attention", "unit"]
    offload: Literal["none", "cpu"]

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTES or self.offload not in OFFLOADS:
            raise ValueError(f"Candidate: recompute must be one of {RECOMPUTES} and offload one of {OFFLOADS}, "
                             f"got {self.recompute!r}, {self.offload!r}")

    @property
    def offloaded(self) -> str:
        """What offload "cpu" moves at this stage, in words."""
        if self.offload == "none":
            return "none"
        return "cpu (optimizer, params)" if self.stage == 3 else "cpu (optimizer)"

    def label(self) -> str:
        return (f"ZeRO-{self.stage}, micro-batch {self.micro_batch} x {self.accumulation} accumulation, "
                f"recompute {self.recompute}, offload {self.offloaded}")

    def deepspeed(self, gpus: int) -> dict[str, Any]:
        """This configuration as a DeepSpeed config for `gpus` GPUs (module doc)."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        ds: dict[str, Any] = {
            "train_batch_size": self.micro_batch * self.accumulation * gpus,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "optimizer": OPTIMIZER,
            "zero_optimization": zero,
        }
        if self.recompute != "none":
            ds["activation_checkpointing"] = {}
        return ds

    def config(self, gpus: int) -> Config:
        """The `Config` `Config.from_deepspeed(self.deepspeed(gpus))` builds (without its printed
        notes), with this candidate's own recompute where DeepSpeed has no key for it
        (`FXZERO_ONLY`)."""
        config = Config(**read_deepspeed(self.deepspeed(gpus)).fields)
        if self.recompute in FXZERO_ONLY:
            config = dataclasses.replace(config, activations=ACTIVATIONS[self.recompute])
        return config


def _names(value: Any, out: set[str]) -> None:
    """Class names a value's repr mentions (nested frozen dataclasses), for the snippet's import."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.add(type(value).__name__)
        for f in dataclasses.fields(value):
            _names(getattr(value, f.name), out)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _names(v, out)


def python_snippet(config: Config) -> str:
    """Python that builds `config`: `fxzero.Config(...)` with the fields that differ from
    `Config()`'s defaults, each as its repr (frozen dataclasses and torch dtypes)."""
    default = Config()
    fields = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(Config)
              if f.compare and getattr(config, f.name) != getattr(default, f.name)]  # (not deepspeed_source)
    names: set[str] = set()
    for _, v in fields:
        _names(v, names)
    lines = ["import torch", "", "import fxzero"]
    if names:
        lines.append(f"from fxzero.config import {', '.join(sorted(names))}")
    lines += ["", "config = fxzero.Config("]
    lines += [f"    {name}={value!r}," for name, value in fields]
    lines.append(")")
    return "\n".join(lines) + "\n"

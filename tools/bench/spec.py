"""What one benchmark run trains: the same for every system, so their figures compare."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

__all__ = ["BENCH_SHAPES", "MODEL_PRESETS", "RunSpec", "gpt_shape", "zoo_name"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything a rank needs to know besides which system it runs."""

    model: str
    """A GPT size from `fxzero.zoo.GPT_SIZES` ("tiny", "small", "gpt2", ...) or from
    `BENCH_SHAPES` ("gpt-1b"); `gpt_shape(model)` is its shape."""
    batch: int
    """Micro-batch per rank (sequences of `seq` tokens)."""
    seq: Optional[int] = None
    """Tokens per sequence, and the model's seq_len (its position table has that many rows);
    None: the model's own (`fxzero.zoo.GPT_SIZES`; 128 for "small"). Activations grow with it."""
    world_size: int = 2
    """Ranks, one process each, on gloo."""
    threads: int = 1
    """torch threads per rank (the ranks share the machine's cores)."""
    warmup: int = 2
    """Steps run before timing starts (fxzero traces and compiles in its first)."""
    steps: int = 6
    """Timed steps after the warm-up."""
    seed: int = 0
    """torch.manual_seed before the model is built: the initial weights of every system."""
    data_seed: int = 1234
    """Seed of the synthetic task and of every batch (see `common.make_batch`)."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    timeout_s: float = 900.0
    """A run whose ranks are not all done by then is killed and reported as failed."""

    def __post_init__(self) -> None:
        for name in ("batch", "world_size", "threads", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunSpec.{name} must be at least 1, got {getattr(self, name)}")
        if self.seq is not None and self.seq < 1:
            raise ValueError(f"RunSpec.seq must be at least 1 (or None: the model's own), got {self.seq}")
        if self.warmup < 0:
            raise ValueError(f"RunSpec.warmup must be >= 0, got {self.warmup}")

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        d: dict[str, Any] = json.loads(text)
        d["betas"] = tuple(d["betas"])
        return cls(**d)


BENCH_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # ~1.04B parameters (20 blocks of d 2048, 16 heads, vocab 8192, seq 128): big enough that
    # DeepSpeed's NVMe offload is bound by its I/O, small enough that two ranks building it
    # whole (as the DeepSpeed and state_dict runners do) fit in 24 GiB. Untied head, as zoo's
    # "2b": a tied one scores with the N(0, 1) embedding and starts at a loss of ~1200.
    "gpt-1b": ("1b", dict(vocab_size=8192, n_blocks=20, tie_head=False)),
}
"""Benchmark-only shapes: name -> (zoo size, GPTConfig fields overridden)."""


def zoo_name(model: str, seq: Optional[int] = None) -> tuple[str, dict[str, Any]]:
    """`(size, overrides)` such that `fxzero.zoo.gpt(size, **overrides)` builds `model`, with
    `seq_len=seq` unless `seq` is None."""
    base, overrides = BENCH_SHAPES.get(model, (model, {}))
    overrides = dict(overrides)
    if seq is not None:
        overrides["seq_len"] = seq
    return base, overrides


def gpt_shape(model: str, seq: Optional[int] = None):
    """The `fxzero.zoo.GPTConfig` of a benchmark model (a zoo size or a `BENCH_SHAPES` name),
    at sequence length `seq` unless None."""
    from fxzero.zoo import GPT_SIZES

    base, overrides = zoo_name(model, seq)
    if base not in GPT_SIZES:
        raise ValueError(f"unknown model {model!r}; choose one of {sorted(MODEL_PRESETS)}")
    return dataclasses.replace(GPT_SIZES[base], **overrides)


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # The issue's ~25M decoder: 6 blocks, d 512, vocab 8192, seq 128, untied head.
    "small": dict(model="small", batch=4),
    # GPT-2 small's shape (124M, tied head), seq 256.
    "gpt2": dict(model="gpt2", batch=2),
    # ~1.0B (BENCH_SHAPES): where ZeRO-Infinity's NVMe traffic dominates a step.
    "gpt-1b": dict(model="gpt-1b", batch=1),
    # For tests of the tool's plumbing: seconds per run.
    "tiny": dict(model="tiny", batch=2),
}
"""Default micro-batch per model (`--model` picks one; `--batch` overrides)."""

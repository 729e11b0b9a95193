"""What every rank does alike, whatever system it runs: model, data, timing, memory, traffic.

Same model, same weights: every system builds `fxzero.zoo.gpt(spec.model)` (with the overrides
of a benchmark-only shape, `spec.BENCH_SHAPES`) right after
`torch.manual_seed(spec.seed)`, eagerly (fxzero builds on the meta device and is handed the
eager model's state_dict, or initializes from the same seed; see `fxzero_engine.py`).

Same data: a synthetic, learnable task (as in `tools/demo.py`): each target token is a fixed
permutation of its input token. Rank r's batch at step s comes from its own generator seeded
by (data_seed, s, r), so every system sees exactly the same batches, round after round.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from tools.bench.spec import RunSpec, zoo_name

__all__ = [
    "DTYPES",
    "CheckpointedBlock",
    "Trainer",
    "build_model",
    "checkpoint_blocks",
    "checkpoint_report",
    "dtype_option",
    "loopback_bytes",
    "make_batch",
    "make_optimizer",
    "lm_loss",
    "nvme_parent",
    "nvme_scratch",
    "peak_rss_bytes",
    "rss_bytes",
]


class Trainer(Protocol):
    """One system's training loop body on this rank, built by a runner's `setup`."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward, loss, backward, optimizer step; returns this rank's loss before the update."""

    def reset_counters(self) -> None:
        """Called when timing starts: forget traffic the system counted itself so far."""

    def report(self) -> dict[str, Any]:
        """Anything system-specific for the JSON line (own traffic counters, memory, ...)."""


DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16}
"""The low-precision names the system table uses in runner options (a dtype cannot go through
the JSON of a run line or a rank's command line)."""


def dtype_option(runner: str, key: str, value: Optional[str]) -> Optional[torch.dtype]:
    """The dtype a runner option names ("bf16"), or None for None (fp32 throughout)."""
    if value is None:
        return None
    if value not in DTYPES:
        raise ValueError(f"{runner} runner: {key} must be None or one of {sorted(DTYPES)}, got {value!r}")
    return DTYPES[value]


class EagerTrainer:
    """A module wrapped by a PyTorch system (DDP, FSDP2) and a torch.optim AdamW: the plain
    training step those systems share. Subclasses set `self.model` and `self.optimizer`, and
    `self.autocast` to run the forward and the loss under `torch.autocast("cpu", dtype)`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Optional[torch.dtype] = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.autocast is None:
            loss = lm_loss(self.model(x), y)
        else:
            with torch.autocast("cpu", dtype=self.autocast):
                loss = lm_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def reset_counters(self) -> None:
        pass

    def report(self) -> dict[str, Any]:
        return {}


def build_model(spec: RunSpec, device: Optional[str] = None) -> nn.Module:
    """The benchmark's GPT under `torch.manual_seed(spec.seed)`; eager unless device="meta"."""
    from fxzero.zoo import gpt

    size, overrides = zoo_name(spec.model, spec.seq)
    torch.manual_seed(spec.seed)
    if device is None:
        return gpt(size, **overrides)
    with torch.device(device):
        return gpt(size, **overrides)


class CheckpointedBlock(nn.Module):
    """A transformer block whose forward goes through an activation-checkpoint function, as a
    user of a peer system writes it: `checkpoint(block, x)` keeps the block's input and
    recomputes the rest of its forward in the backward. The function is the peer's own
    (`torch.utils.checkpoint.checkpoint`, `deepspeed.checkpointing.checkpoint`)."""

    def __init__(self, block: nn.Module, checkpoint: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.block = block
        self.checkpoint = checkpoint
        self.block_forwards = 0
        """How often the block's forward ran: twice per step when its activations were
        recomputed, once when the checkpoint function did nothing (DeepSpeed#5704)."""
        block.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args: Any) -> None:
        self.block_forwards += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpoint(self.block, x)


def checkpoint_blocks(model: nn.Module, checkpoint: Callable[..., torch.Tensor]) -> nn.Module:
    """Wrap each of `model.blocks` in a `CheckpointedBlock` (in place; returns the model).

    Done after the model is built, so the weights are the seed's, as every system's are; only
    the parameters' names gain a ".block" (no system here compares names across systems).
    """
    for i, block in enumerate(model.blocks):
        model.blocks[i] = CheckpointedBlock(block, checkpoint)
    return model


def checkpoint_report(model: nn.Module) -> dict[str, int]:
    """How many blocks are checkpointed and how often their forwards ran in all (for the run
    line's `block_forwards_per_step`: 2.0 when every block was recomputed once per step)."""
    blocks = [b for b in model.modules() if isinstance(b, CheckpointedBlock)]
    return {"checkpointed_blocks": len(blocks), "checkpointed_block_forwards": sum(b.block_forwards for b in blocks)}


SCRATCH_ENV = "BENCH_RUN_SCRATCH"
"""Set by the launcher for the ranks: the run's own folder under `nvme_parent()`."""


def nvme_parent() -> str:
    """Where NVMe offload files go: $BENCH_NVME_DIR when set (point it at a real NVMe mount),
    else the system's temporary directory. DeepSpeed's and fxzero's NVMe systems both use it,
    so that they compare on the same disk."""
    return os.environ.get("BENCH_NVME_DIR") or tempfile.gettempdir()


def nvme_scratch(prefix: str) -> str:
    """A fresh folder for a system's NVMe offload files, inside the run's folder that the
    launcher removes after the run (else directly under `nvme_parent()`); the caller removes
    it when done."""
    return tempfile.mkdtemp(prefix=prefix, dir=os.environ.get(SCRATCH_ENV) or nvme_parent())


def make_optimizer(spec: RunSpec, params) -> torch.optim.Optimizer:
    """torch's AdamW with the benchmark's hyper-parameters (DDP and FSDP2 use it)."""
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay
    )


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next-token logits, in fp32 whatever dtype the logits come in.

    Every system computes its loss alike: a bf16 system's logits (FSDP2's, DeepSpeed's and
    fxzero's outputs are bf16) are upcast first, as CPU autocast runs cross_entropy in fp32 for
    DDP under autocast; for fp32 logits `.float()` is the tensor itself (no copy).
    """
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def make_batch(spec: RunSpec, vocab_size: int, seq_len: int, step: int, rank: int):
    """Rank `rank`'s micro-batch (x, y) for `step`: random tokens and their images."""
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(spec.data_seed))
    gen = torch.Generator().manual_seed(spec.data_seed + 1 + step * spec.world_size + rank)
    x = torch.randint(vocab_size, (spec.batch, seq_len), generator=gen)
    return x, perm[x]


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss where /proc is missing)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024


def rss_bytes() -> int:
    """This process's resident set now (VmRSS), or 0 where /proc is missing."""
    return (_status_kib("VmRSS") or 0) * 1024


def loopback_bytes() -> Optional[int]:
    """Bytes sent over the loopback interface so far, by every process in this network namespace.

    gloo's TCP transport carries every collective over loopback between ranks on one machine,
    so the difference across a step is what all ranks together put on the wire, whatever
    algorithm gloo chose; anything else using loopback at the same time adds to it.
    """
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])  # transmit bytes
    except (OSError, ValueError, IndexError):
        pass
    return None


class StepClock:
    """Wall time of one step; the ranks synchronize in their collectives, so no barrier."""

    def __enter__(self) -> "StepClock":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def cpu_busy_seconds() -> Optional[float]:
    """CPU seconds all processes on this machine have been busy so far (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's children that have been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def background_cores(seconds: float = 2.0) -> Optional[float]:
    """Cores kept busy by other processes over the next `seconds` (this process sleeps)."""
    start = cpu_busy_seconds()
    if start is None:
        return None
    time.sleep(seconds)
    end = cpu_busy_seconds()
    return None if end is None else (end - start) / seconds

"""The systems the benchmark can run, and whether each can run here.

A system is a runner module plus its options; adding a variant (a DeepSpeed offload target, an
fxzero Config knob) is one row of `SYSTEMS`. `unavailable(name, spec)` says, before any rank
starts, why a system cannot run in this Python environment (None when it can); the launcher
prints that reason as a JSON line instead of running it.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import importlib.util
import os
import tempfile
from typing import Any, Optional

from tools.bench.spec import RunSpec

__all__ = ["ACTIVATION_SYSTEMS", "BF16_SYSTEMS", "DEFAULT_SYSTEMS", "SYSTEM_GROUPS", "SYSTEMS", "System", "expand", "unavailable"]


@dataclasses.dataclass(frozen=True)
class System:
    runner: str
    """Module under tools/bench/ whose `setup(spec, counter, options)` returns a Trainer."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Passed to the runner's setup as is."""
    description: str = ""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment variables for the rank processes."""
    precision: str = "fp32"
    """"fp32", or "bf16" for a mixed-precision variant: it names the system whose losses this
    one's are compared with, and at which tolerance (`report.LOSS_REFERENCES`), and which
    systems an fxzero system's summary ratios are taken against."""
    trains_alike: bool = True
    """False where the ranks do not train one model together (the no-communication floor: no
    gradient is averaged, so the ranks' models part after the first update): only the first
    step's loss, before any update, is compared."""
    activations: str = "none"
    """What the system does with the activations the backward needs: "none" keeps them all;
    "checkpoint" is a peer's own activation checkpointing around each block; for fxzero, the
    `Activations(recompute=...)` mode ("unit", "selective"). See `tools/bench/activations.py`."""
    resident: Optional[str] = None
    """For a system that recomputes activations: the same system keeping them all, whose losses
    this one's are held to (fxzero's: bit for bit) and whose step, peak RSS and activation
    bytes its own are compared with."""


_DS_ENV = {"DS_ACCELERATOR": "cpu"}

SYSTEMS: dict[str, System] = {
    "ddp": System("ddp", {}, "PyTorch DistributedDataParallel, default buckets"),
    "fsdp2": System("fsdp2", {}, "PyTorch FSDP2, fully_shard per block + root"),
    # The no-communication floor (floor.py): every rank trains its own copy on its own
    # micro-batch, all ranks at once; no collective in a step.
    "floor": System(
        "floor", {}, "no-communication floor: each rank trains its own copy, fp32", trains_alike=False
    ),
    # bf16 variants. Losses are compared with ddp-bf16's (report.LOSS_TOLERANCE_BF16); the
    # summary takes fxzero-stage3-bf16's ratios against fsdp2-bf16, ds-zero3-bf16, floor-bf16.
    "ddp-bf16": System(
        "ddp", {"autocast": "bf16"}, "PyTorch DDP, forward + loss under torch.autocast(cpu, bf16)",
        precision="bf16",
    ),
    "fsdp2-bf16": System(
        "fsdp2", {"mixed_precision": "bf16"},
        "PyTorch FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on every fully_shard",
        precision="bf16",
    ),
    "ds-zero3-bf16": System(
        "deepspeed_zero3", {"offload": None, "bf16": True},
        'DeepSpeed ZeRO-3, "bf16": {"enabled": true}, torch AdamW', _DS_ENV, precision="bf16",
    ),
    "floor-bf16": System(
        "floor", {"autocast": "bf16"},
        "no-communication floor: each rank trains its own copy, forward + loss under autocast(cpu, bf16)",
        precision="bf16", trains_alike=False,
    ),
    "fxzero-stage3-bf16": System(
        "fxzero_engine", {"init": "state_dict", "config": {"mixed_precision": "bf16"}},
        "fxzero ZeRO-3, MixedPrecision(param_dtype=bf16), gradients reduced in fp32",
        precision="bf16",
    ),
    "ds-zero3": System(
        "deepspeed_zero3", {"offload": None}, "DeepSpeed ZeRO-3, torch AdamW", _DS_ENV
    ),
    # Activation checkpointing side by side (issue 23; the "activations" group): each peer as its
    # users turn it on, next to its resident run, and fxzero's recompute policies next to its own.
    "fsdp2-ckpt": System(
        "fsdp2", {"checkpoint": True},
        "PyTorch FSDP2, torch.utils.checkpoint (non-reentrant) around each block, fully_shard per block + root",
        activations="checkpoint", resident="fsdp2",
    ),
    "ds-zero3-ckpt": System(
        "deepspeed_zero3", {"offload": None, "activation_checkpointing": True},
        "DeepSpeed ZeRO-3, deepspeed.checkpointing.checkpoint around each block + the config's "
        "activation_checkpointing section, torch AdamW",
        _DS_ENV, activations="checkpoint", resident="ds-zero3",
    ),
    "ds-zero3-offload-cpu": System(
        "deepspeed_zero3",
        {"offload": "cpu"},
        "DeepSpeed ZeRO-3, optimizer + params offloaded to cpu, DeepSpeedCPUAdam",
        _DS_ENV,
    ),
    "ds-zero3-offload-nvme": System(
        "deepspeed_zero3",
        {"offload": "nvme"},
        "DeepSpeed ZeRO-Infinity, optimizer + params on nvme (opt-in: needs libaio + async_io)",
        _DS_ENV,
    ),
    # `config` is passed as fxzero.Config(stage=3, optimizer=..., seed=..., **config); a knob
    # this fxzero lacks makes the system unavailable. prefetch=None: each gather is issued right
    # before its first use.
    "fxzero-stage3": System(
        "fxzero_engine", {"init": "state_dict", "config": {}}, "fxzero ZeRO-3, default Config"
    ),
    # The same, with collectives on gloo over loopback TCP like the torch and DeepSpeed systems
    # (the default moves the data of collectives through shared memory: Config.transport).
    "fxzero-stage3-gloo": System(
        "fxzero_engine",
        {"init": "state_dict", "config": {"transport": "process_group"}},
        "fxzero ZeRO-3, collectives on the gloo process group (not shared memory)",
    ),
    "fxzero-stage3-noprefetch": System(
        "fxzero_engine",
        {"init": "state_dict", "config": {"prefetch": None}},
        "fxzero ZeRO-3 without prefetch",
    ),
    # Prefetch, but no unit kept from the forward for the backward: every unit is gathered
    # twice, exactly 3 x Phi elements per step (the default moves less).
    "fxzero-stage3-gather-twice": System(
        "fxzero_engine",
        {"init": "state_dict", "config": {"prefetch": {"keep_for_backward": False}}},
        "fxzero ZeRO-3, prefetch without keep_for_backward (3 x Phi per step)",
    ),
    "fxzero-stage3-unit": System(
        "fxzero_engine",
        {"init": "state_dict", "config": {"activations": {"recompute": "unit"}}},
        'fxzero ZeRO-3, Activations(recompute="unit"): each unit\'s inputs kept, the rest recomputed',
        activations="unit", resident="fxzero-stage3",
    ),
    "fxzero-stage3-unit-attention": System(
        "fxzero_engine",
        {"init": "state_dict", "config": {"activations": {"recompute": "unit", "keep_attention": True}}},
        'fxzero ZeRO-3, Activations(recompute="unit", keep_attention=True): each unit\'s inputs and its '
        "fused attention's outputs kept, the rest recomputed",
        activations="unit-attention", resident="fxzero-stage3",
    ),
    # Unavailable, with Activations' own message, in an fxzero without recompute="selective".
    "fxzero-stage3-selective": System(
        "fxzero_engine",
        {"init": "state_dict", "config": {"activations": {"recompute": "selective"}}},
        'fxzero ZeRO-3, Activations(recompute="selective"): matmul and attention outputs kept, '
        "cheap ops recomputed",
        activations="selective", resident="fxzero-stage3",
    ),
    "fxzero-stage3-meta": System(
        "fxzero_engine",
        {"init": "seed", "config": {}},
        "fxzero ZeRO-3 initialized from the seed on the meta device: no full copy on any rank",
    ),
    # The placements of the DeepSpeed offload systems above. Initialized from the seed (no full
    # copy on any rank), as a model too big for the device would be; the step is the same as
    # with a state_dict, so fxzero-stage3(-meta) is the device-resident reference.
    "fxzero-offload-cpu": System(
        "fxzero_engine",
        {"init": "seed", "offload": "cpu", "config": {}},
        "fxzero ZeRO-3, optimizer states + params offloaded to cpu",
    ),
    "fxzero-offload-nvme": System(
        "fxzero_engine",
        {"init": "seed", "offload": "nvme", "config": {}},
        "fxzero ZeRO-Infinity, optimizer states + params on nvme",
    ),
    # Each unit updated inside the backward once its gradient is reduced: no gradient written to
    # the tier, no third read of the parameters (Offload.step_in_backward).
    "fxzero-offload-cpu-step-in-backward": System(
        "fxzero_engine",
        {"init": "seed", "offload": "cpu", "offload_options": {"step_in_backward": True}, "config": {}},
        "fxzero ZeRO-3, optimizer states + params offloaded to cpu, step in the backward",
    ),
    "fxzero-offload-nvme-step-in-backward": System(
        "fxzero_engine",
        {"init": "seed", "offload": "nvme", "offload_options": {"step_in_backward": True}, "config": {}},
        "fxzero ZeRO-Infinity, optimizer states + params on nvme, step in the backward",
    ),
}
"""Every system by name."""

DEFAULT_SYSTEMS: tuple[str, ...] = (
    "ddp",
    "fsdp2",
    "ds-zero3",
    "ds-zero3-offload-cpu",
    "fxzero-stage3",
    "fxzero-stage3-gloo",
    "fxzero-stage3-gather-twice",
    "fxzero-stage3-noprefetch",
)
"""What one invocation runs without --systems; the NVMe and offload systems are opt-in (see
deepspeed_zero3.py and fxzero_engine.py), and so are the bf16 ones (`--systems bf16`)."""

BF16_SYSTEMS: tuple[str, ...] = (
    "ddp-bf16",
    "fsdp2-bf16",
    "ds-zero3-bf16",
    "floor-bf16",
    "fxzero-stage3-bf16",
)
"""The bf16 side by side: fxzero-stage3-bf16 and what its summary ratios are taken against."""

ACTIVATION_SYSTEMS: tuple[str, ...] = (
    "ddp",
    "fsdp2",
    "fsdp2-ckpt",
    "ds-zero3",
    "ds-zero3-ckpt",
    "fxzero-stage3",
    "fxzero-stage3-unit",
    "fxzero-stage3-unit-attention",
    "fxzero-stage3-selective",
)
"""The activation side by side (`--systems activations`, issue 23): fxzero's policies and each
peer with and without its checkpointing; DDP as every fp32 system's loss reference."""

SYSTEM_GROUPS: dict[str, tuple[str, ...]] = {
    "default": DEFAULT_SYSTEMS, "bf16": BF16_SYSTEMS, "activations": ACTIVATION_SYSTEMS,
}
"""Names --systems accepts for several systems at once."""


def expand(names: list[str]) -> list[str]:
    """--systems' names with each group (`SYSTEM_GROUPS`) replaced by its systems, in order,
    each system once."""
    out: list[str] = []
    for name in names:
        for system in SYSTEM_GROUPS.get(name, (name,)):
            if system not in out:
                out.append(system)
    return out


def unavailable(name: str, spec: RunSpec) -> Optional[str]:
    """Why system `name` cannot run in this environment, or None if it can."""
    system = SYSTEMS[name]
    if system.runner == "deepspeed_zero3":
        if importlib.util.find_spec("deepspeed") is None:
            return (
                "deepspeed is not installed in this Python environment; run "
                "`bash scripts/bench-env.sh` and use .venv-bench/bin/python tools/bench.py"
            )
        if system.options.get("offload") == "nvme" and not _have_libaio():
            return (
                "NVMe offload needs libaio (apt-get install libaio-dev) and DeepSpeed's async_io "
                "op; run `BENCH_NVME=1 bash scripts/bench-env.sh`"
            )
    if system.runner == "fxzero_engine":
        from tools.bench.fxzero_engine import make_config

        offload = system.options.get("offload")
        offload_options = system.options.get("offload_options")
        try:  # the rank's own NVMe folder does not exist yet: any existing directory will do
            make_config(
                spec, system.options.get("config", {}), offload, tempfile.gettempdir(), offload_options
            )
        except (TypeError, ValueError) as exc:
            what = system.options.get("config", {})
            if offload is not None:
                what = f"{what} with offload {offload!r} {offload_options or ''}".rstrip()
            return f"this fxzero's Config rejects {what}: {exc}"
    return None


def _have_libaio() -> bool:
    return ctypes.util.find_library("aio") is not None and os.path.exists("/usr/include/libaio.h")

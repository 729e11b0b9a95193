"""Settings that have no effect in the configuration they appear in: each is warned about once.

A setting a user chose that changes nothing is a silent surprise: it is named in a
`warnings.warn` with the reason and the way out, once per process (`warn_ineffective`, in
`fxzero/config/notices.py`).
"""

from __future__ import annotations

import platform
from typing import Optional

import torch

from fxzero.config.config import Config
from fxzero.config.notices import IneffectiveSetting, SlowSetting, warn_ineffective, warn_once
from fxzero.config.placement import Nvme, Offload

_WRITE_BEHIND = Nvme.__dataclass_fields__["write_behind_bytes"].default

__all__ = ["IneffectiveSetting", "SlowSetting", "ineffective_settings", "slow_settings", "warn_ineffective",
           "warn_once"]

def slow_settings(config: Config, *, cuda: bool, cpu_capability: Optional[str] = None) -> list[str]:
    """One message per setting of `config` that is far slower here than it needs to be.

    Args:
        cuda: whether the ranks compute on CUDA devices.
        cpu_capability: the widest vector instructions torch's CPU kernels use on this x86 machine
            (`torch.backends.cpu.get_cpu_capability()`: "AVX512", "AVX2", "DEFAULT"; read when
            None). Where it is not AVX-512, bfloat16 matmuls have no fast kernel.
    """
    if cuda:
        return []
    mp, autocast = config.mixed_precision, config.autocast
    if mp is not None and mp.param_dtype is torch.float16:
        return ["MixedPrecision(param_dtype=torch.float16) on a CPU-only machine: float16 matmuls run hundreds "
                "of times slower than bfloat16 on CPUs without native float16 arithmetic (0.4 GFLOP/s per core on "
                "this project's machines, against 80-200 for bfloat16 on a CPU with AVX-512); use "
                "param_dtype=torch.bfloat16, which needs no loss scaling"]
    bf16 = ("MixedPrecision(param_dtype=torch.bfloat16)" if mp is not None and mp.param_dtype is torch.bfloat16 else
            "Autocast(dtype=torch.bfloat16)" if autocast is not None and autocast.dtype is torch.bfloat16 else None)
    if bf16 is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    capability = torch.backends.cpu.get_cpu_capability() if cpu_capability is None else cpu_capability
    if capability.upper().startswith("AVX512"):
        return []
    return [f"{bf16} on a CPU without AVX-512 (torch's CPU capability here: {capability}): bfloat16 matmuls have "
            "no fast kernel on it and run tens of times slower than float32 (1.3 GFLOP/s per core against 88 for "
            "float32 at 512x512, one thread, on an AMD EPYC with AVX2; a CPU with avx512_bf16 runs bfloat16 "
            "about 2.5x faster than float32); train in float32 here (mixed_precision=None, no autocast), or on "
            "a CPU with AVX-512"]


def ineffective_settings(config: Config, *, world_size: int, cuda: bool, initialized_from_seed: bool) -> list[str]:
    """One message per setting of `config` that changes nothing here.

    Args:
        world_size: ranks the model trains on.
        cuda: whether the ranks compute on CUDA devices.
        initialized_from_seed: whether the parameters come from the model's own init code
            (a model on the meta device and no state_dict), which is all `Config.seed` seeds.
    """
    out = []
    tiers = config.offload.tiers()
    prefetch = config.prefetch
    if config.stage in (1, 2) and config.persist_threshold:
        out.append(f"Config.persist_threshold={config.persist_threshold} has no effect at stage {config.stage}: "
                   "every unit is held whole already; it applies at stage=3")
    if prefetch is not None and prefetch.keep_for_backward:
        if config.stage in (1, 2):
            out.append(f"Prefetch(keep_for_backward=True) has no effect at stage {config.stage}: parameters are "
                       "held whole, never gathered; it applies at stage=3")
        elif "param" in tiers:
            out.append("Prefetch(keep_for_backward=True) has no effect with offloaded parameters: the backward "
                       "gathers again from the shards it updates (the fetched shards are kept instead); leave "
                       "keep_for_backward unset")
    if config.gather_for_generate and config.stage in (1, 2):
        out.append(f"Config.gather_for_generate=True has no effect at stage {config.stage}: every rank holds the "
                   "whole model, and generate runs on it as it is; it applies at stage=3")
    if config.keep_host_memory and cuda:
        out.append("Config.keep_host_memory=True has no effect with CUDA: it keeps freed host memory for the "
                   "executor's host buffers, which live in device memory here (CUDA caches its own)")
    if not tiers and config.offload.lookahead != Offload().lookahead:
        out.append(f"Offload.lookahead={config.offload.lookahead} has no effect: no state is offloaded "
                   "(set Offload(params=..., optimizer=...))")
    offload = config.activations.offload
    if offload is not None and offload.tier == "cpu" and not cuda:
        out.append("Activations(offload=Cpu()) has no effect on a CPU rank: saved activations are in host memory "
                   "already, so they stay resident; Nvme(path=...) moves them out of memory")
    if offload is not None and offload.tier == "nvme" and offload.write_behind_bytes != _WRITE_BEHIND:
        out.append(f"Activations(offload=Nvme(write_behind_bytes={offload.write_behind_bytes})) has no effect: saved "
                   "activations are written to disk without a copy in memory (the copy is what offloading avoids)")
    if world_size == 1 and config.transport != "auto":
        out.append(f"Config.transport={config.transport!r} has no effect in a world of one: there are no "
                   "collectives to carry")
    if config.seed != Config().seed and not initialized_from_seed:
        out.append(f"Config.seed={config.seed} has no effect: it seeds the model's own init code for a "
                   "model built on the meta device without a state_dict, and this model's values are given")
    return out

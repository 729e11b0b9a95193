"""DeepSpeed ZeRO-3 on the CPU accelerator (DS_ACCELERATOR=cpu, gloo), from PyPI.

Built the way a DeepSpeed user would: the eager model (every rank builds it whole, as without
`zero.Init`), then `deepspeed.initialize` partitions it. fp32 throughout; AdamW with the
benchmark's hyper-parameters. Options, from the system table:

- offload None: torch's AdamW (`"torch_adam": true`; FusedAdam is CUDA only).
- offload "cpu": optimizer states and parameters offloaded to CPU memory; the optimizer is
  DeepSpeedCPUAdam (JIT-built op cpu_adam; `scripts/bench-env.sh` warms it).
- offload "nvme": ZeRO-Infinity, both on disk under a temporary folder (needs libaio and the
  async_io op: `BENCH_NVME=1 bash scripts/bench-env.sh`). Two settings ANCHORS.md found
  necessary on this CPU: `stage3_max_reuse_distance: 0`, and a parameter swap buffer sized to
  the largest parameter partition (the default 1e8 elements costs GBs per rank).

Collectives go through deepspeed.comm -> torch.distributed, where they are counted.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from typing import Any, Optional

import torch
import torch.distributed as dist

from tools.bench.commcount import CommCounter
from tools.bench.common import build_model, lm_loss
from tools.bench.spec import RunSpec


def ds_config(spec: RunSpec, offload: Optional[str], largest_param: int, nvme_path: Optional[str]) -> dict:
    """The DeepSpeed config for one run."""
    params: dict[str, Any] = {
        "lr": spec.lr,
        "betas": list(spec.betas),
        "eps": spec.eps,
        "weight_decay": spec.weight_decay,
    }
    if offload is None:
        params["torch_adam"] = True
    zero: dict[str, Any] = {"stage": 3}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    elif offload == "nvme":
        assert nvme_path is not None
        # One swap buffer must hold the largest parameter partition; rounded up generously.
        partition = math.ceil(largest_param / spec.world_size)
        buffer_size = int(2 ** math.ceil(math.log2(max(partition, 1))))
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False}
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "pin_memory": False,
            "buffer_size": buffer_size,
        }
        zero["stage3_max_reuse_distance"] = 0
    elif offload is not None:
        raise ValueError(f"deepspeed runner: offload must be None, 'cpu' or 'nvme', got {offload!r}")
    return {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer:
    def __init__(self, spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> None:
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        offload = options.get("offload")
        self.nvme_path: Optional[str] = None
        if offload == "nvme":
            self.nvme_path = tempfile.mkdtemp(prefix=f"bench-nvme-rank{dist.get_rank()}-")
            _force_fp32_zero_init()
        deepspeed.init_distributed(dist_backend="gloo")
        model = build_model(spec)
        largest = max(p.numel() for p in model.parameters())
        self.config = ds_config(spec, offload, largest, self.nvme_path)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.config
        )
        self.offload = offload

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def reset_counters(self) -> None:
        pass

    def report(self) -> dict[str, Any]:
        import deepspeed

        zero = self.config["zero_optimization"]
        return {
            "deepspeed": deepspeed.__version__,
            "offload": self.offload,
            "optimizer": type(self.engine.optimizer.optimizer).__name__
            if hasattr(self.engine.optimizer, "optimizer")
            else type(self.engine.optimizer).__name__,
            "zero_optimization": zero,
        }

    def close(self) -> None:
        if self.nvme_path:
            shutil.rmtree(self.nvme_path, ignore_errors=True)


def _force_fp32_zero_init() -> None:
    """ZeRO-Infinity's zero.Init picks bf16 swap buffers on a CPU without fp16 (ANCHORS.md):
    make it keep fp32 when no dtype is given, as this benchmark trains in fp32."""
    from deepspeed.runtime.zero import partition_parameters as pp

    original = pp.Init._set_dtype

    def _set_dtype(self, ds_config, dtype):
        original(self, ds_config, dtype)
        # Without a config, 0.19.8 reads `dtype or fp16 if fp16_supported else bf16 ...`, which
        # yields bf16 on such a CPU even when a dtype is passed.
        self.dtype = dtype if dtype is not None else torch.float32

    pp.Init._set_dtype = _set_dtype


def setup(spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> DeepSpeedTrainer:
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        raise RuntimeError("the DeepSpeed runner needs DS_ACCELERATOR=cpu (the launcher sets it)")
    return DeepSpeedTrainer(spec, counter, options)

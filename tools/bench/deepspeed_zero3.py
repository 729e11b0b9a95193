"""DeepSpeed ZeRO-3 on the CPU accelerator (DS_ACCELERATOR=cpu, gloo), from PyPI.

Built the way a DeepSpeed user would: the eager model (every rank builds it whole, as without
`zero.Init`), then `deepspeed.initialize` partitions it. fp32 throughout unless bf16 (below);
AdamW with the benchmark's hyper-parameters. Options, from the system table:

- offload None: torch's AdamW (`"torch_adam": true`; FusedAdam is CUDA only).
- offload "cpu": optimizer states and parameters offloaded to CPU memory; the optimizer is
  DeepSpeedCPUAdam (JIT-built op cpu_adam; `scripts/bench-env.sh` warms it).
- offload "nvme": ZeRO-Infinity, both on disk under a fresh folder from `common.nvme_scratch`
  ($BENCH_NVME_DIR, else the temporary directory; fxzero's NVMe system uses the same parent),
  removed afterwards. Needs libaio and the async_io op: `BENCH_NVME=1 bash scripts/bench-env.sh`.
  Settings this CPU needs (ANCHORS.md): fp32 swap buffers (0.19.8 picks bf16 on a CPU without
  fp16: `_force_fp32_zero_init`), `stage3_max_reuse_distance: 0` (else "Not enough buffers 0
  for swapping 1"), and a parameter swap buffer sized to the largest parameter partition (the
  default 1e8 elements costs GBs per rank). `max_in_cpu: 0`, so that the parameters stay on
  NVMe (DeepSpeed's default keeps up to 1e9 parameter elements per rank in CPU memory, which
  would make this the cpu placement for every model here). And two for memory at ~1B parameters,
  measured there (rank RSS otherwise passes 10 GB, two ranks do not fit in 24 GiB):
  `sub_group_size` 5e7 (the optimizer swapper holds 4 locked buffers of the largest sub-group,
  and a parameter reuse buffer twice its size; the default 1e9 makes a sub-group of this rank's
  whole partition: over 10 GB at 1B parameters) and `reduce_bucket_size` 5e7 (gradients wait
  in a bucket of that many elements before each reduce-scatter; the default 5e8 holds 2 GB).
  Both are above the 25M model's sizes, so there they change nothing.

- bf16 True (the "ds-zero3-bf16" system): `"bf16": {"enabled": true}` and nothing else bf16
  specific, as a DeepSpeed user turns it on: the engine casts the module to bf16 (forward,
  backward and the all-gathers in bf16), the optimizer keeps fp32 master partitions, and
  DeepSpeed's defaults decide the rest (gradients are reduce-scattered in the model's dtype,
  bf16, unless "communication_data_type" says otherwise: half FSDP2's and fxzero's fp32
  reduce bytes). The CPU's quirk with bf16 (ANCHORS.md: zero.Init picks bf16 by itself when no
  dtype is given) only bites zero.Init without a config, i.e. the NVMe path, where
  `_force_fp32_zero_init` keeps fp32; with bf16 on that patch is not applied, so zero.Init
  follows the config's bf16.

- activation_checkpointing True (the "ds-zero3-ckpt" system): as a DeepSpeed user must do it,
  both halves (DeepSpeed#5704: the config section alone does nothing): the model calls
  `deepspeed.checkpointing.checkpoint(block, x)` around each block (`common.checkpoint_blocks`;
  DeepSpeed's reentrant CheckpointFunction, what Megatron-DeepSpeed calls), and the config's
  `"activation_checkpointing"` section, read by `deepspeed.checkpointing.configure(None,
  deepspeed_config=config)` as Megatron's scripts do, asks for plain recompute: no partitioning
  (no model parallelism here), no cpu checkpointing, no contiguous buffer.

Collectives go through deepspeed.comm -> torch.distributed, where they are counted.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from tools.bench.commcount import CommCounter
from tools.bench.common import build_model, checkpoint_blocks, checkpoint_report, lm_loss, nvme_scratch
from tools.bench.spec import RunSpec

# Elements per optimizer sub-group and per gradient bucket with NVMe offload (see the module
# docstring): what bounds DeepSpeed's memory at ~1B parameters.
NVME_SUB_GROUP_SIZE = 50_000_000
NVME_REDUCE_BUCKET_SIZE = 50_000_000


def ds_config(
    spec: RunSpec, offload: Optional[str], largest_param: int, nvme_path: Optional[str], bf16: bool = False,
    checkpoints: Optional[int] = None,
) -> dict:
    """The DeepSpeed config for one run (bf16: `"bf16": {"enabled": true}`; `checkpoints`: the
    number of checkpointed blocks, for an `"activation_checkpointing"` section)."""
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
            # Otherwise up to 1e9 elements of parameter partitions (all of them, below ~2e9
            # parameters on 2 ranks) are swapped in once and kept in CPU memory for good.
            "max_in_cpu": 0,
        }
        zero["stage3_max_reuse_distance"] = 0
        zero["sub_group_size"] = NVME_SUB_GROUP_SIZE
        zero["reduce_bucket_size"] = NVME_REDUCE_BUCKET_SIZE
    elif offload is not None:
        raise ValueError(f"deepspeed runner: offload must be None, 'cpu' or 'nvme', got {offload!r}")
    config = {
        "train_micro_batch_size_per_gpu": spec.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": bool(bf16)},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if checkpoints is not None:
        config["activation_checkpointing"] = {
            "partition_activations": False,  # splits checkpoints over model-parallel ranks: none here
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": checkpoints,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return config


class DeepSpeedTrainer:
    def __init__(self, spec: RunSpec, counter: CommCounter, options: dict[str, Any]) -> None:
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        offload = options.get("offload")
        bf16 = options.get("bf16", False)
        checkpointing = options.get("activation_checkpointing", False)
        for key, value in (("bf16", bf16), ("activation_checkpointing", checkpointing)):
            if not isinstance(value, bool):
                raise ValueError(f"deepspeed runner: {key} must be True or False, got {value!r}")
        self.nvme_path: Optional[str] = None
        if offload == "nvme":
            self.nvme_path = nvme_scratch(f"bench-ds-nvme-rank{dist.get_rank()}-")
            if not bf16:  # with bf16 on, zero.Init's bf16 is what the config asks for
                _force_fp32_zero_init()
        deepspeed.init_distributed(dist_backend="gloo")
        model = build_model(spec)
        largest = max(p.numel() for p in model.parameters())
        checkpoints = len(model.blocks) if checkpointing else None
        self.config = ds_config(spec, offload, largest, self.nvme_path, bf16=bf16, checkpoints=checkpoints)
        if checkpointing:
            deepspeed.checkpointing.configure(None, deepspeed_config=self.config)
            checkpoint_blocks(model, deepspeed.checkpointing.checkpoint)
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
            "bf16": self.config["bf16"]["enabled"],
            **({"activation_checkpointing": self.config["activation_checkpointing"],
                **checkpoint_report(self.engine.module)} if "activation_checkpointing" in self.config else {}),
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

"""Where the average's division by the world size happens (`Config.gradient_division`), 2 ranks.

DeepSpeed's ZeRO-1/2/3 divide each rank's gradient by the world size before the reduce-scatter
sums it (stage_1_and_2's `average_tensor`, ZeRO-3's `reduce_scatter_coalesced`); its stage 0
divides the sum. In fp32 and bf16 the
two are the same average for a power-of-two world; in float16 a sum can overflow where the
divided halves do not. Here each rank's gradient is 40000 (float16's largest is 65504): divided
first, the average 40000 trains; summed first, 80000 overflows and the step is skipped. A
DeepSpeed config at stage 2 or 3 divides first, as DeepSpeed does (fxzero divided after, and skipped
steps DeepSpeed took: tools/deepspeed_config_parity.py, DeepSpeedExamples' imagenet fp16 ZeRO-1
config, losses 1.6e-2 apart, now 5e-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxzero
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

LR = 1e-6


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum().float()


def _train(rank: int, world_size: int, how: str) -> dict:
    model = Scale()
    if how.startswith("deepspeed"):
        config = fxzero.Config.from_deepspeed({
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": int(how[-1])},
            "fp16": {"enabled": True, "loss_scale": 1.0}, "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    else:
        config = fxzero.Config(stage=2, optimizer=fxzero.SGD(lr=LR), gradient_division=how, mixed_precision=fxzero.MixedPrecision(
            param_dtype=torch.float16, reduce_dtype=torch.float16, loss_scale=fxzero.LossScale(static=1.0)))
    engine, _, _, _ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.full((1,), 40000.0, dtype=torch.float16)))  # d/dw = 40000 on each rank
    engine.step()
    return {"division": engine.config.gradient_division, "skipped": engine.skipped_steps,
            "w": engine.full_state_dict()["w"]}


@pytest.mark.parametrize("how", ["before", "after", "deepspeed-stage2", "deepspeed-stage3"])
def test_a_float16_sum_overflows_only_when_divided_after(how):
    for r in run_ranks(_train, 2, how, timeout_s=240):
        if how == "after":
            assert r["skipped"] == 1 and torch.equal(r["w"], torch.ones(1))
        else:
            assert r["division"] == "before" and r["skipped"] == 0
            assert torch.equal(r["w"], torch.tensor([1.0 - LR * 40000.0]))  # (0.96: exact in fp32)

"""Eager references for bfloat16 masters (`MixedPrecision(master_dtype=torch.bfloat16)`), written
independently of the engine.

The model is an eager model whose parameters, cast to bfloat16, are the masters (its buffers
keep their dtype, as fxzero's mixed precision and FSDP2's leave them: a Llama's rotary
frequencies stay float32): each rank's micro-batch is
run through it, each parameter's bfloat16 gradient is summed over the ranks and divided by their
number in bfloat16 (gradients reduced in the compute dtype, `reduce_dtype=None`), micro-steps of
an accumulation add those averages in bfloat16, and then:

- with bfloat16 optimizer states, `torch.optim.AdamW` steps the bfloat16 parameters themselves
  (torch creates their states in the parameter's dtype: this is what "bf16 optimizer states"
  means, and the test checks the states' dtype);
- with fp32 optimizer states, an fp32 copy of each parameter is made from the bfloat16 value
  before every step, `torch.optim.AdamW` (fp32 states, kept across steps) steps the copy with
  the gradient widened to fp32, and the result is rounded back into the bfloat16 parameter
  (DeepSpeedCPUAdam with fp32_optimizer_states on bf16 parameters).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from tests.dist.harness import ADAMW
from tests.dist.reference import lm_loss, rank_slice

Batch = tuple[torch.Tensor, torch.Tensor]


def eager_bf16_masters(model_fn: Callable[[], nn.Module], state: dict[str, torch.Tensor], batches: list[Batch],
                       world: int, optimizer_dtype: torch.dtype, accumulation: int = 1, threads: Optional[int] = None
                       ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Train as the module doc says, one optimizer step per `accumulation` batches.

    `threads`: torch's thread count while it runs (then restored): the ranks' (the harness runs
    each with one), since a CPU kernel's reductions (LayerNorm's backward sums its rows in
    per-thread partials) round differently with another count.

    Returns:
        Per micro-step the mean over ranks of the local losses (as floats), the final state
        dict (bfloat16), and per parameter name its optimizer state (exp_avg, exp_avg_sq).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _train(model_fn, state, batches, world, optimizer_dtype, accumulation)
    finally:
        torch.set_num_threads(before)


def _train(model_fn, state, batches, world, optimizer_dtype, accumulation):
    model = model_fn()
    model.load_state_dict(state)
    model.train()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    params = dict(model.named_parameters())  # (tied parameters once, under their first name)
    if optimizer_dtype == torch.bfloat16:
        stepped = params
    else:
        stepped = {n: p.detach().float().clone().requires_grad_(True) for n, p in params.items()}
    opt = torch.optim.AdamW(stepped.values(), **ADAMW)
    losses: list[float] = []
    total: dict[str, torch.Tensor] = {}
    for i, (x, y) in enumerate(batches):
        mean: dict[str, torch.Tensor] = {}
        step_losses = []
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            loss = lm_loss(model(rank_slice(x, rank, world)), rank_slice(y, rank, world))
            (loss / accumulation if accumulation > 1 else loss).backward()
            step_losses.append(float(loss.detach()))
            for n, p in params.items():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                mean[n] = g.clone() if n not in mean else mean[n] + g
        losses.append(sum(step_losses) / world)
        for n in params:
            mean[n] = mean[n] / world
            total[n] = mean[n] if i % accumulation == 0 else total[n] + mean[n]
        if (i + 1) % accumulation:
            continue
        with torch.no_grad():
            for n, p in params.items():
                if stepped is params:
                    p.grad = total[n]
                else:
                    stepped[n].copy_(p)
                    stepped[n].grad = total[n].float()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if stepped is not params:
                for n, p in params.items():
                    p.copy_(stepped[n])
    states = {n: {k: v.clone() for k, v in opt.state[stepped[n]].items() if k != "step"} for n in params}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, states

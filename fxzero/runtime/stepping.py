"""What happens between the backwards and the update: loss scaling, gradient accumulation,
agreement on finite gradients, clipping by the global norm, and the LR schedule.

`StepControl` is the engine's: `engine.backward(loss)` asks it how to scale the loss (float16's
scale, and 1 / gradient_accumulation_steps), `engine.step()` asks it whether this call is an
accumulation boundary, whether every rank may update ([Note: one flag per step] in
`loss_scale.py`), and by what factor each gradient is multiplied before the update (the
unscaling and the clip coefficient, one multiplier). After the update it steps the optimizer
as torch's schedulers count ([Note: who steps] in `optimizer.py`) and the LR schedule.

[Note: clipping from shards]
The global norm is the square root of the sum over ranks of each rank's sum of squares over its
gradient shards (shards do not overlap, and padding and the gradients of parameters no output
depends on are zero): one scalar all-reduce, after every gradient has arrived. As
`torch.nn.utils.clip_grad_norm_`: coefficient max_norm / (norm + 1e-6), applied when below 1.
An update that needs norms of each whole parameter (LAMB) sums them from shards the same way,
one number per parameter, through `sum_over_ranks` ([Note: sums over whole parameters] in
`fxzero/runtime/optim.py`).
"""

from __future__ import annotations

import math
import resource
import time
import warnings
from typing import Any, Optional

import torch

from fxzero.config import Config
from fxzero.config.batch import BatchSizes
from fxzero.runtime.comm import Comm
from fxzero.runtime.executor import CollectiveTimeout, GradientFlags, is_timeout
from fxzero.runtime.loss_scale import LossScaler, first_nonfinite
from fxzero.runtime.state import RankState

__all__ = ["StepControl", "StepLog"]


class StepControl:
    def __init__(self, config: Config, comm: Comm, state: RankState, batch: BatchSizes) -> None:
        mp = config.mixed_precision
        self.comm, self.state = comm, state
        self.batch = batch
        self.accumulation = batch.gradient_accumulation_steps
        self.clip = config.gradient_clipping
        self.on_nonfinite = config.nonfinite
        self.scaler = LossScaler(mp.loss_scale) if mp is not None and mp.loss_scale is not None else None
        self.flags = GradientFlags()
        """float16: what the backward's gradient checks found since the last boundary."""
        self.lr_scheduler: Any = None
        self.micro_steps = 0
        """Calls of engine.step() so far."""
        self.global_steps = 0
        """Optimizer steps so far (accumulation boundaries), skipped ones included."""
        self.skipped_steps = 0
        self.grad_norm: Optional[float] = None
        self.multiplier = 1.0
        """What each gradient is multiplied by in the update being taken (unscale x clip)."""
        self._loss_flags: list[tuple[Any, torch.Tensor]] = []
        self._first_bad: Optional[str] = None

    # -- backward -----------------------------------------------------------------------------

    def loss_to_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to run the backward from: the loss, over the accumulation steps, scaled."""
        if self.scaler is None:
            # [Note: one flag per step]: reduced ahead of the backward's collectives.
            flag = torch.tensor([0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0])
            self._loss_flags.append((self.comm.all_reduce(flag, count=False), flag))
            return loss / self.accumulation if self.accumulation > 1 else loss
        return loss.float() * (self.scaler.scale / self.accumulation)

    @property
    def boundary(self) -> bool:
        """Whether the next engine.step() updates (the last micro-step of an accumulation)."""
        return (self.micro_steps + 1) % self.accumulation == 0

    # -- the update ---------------------------------------------------------------------------

    def nonfinite_error(self, what: str, layouts) -> RuntimeError:
        self.state.settle_grads()
        unit = first_nonfinite((lay.name, self.state.grads.get(lay.name)) for lay in layouts)
        if unit is None and self.scaler is not None:  # gradients on a tier: as the backward saw them
            unit = self._first_bad
        where = (f"the first unit whose gradient is not finite on this rank is {unit!r}" if unit is not None
                 else "this rank's gradients are finite (another rank's are not)")
        return RuntimeError(f"[rank {self.comm.rank}] step {self.global_steps + 1}: {what}; {where}. Lower the "
                            "learning rate, check the inputs of this step, or (float16) use bfloat16")

    def agree(self, layouts) -> bool:
        """Whether every rank may update now ([Note: one flag per step]); False: skip this step.
        Sets `multiplier` (unscaling and clipping) for the update."""
        self.multiplier = 1.0
        if self.scaler is None:
            pending, self._loss_flags = self._loss_flags, []
            if any(self._wait(p, "the loss-finiteness flag").item() > 0 for p, _ in pending):
                return self._nonfinite("the loss is not finite on some rank", layouts)
        else:
            # The backward checked each gradient shard as it was reduced (passes/check_gradients.py).
            bad, self._first_bad = self.flags.nonfinite, self.flags.first
            flag = self.comm.all_reduce(torch.tensor([1.0 if bad else 0.0]), count=False)
            overflow = self._wait(flag, "the float16 overflow flag").item() > 0
            scale = self.scaler.scale
            self.scaler.update(overflow)
            if overflow:
                if self.scaler.is_stuck:
                    raise self.nonfinite_error(
                        f"the float16 loss scale is stuck at its minimum {self.scaler.policy.min_scale:g}: "
                        f"{self.scaler.policy.window} steps in a row overflowed", layouts)
                return False
            self.multiplier = 1.0 / scale
        self.grad_norm = self._global_norm()
        if self.grad_norm is not None and not math.isfinite(self.grad_norm):
            # The norm's all-reduce is the flag reduced with the gradients: every rank sees it.
            return self._nonfinite("a gradient is not finite on some rank (its loss is)", layouts)
        if self.clip is not None:
            assert self.grad_norm is not None, "Config refuses gradient_clipping with step_in_backward"
            coefficient = self.clip / (self.grad_norm + 1e-6)
            self.multiplier *= min(coefficient, 1.0)
        return True

    def _nonfinite(self, what: str, layouts) -> bool:
        """A step that must not update: an error on every rank, or (Config(nonfinite="skip")) a
        warning and False (skip)."""
        error = self.nonfinite_error(what, layouts)
        if self.on_nonfinite == "error":
            raise error
        warnings.warn(f"{error.args[0].split('; ')[0]}; the step is skipped on every rank (Config(nonfinite=\"skip\"))",
                      stacklevel=5)
        return False

    def _global_norm(self) -> Optional[float]:
        """The norm of the whole (unscaled) gradient, [Note: clipping from shards]: shards in
        memory are read here, shards on a tier were measured as the backward wrote them. None
        when the backward updated some unit itself (Offload(step_in_backward=True)): its
        gradient is gone, on every rank alike."""
        self.state.settle_grads()
        local = 0.0
        for unit, grad in self.state.grads.items():
            if isinstance(grad, torch.Tensor) and grad.numel() > 0:
                local += float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
            elif unit in self.flags.sum_of_squares:
                local += self.flags.sum_of_squares[unit]
            else:
                return None
        total = self._wait(self.comm.all_reduce(torch.tensor([local], dtype=torch.float64), count=False),
                           "the gradient norm's sum of squares").item()
        return math.sqrt(total) * self.multiplier

    def sum_over_ranks(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """`t` summed over the ranks in place, for an update that needs sums over whole parameters
        ([Note: sums over whole parameters] in `fxzero/runtime/optim.py`); counted in
        `comm_report()` as an all_reduce. A timeout is an error naming `what`."""
        return self._wait(self.comm.all_reduce(t), what, during="update")

    def _wait(self, pending, what: str, during: str = "agreement") -> torch.Tensor:
        """A step collective's result; a timeout is an error naming it."""
        try:
            return pending.wait()
        except Exception as e:
            if is_timeout(e):
                raise CollectiveTimeout(
                    f"[rank {self.comm.rank}] a collective timed out in step {self.global_steps + 1}'s {during} "
                    f"({what}, one all-reduce over the ranks): the other ranks did not join it within "
                    f"Config.collective_timeout (a rank died, or went another way). {e}") from e
            raise

    def stepped(self, optimizer, skipped: bool) -> None:
        """After a boundary: count it, step the optimizer for the schedulers and the schedule. A
        skipped step (a float16 overflow anywhere) steps neither, as DeepSpeed's engine steps its
        scheduler only after an update: the next step runs at the lr this one would have."""
        self.flags.reset()
        self.global_steps += 1
        if skipped:
            self.skipped_steps += 1
            return
        optimizer.mark_stepped()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()


class StepLog:
    """Every `every` optimizer steps, each rank prints DeepSpeed's kind of log line: the step,
    skipped steps, the last micro-step's loss, each group's lr, the loss scale, the mean step time
    since the last line and the peak memory (resident set; CUDA: allocated)."""

    def __init__(self, every: Optional[int], rank: int) -> None:
        self.every, self.rank = every, rank
        self._loss: Optional[torch.Tensor] = None
        self._since = time.perf_counter()

    def loss(self, loss: torch.Tensor) -> None:
        if self.every:
            self._loss = loss.detach()

    def stepped(self, engine) -> None:
        if not self.every or engine.global_steps % self.every:
            return
        now = time.perf_counter()
        step_time, self._since = (now - self._since) / self.every, now
        if torch.cuda.is_available():
            memory = f"cuda_peak={torch.cuda.max_memory_allocated() / 2**20:.0f}MB"
        else:
            memory = f"peak_rss={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}MB"
        loss = f"{float(self._loss):.4f}" if self._loss is not None else "-"
        scale = f" loss_scale={engine.loss_scale:g}" if engine.loss_scale is not None else ""
        lrs = ",".join(f"{lr:.3e}" for lr in engine.get_lr())
        print(f"[rank {self.rank}] step={engine.global_steps} skipped={engine.skipped_steps} loss={loss} lr=[{lrs}]"
              f"{scale} step_time={step_time:.3f}s {memory}", flush=True)

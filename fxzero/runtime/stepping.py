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

[Note: no host sync in a step]
On a GPU every read of a device value from Python (`float(t)`, `bool(t)`, `.item()`) waits for
the device to finish all it was given, so a read per unit in the backward would serialize
compute and communication. The flags and sums the step needs therefore stay device tensors
from where they are made: the loss's finiteness flag (`loss_to_backward`), the float16 checks
of each gradient shard and the sums of squares of the shards written to a tier (`GradientFlags`
in `executor.py`), each rank's sum of squares for the norm (`_sum_of_squares`); each is reduced
over ranks on the device. The step reads them once, together (`read_step_numbers`), where it
decides whether to update and by what multiplier: one read per optimizer step, after the
backward has been issued; none in the forward or the backward. (Deciding the skip and the clip
on the device too, as torch's fused optimizers do with `found_inf`, would remove that one.)
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

__all__ = ["StepControl", "StepLog", "read_step_numbers"]


def read_step_numbers(bad: Optional[torch.Tensor], squares: Optional[torch.Tensor]) -> tuple[float, Optional[float]]:
    """The one host read of an optimizer step ([Note: no host sync in a step]): how many flags
    said "not finite" (over ranks and micro-steps) and the gradient's sum of squares (None: no
    norm this step), copied from the device together."""
    parts = [t.reshape(-1).to(torch.float64) for t in (bad, squares) if t is not None]
    if not parts:
        return 0.0, None
    values = torch.cat(parts).tolist()
    return (values[0] if bad is not None else 0.0), (values[-1] if squares is not None else None)


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
        self.boundary_override: Optional[bool] = None
        """What `engine.set_gradient_accumulation_boundary` said the next step() is (None: the count decides)."""
        self.global_steps = 0
        """Optimizer steps so far (accumulation boundaries), skipped ones included."""
        self.skipped_steps = 0
        self.grad_norm: Optional[float] = None
        self.multiplier = 1.0
        """What each gradient is multiplied by in the update being taken (unscale x clip)."""
        self._loss_flags: list[tuple[Any, torch.Tensor]] = []
        self._checks: list[tuple[str, torch.Tensor]] = []  # the backward's float16 checks, for error messages

    # -- backward -----------------------------------------------------------------------------

    def loss_to_backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """The tensor to run the backward from: the loss, over the accumulation steps (unless
        `scale_wrt_gas` is False: the caller divided it), scaled."""
        divisor = self.accumulation if scale_wrt_gas else 1
        if self.scaler is None:
            # [Note: one flag per step]: reduced ahead of the backward's collectives; a tensor on
            # the loss's device, read at the step ([Note: no host sync in a step]).
            flag = torch.isfinite(loss.detach()).all().logical_not().to(torch.float32).reshape(1)
            self._loss_flags.append((self.comm.all_reduce(flag, count=False), flag))
            return loss / divisor if divisor > 1 else loss
        return loss.float() * (self.scaler.scale / divisor)

    @property
    def boundary(self) -> bool:
        """Whether the next engine.step() updates (the last micro-step of an accumulation, or what
        the caller set: `engine.set_gradient_accumulation_boundary`)."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.accumulation == 0

    # -- the update ---------------------------------------------------------------------------

    def nonfinite_error(self, what: str, layouts) -> RuntimeError:
        self.state.settle_grads()
        unit = first_nonfinite((lay.name, self.state.grads.get(lay.name)) for lay in layouts)
        if unit is None and self.scaler is not None:  # gradients on a tier: as the backward saw them
            unit = next((name for name, flag in self._checks if flag.item() > 0), None)
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
            flags = [self._wait(p, "the loss-finiteness flag") for p, _ in pending]
            bad = torch.stack(flags).sum(0) if flags else None
        else:
            # The backward checked each gradient shard as it was reduced (passes/check_gradients.py).
            self._checks = list(self.flags.checks)
            flag = self.comm.all_reduce(self.flags.nonfinite(self.state.device), count=False)
            bad = self._wait(flag, "the float16 overflow flag")
        squares = self._sum_of_squares()
        bad_count, total = read_step_numbers(bad, squares)  # (the step's one host read)
        if self.scaler is None:
            if bad_count > 0:
                return self._nonfinite("the loss is not finite on some rank", layouts)
        else:
            overflow = bad_count > 0
            scale = self.scaler.scale
            self.scaler.update(overflow)
            if overflow:
                if self.scaler.is_stuck:
                    raise self.nonfinite_error(
                        f"the float16 loss scale is stuck at its minimum {self.scaler.policy.min_scale:g}: "
                        f"{self.scaler.policy.window} steps in a row overflowed", layouts)
                return False
            self.multiplier = 1.0 / scale
        self.grad_norm = math.sqrt(total) * self.multiplier if total is not None else None
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

    def _sum_of_squares(self) -> Optional[torch.Tensor]:
        """The whole gradient's sum of squares (of the scaled gradient under float16), summed over
        ranks, a float64 tensor on the device, [Note: clipping from shards]: shards in memory are
        read here, shards on a tier were measured as the backward wrote them. None when the
        backward updated some unit itself (Offload(step_in_backward=True)): its gradient is gone,
        on every rank alike."""
        self.state.settle_grads()
        local = torch.zeros(1, dtype=torch.float64, device=self.state.device)
        for unit, grad in self.state.grads.items():
            if isinstance(grad, torch.Tensor) and grad.numel() > 0:
                local = local + torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2
            elif unit in self.flags.sum_of_squares:
                local = local + self.flags.sum_of_squares[unit]
            else:
                return None
        return self._wait(self.comm.all_reduce(local, count=False), "the gradient norm's sum of squares")

    def sum_over_ranks(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """`t` summed over the ranks in place, for an update that needs sums over whole parameters
        ([Note: sums over whole parameters] in `fxzero/runtime/optim.py`); counted in
        `comm_report()` as an all_reduce. A timeout is an error naming `what`."""
        return self._wait(self.comm.all_reduce(t), what, during="update")

    def sum_flags(self, flags: torch.Tensor) -> Any:
        """Start summing `flags` over the ranks in place, for a choice every rank must make alike
        ([Note: gradients from outside the program]); not counted in `comm_report()`, as the
        agreement's own collectives are not. `flags_summed` waits for it."""
        return self.comm.all_reduce(flags, count=False)

    def flags_summed(self, pending: Any, what: str) -> torch.Tensor:
        return self._wait(pending, what, during="backward")

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

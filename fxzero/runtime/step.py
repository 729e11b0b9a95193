"""Run the step program: AdamW per unit, with offloaded states streamed through memory.

The step program (`fxzero.schedule._step_program`) is a list of instructions like the forward's:
`fetch` / `offload` (a state of one unit from / to its tier, on the io stream), `wait` (of a
fetch, an offload, or a gradient's reduce-scatter the backward left in flight), `optim_step` and, for persistent units, `all_gather` + `wait` of the updated full buffer. States
on the device are read from the engine's dicts in place; fetched ones live in this run's
environment until their last reader (the offload writing them back), so memory holds only the
units the schedule has in flight.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from fxzero.config import AdamW
from fxzero.runtime.comm import Comm, Pending
from fxzero.runtime.executor import _last_reads
from fxzero.runtime.storage.offload_store import OffloadStore
from fxzero.runtime.optim import AdamWState, adamw_step
from fxzero.runtime.storage.pool import BufferPool
from fxzero.schedule import ProgramSchedule
from fxzero.ir.layout import UnitLayout

__all__ = ["StepRunner", "update_streamed"]


class StepRunner:
    """Executes one step program on this rank.

    Args:
        shard_of: unit -> this rank's resident parameter shard (a view into the full buffer for
            persistent units); only called for units whose parameters are not offloaded.
        full_of: unit -> the persistent full parameter buffer the step re-gathers into.
    """

    def __init__(self, program: ProgramSchedule, layouts: list[UnitLayout], comm: Comm,
                 store: Optional[OffloadStore], optimizer: AdamW, pool: Optional[BufferPool] = None) -> None:
        self.program = program
        self.pool = pool or BufferPool(per_size=0)
        self.layouts = {lay.name: lay for lay in layouts}
        self.comm = comm
        self.store = store
        self.optimizer = optimizer
        self.drop_after = _last_reads(program)
        self.state_of = {ins.name: ins.state for ins in program.instructions if ins.kind == "fetch"}
        self.read = {r for ins in program.instructions for r in ins.reads}
        self.written = {ins.name for ins in program.instructions if ins.kind == "offload"}
        # Gradients the backward left in flight (its reduce-scatters, named by the waits here
        # that read them): see [Note: gradients carried into the step] in fxzero/schedule.py.
        defined = {ins.name for ins in program.instructions}
        self.carried = {ins.reads[0]: ins.unit for ins in program.instructions
                        if ins.kind == "wait" and ins.reads[0] not in defined}

    @torch.no_grad()
    def run(self, *, shard_of, full_of, grads: dict[str, torch.Tensor], optim: dict[str, AdamWState],
            gradless: frozenset[str]) -> None:
        """Update every trainable unit. Resident moments are kept in `optim` (created on first
        use); offloaded ones are written back with their step count kept in `optim` too, over
        empty tensors."""
        env: dict[str, Any] = {src: grads[unit] for src, unit in self.carried.items()}
        fetched_by: dict[str, str] = {}  # wait name -> the state it fetched
        for i, ins in enumerate(self.program.instructions):
            if ins.kind == "fetch":
                layout = self.layouts[ins.unit]
                env[ins.name] = self.store.fetch(ins.state, ins.unit, ins.numel, layout.dtype, pool=self.pool)
            elif ins.kind == "wait":
                (src,) = ins.reads
                value = env[src]
                # A carried gradient may be settled already (memory_report waits for them).
                env[ins.name] = value.wait() if isinstance(value, Pending) or src not in self.carried else value
                if src in self.carried:
                    grads[ins.unit] = env[ins.name]
                elif src in self.state_of:
                    fetched_by[ins.name] = self.state_of[src]
                elif src in self.written:
                    self.pool.give(env.pop(ins.name))  # on its tier now: the buffer is free
            elif ins.kind == "optim_step":
                fetched = {fetched_by[r]: env[r] for r in ins.reads if r in fetched_by}
                env[ins.name] = self._update(ins.unit, fetched, shard_of, grads, optim, gradless)
                if "grad" in fetched:  # consumed by the update, not written back
                    self.pool.give(fetched["grad"])
            elif ins.kind == "offload":
                (src,) = ins.reads
                env[ins.name] = self.store.write(ins.state, ins.unit, env[src][ins.state])
            elif ins.kind == "all_gather":
                # Persistent units: every rank updated its slice; gather the updated full buffer.
                env[ins.name] = self.comm.all_gather(full_of(ins.unit), shard_of(ins.unit).clone())
            else:
                raise AssertionError(f"unexpected {ins.kind} in the step program")
            if ins.name not in self.read:
                env.pop(ins.name, None)  # e.g. a finished write's wait: nothing to keep
            for name in self.drop_after.get(i, ()):
                del env[name]

    def _update(self, unit: str, fetched: dict[str, torch.Tensor], shard_of, grads, optim, gradless):
        param = fetched["param"] if "param" in fetched else shard_of(unit)
        grad = fetched["grad"] if "grad" in fetched else grads[unit]
        layout, rank = self.layouts[unit], self.comm.rank
        if "exp_avg" in fetched:
            m, v = update_streamed(layout, rank, self.optimizer, param, grad, fetched["exp_avg"],
                                   fetched["exp_avg_sq"], optim, gradless)
            return {"param": param, "exp_avg": m, "exp_avg_sq": v}
        if unit not in optim:
            optim[unit] = AdamWState.zeros_like(param)
        adamw_step(param, grad, optim[unit], self.optimizer, layout.shard_ranges(rank, skip=gradless))
        return {"param": param}


def update_streamed(layout: UnitLayout, rank: int, optimizer: AdamW, param: torch.Tensor, grad: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, optim: dict[str, AdamWState],
                    gradless: frozenset[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW on one unit whose moments were fetched from a tier (updated in place, returned to be
    written back). Only the step count stays resident, in `optim` over empty tensors."""
    steps = optim[layout.name].step if layout.name in optim else 0
    state = AdamWState(exp_avg, exp_avg_sq, steps)
    adamw_step(param, grad, state, optimizer, layout.shard_ranges(rank, skip=gradless))
    optim[layout.name] = AdamWState(torch.empty(0), torch.empty(0), state.step)
    return exp_avg, exp_avg_sq

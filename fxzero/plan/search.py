"""`plan`: compile the grid's candidates on fake tensors, price each on a cluster, rank them.

[Note: what the plan compiles]
Each candidate is compiled at 2 and 3 blocks and extrapolated to the model's depth ([Note:
pricing by depth]), or from deeper where its first blocks are unlike the rest (`steady_depth`).
That is checked once per stage and offload, on the first candidate of the pair compiled: what
makes the first blocks differ is which units the backward keeps from the forward, gathered or as
fetched shards, which the stage and the offload decide (on Llama 3 8B's shape, recompute none,
unit and selective found the same base). The trace of a depth and micro-batch is made once, with
every unit a recompute region, and shared by the stages, offloads and recomputes: they do not
enter the trace but for the regions' names, which a copy drops where the candidate recomputes
nothing (`trace.without_regions`). Not every candidate of the grid is compiled:
- a stage and offload whose model states alone (the parameters and optimizer states it keeps
  on the device, from the full model's unit layouts) exceed the device's memory is ruled out
  without compiling;
- a candidate that needs more memory than one that did not fit is not compiled either: a larger
  micro-batch with the same stage, recompute and offload, or ZeRO-2 where ZeRO-3 did not fit;
- a candidate is not compiled where one with no more recompute and no more offload already fits
  at the same stage and micro-batch: recomputing adds compute and offloading adds transfers to
  the same program, so neither makes the step faster; they only buy memory. (Priced from 2 and 3
  blocks, an offloaded Llama 3 8B looked faster per block than the same on the device; priced
  from where its blocks are alike, it is slower, as it should be.)
- "unit-attention" is not compiled where the model computes no fused attention (its program is
  unit's: `Activations(keep_attention=True)` has nothing to keep there).
What was not compiled, and why, is listed with the table.

A step is `accumulation` micro-steps (forward and backward: every micro-step gathers and
reduce-scatters again, fxzero's "sharded" accumulation) plus one optimizer step program.
Tokens per second per GPU are global batch x sequence / (GPUs x step); MFU is the model's FLOPs
(3 x the forward program's: the backward does twice the forward's matmuls, and torch's
attention formula counts its backward so too) per step and GPU over the preset's dense peak.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from torch import nn

from fxzero import cost, estimate
from fxzero.compiler import compile_program, plan_layouts, recompute_scopes, trace_for
from fxzero.ir.sizes import is_fused_attention
from fxzero.plan.extrapolate import BASE_DEPTHS, Priced, extrapolate, price, repeated_blocks, steady_depth, with_depth
from fxzero.plan.grid import ACTIVATIONS, MICRO_BATCH_CAP, OFFLOADS, RECOMPUTES, STAGES, Candidate, micro_batches
from fxzero.trace import TracedJoint, without_regions
from fxzero.units import persistent_units

__all__ = ["Plan", "Row", "plan", "rank"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled candidate, priced at the model's depth on the cluster."""

    candidate: Candidate
    step_seconds: float
    """One optimizer step: accumulation x the micro-step, plus the step program."""
    tokens_per_s_per_gpu: float
    mfu: float
    peak_bytes: float
    """Peak device memory per GPU."""
    fits: bool
    """peak_bytes <= the device's memory."""

    def to_json(self) -> dict:
        c = self.candidate
        return {"stage": c.stage, "micro_batch": c.micro_batch, "accumulation": c.accumulation,
                "recompute": c.recompute, "offload": c.offloaded, "step_seconds": self.step_seconds,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "peak_bytes": int(self.peak_bytes), "fits": self.fits}


@dataclasses.dataclass(frozen=True)
class Plan:
    rows: tuple[Row, ...]
    """Ranked (`rank`): what fits, fastest first, then what does not, by its peak."""
    not_compiled: tuple[str, ...]
    """What of the grid was not compiled, and why ([Note: what the plan compiles])."""
    device_memory_bytes: int
    depth: Optional[int]
    """The depth the candidates were extrapolated to (None: compiled whole)."""
    bases: dict
    """(stage, offload) -> the depth k its candidates were extrapolated from (k and k + 1 blocks)."""
    compiles: int

    @property
    def best(self) -> Optional[Row]:
        """The fastest candidate that fits; None where none does."""
        return self.rows[0] if self.rows and self.rows[0].fits else None


def rank(rows: Sequence[Row]) -> list[Row]:
    """What fits first, by step time (the global batch is the same for all: the shortest step has
    the most tokens per second), less memory first among equal steps; then what does not fit,
    from the least memory up."""
    fitting = sorted((r for r in rows if r.fits), key=lambda r: (r.step_seconds, r.peak_bytes))
    over = sorted((r for r in rows if not r.fits), key=lambda r: (r.peak_bytes, r.step_seconds))
    return fitting + over


def _states_on_device(model: nn.Module, candidate: Candidate, gpus: int) -> float:
    """Parameters and optimizer states the candidate keeps on the device for the whole model
    (gradients come and go in the backward: the compiled program's timeline counts them)."""
    config = candidate.config(gpus)
    layouts = plan_layouts(model, config, gpus)
    states = estimate.runtime_model_states(layouts, config.stage, "mixed", persistent=persistent_units(config, layouts),
                                           mixed_precision=config.mixed_precision, optimizer=config.optimizer)
    return estimate.place(dataclasses.replace(states, grads=0), config.stage, config.offload).device


def plan(model: nn.Module, call: Callable[[int], tuple], *, gpus: int, global_batch: int, hardware: cost.CostModel,
         tokens_per_sample: int = 1, max_micro_batch: int = MICRO_BATCH_CAP, micro_batch: Optional[int] = None,
         device: str = "cuda",
         log: Callable[[str], None] = lambda _: None) -> Plan:
    """Plan `model` (on the meta device) for `gpus` GPUs of `hardware` (a `fxzero.cost` preset
    that states `device_memory_bytes`) at `global_batch` samples per optimizer step.

    Args:
        call: micro-batch -> (positional inputs, keyword inputs) of one micro-step of that many samples.
        tokens_per_sample: the sequence length (1: a sample is the unit of throughput).
        micro_batch: plan this micro-batch only (default: the grid's, up to `max_micro_batch`).
        log: told of each compile, for a progress line.
    """
    memory = hardware.device_memory_bytes
    if not memory:
        raise ValueError(f"hardware {hardware.name!r} states no device memory (device_memory_bytes): plan for a GPU "
                         "preset, one of " + ", ".join(sorted(n for n, p in cost.PRESETS.items() if p.device_memory_bytes)))
    per_gpu = global_batch // gpus
    sizes = micro_batches(global_batch, gpus, max_micro_batch, micro_batch)
    hardware = hardware.at_world(gpus)
    blocks = repeated_blocks(model)
    depth = blocks[1] if blocks is not None and blocks[1] > max(BASE_DEPTHS) else None
    peak_flops = hardware.rates.peak_flops[hardware.rates.default_dtype] if hardware.rates else hardware.flops_per_s
    traces: dict[tuple, TracedJoint] = {}  # (blocks, micro-batch) -> the trace with every unit a recompute region
    compiles = 0

    def traced(shallow: nn.Module, n_blocks: Optional[int], mb: int, config) -> TracedJoint:
        """The trace `config` compiles: made once per depth and micro-batch with every unit a
        recompute region, and without them where `config` recomputes none (`without_regions`)."""
        regions = dataclasses.replace(config, activations=ACTIVATIONS["unit"])
        scopes = recompute_scopes(shallow, regions)
        if (n_blocks, mb) not in traces:
            args, kwargs = call(mb)
            traces[n_blocks, mb] = trace_for(shallow, args, regions, layouts=plan_layouts(shallow, regions, gpus),
                                             kwargs=kwargs, device=device)
        trace = traces[n_blocks, mb]
        return trace if recompute_scopes(shallow, config) == scopes else without_regions(trace, scopes)

    def compiled_at(candidate: Candidate, config, n_blocks: Optional[int]) -> Priced:
        nonlocal compiles
        shallow = model if n_blocks is None else with_depth(model, blocks[0], n_blocks)
        args, kwargs = call(candidate.micro_batch)
        layouts = plan_layouts(shallow, config, gpus)
        compiled = compile_program(shallow, args, config, world_size=gpus, layouts=layouts, kwargs=kwargs,
                                   device=device, traced=traced(shallow, n_blocks, candidate.micro_batch, config))
        compiles += 1
        return price(compiled, config, hardware)

    def computes_fused_attention() -> bool:
        """Whether the model's program has a fused attention for "unit-attention" to keep (read
        from a trace already made, or one of 2 blocks made for it)."""
        if not traces:
            n_blocks = None if depth is None else min(BASE_DEPTHS)
            shallow = model if depth is None else with_depth(model, blocks[0], n_blocks)
            traced(shallow, n_blocks, sizes[0], Candidate(stage=STAGES[0], micro_batch=sizes[0], accumulation=1,
                                                          recompute="unit", offload="none").config(gpus))
        return any(is_fused_attention(n) for n in next(iter(traces.values())).gm.graph.nodes)

    bases: dict[tuple, int] = {}  # (stage, offload) -> the depth its blocks are alike from

    def evaluate(candidate: Candidate) -> Row:
        config = candidate.config(gpus)
        log(candidate.label())
        kind = (candidate.stage, candidate.offload)
        if depth is None:
            priced = compiled_at(candidate, config, None)
        elif kind in bases:  # (found once per stage and offload: [Note: what the plan compiles])
            k = bases[kind]
            priced = extrapolate(*(compiled_at(candidate, config, n) for n in (k, k + 1)), depth, k)
        else:
            k, at = steady_depth(lambda n: compiled_at(candidate, config, n), depth)
            bases[kind] = k
            priced = at[depth] if depth in at else extrapolate(at[k], at[k + 1], depth, k)
        step = candidate.accumulation * priced.micro_seconds + priced.step_seconds
        flops = 3 * priced.forward_flops * candidate.accumulation
        return Row(candidate, step, per_gpu * tokens_per_sample / step, flops / step / peak_flops,
                   priced.peak_bytes, priced.peak_bytes <= memory)

    not_compiled = ["ZeRO-1: fxzero runs ZeRO-2's program keeping the full gradient besides (the same step, "
                    "more memory)"]
    ruled_out = set()
    for stage in STAGES:
        for offload in OFFLOADS:
            probe = Candidate(stage=stage, micro_batch=sizes[0], accumulation=per_gpu // sizes[0],
                              recompute="none", offload=offload)
            held = _states_on_device(model, probe, gpus)
            if held > memory:
                ruled_out.add((stage, offload))
                not_compiled.append(f"ZeRO-{stage} with offload {probe.offloaded}: its parameters and optimizer "
                                    f"states alone are {held / 2**30:.1f} GiB per GPU, over {memory / 2**30:.1f} GiB")
    rows: list[Row] = []
    failed: list[tuple[int, int, str, str]] = []  # (stage, micro-batch, recompute, offload) over memory
    implied = dominated = 0
    attends: Optional[bool] = None  # (computes_fused_attention, asked once: where unit-attention is unit)
    for stage in STAGES:
        for mb in sizes:
            fitting: list[tuple[int, int]] = []  # (recompute, offload) indices that fit at this stage and mb
            for o, offload in enumerate(OFFLOADS):
                if (stage, offload) in ruled_out:
                    continue
                for r, recompute in enumerate(RECOMPUTES):
                    if any(fr <= r and fo <= o for fr, fo in fitting):
                        dominated += 1
                        continue
                    if recompute == "unit-attention":
                        if attends is None:
                            attends = computes_fused_attention()
                        if not attends:
                            continue
                    if any(s >= stage and b <= mb and (fr, fo) == (recompute, offload) for s, b, fr, fo in failed):
                        implied += 1
                        continue
                    row = evaluate(Candidate(stage=stage, micro_batch=mb, accumulation=per_gpu // mb,
                                             recompute=recompute, offload=offload))
                    rows.append(row)
                    if row.fits:
                        fitting.append((r, o))
                    else:
                        failed.append((stage, mb, recompute, offload))
    if implied:
        not_compiled.append(f"{implied} that need more memory than one that did not fit (a larger micro-batch, "
                            "or ZeRO-2 where ZeRO-3 did not fit, with the same recompute and offload)")
    if attends is False:
        not_compiled.append("unit-attention (unit recompute keeping each fused attention's outputs): the model "
                            "computes no fused attention (scaled_dot_product_attention), so it is unit")
    if dominated:
        not_compiled.append(f"{dominated} with more recompute or offload than one that fits at the same stage and "
                            "micro-batch (they add compute or transfers to the same step)")
    return Plan(tuple(rank(rows)), tuple(not_compiled), memory, depth, dict(bases), compiles)

"""Model -> traced joint graph -> passes -> Schedule: everything that runs before any rank does.

`compile_program` needs no process group and touches no parameter memory: the world size is a
parameter, the model may live on the meta device, and every tensor is fake. The runtime and
the CLI both start from its result.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from fxzero.config import Config
from fxzero.passes import build_pipeline
from fxzero.passes.runner import PassContext, run_pipeline
from fxzero.passes.tile import plan_tiles
from fxzero.schedule import build_schedule
from fxzero.schedule.compiled import CompiledProgram
from fxzero.target_device import target_device
from fxzero.trace import TracedJoint, trace_joint
from fxzero.ir.layout import UnitLayout
from fxzero.units import bucket_units, persistent_units, plan_units

__all__ = ["compile_program", "plan_layouts", "trace_for"]


def plan_layouts(model: nn.Module, config: Config, world_size: int, cost_model=None,
                 frozen: frozenset[str] = frozenset()) -> list[UnitLayout]:
    """Units (by the config's policy), then buckets of small units where the config asks.

    With mixed precision a unit's layout dtype is its masters' (`MixedPrecision.master_dtype`: fp32
    by default), whatever the model's.
    `frozen`: parameters planned frozen although they require grad (in no param group).
    """
    layouts = plan_units(model, config.units, world_size, frozen=frozen)
    if config.mixed_precision is not None:
        master = config.mixed_precision.master_dtype
        layouts = [dataclasses.replace(lay, dtype=master) if lay.dtype.is_floating_point else lay
                   for lay in layouts]
    if config.bucket is None:
        return _tiled(model, config, layouts)
    max_bytes = config.bucket.max_bytes
    if max_bytes is None:
        if cost_model is None:
            raise ValueError(
                "Config.bucket without max_bytes sizes buckets from the cost model, and there is "
                "none: set Bucket(max_bytes=...) or give a cost model (Config.cost_model)"
            )
        max_bytes = cost_model.latency_bound_bytes()
    return _tiled(model, config, bucket_units(layouts, max_bytes=max_bytes))


def _tiled(model: nn.Module, config: Config, layouts: list[UnitLayout]) -> list[UnitLayout]:
    """Weights over `Config.tiling`'s bound split into units of rows ([Note: tiling] in `passes/tile.py`)."""
    mp = config.mixed_precision
    return plan_tiles(model, layouts, config.tiling, stage=config.stage,
                      itemsize=mp.param_dtype.itemsize if mp is not None else None)


def recompute_scopes(model: nn.Module, config: Config, forward_only: bool = False) -> tuple[str, ...]:
    """The unit modules whose forward the backward recomputes ([Note: recomputing a unit]):
    every module the units policy makes a unit, under `Activations(recompute="unit")` and
    `"selective"` ([Note: selective recompute] in `fxzero/passes/recompute_cut.py`), and where a
    memory budget chooses ([Note: planning activations under a budget])."""
    if (config.activations.recompute == "none" and config.activations.memory_budget is None) or forward_only:
        return ()
    modules = dict(model.named_modules())
    return tuple(lay.name for lay in plan_units(model, config.units, 1) if lay.name in modules and lay.name)


def trace_for(model: nn.Module, example_inputs: Sequence[Any], config: Config, *, layouts: list[UnitLayout],
              kwargs: Mapping[str, Any] | None = None, forward_only: bool = False, device: Any = "cpu") -> TracedJoint:
    """The joint graph `compile_program` rewrites: `model` traced under `config`'s mixed precision
    and recompute regions, with the units of `layouts` trainable."""
    mp = config.mixed_precision
    return trace_joint(model, example_inputs, kwargs=kwargs, param_dtype=mp.param_dtype if mp is not None else None,
                       forward_only=forward_only, device=device, scopes=recompute_scopes(model, config, forward_only),
                       trainable={s.fqn for lay in layouts if lay.trainable for s in lay.slots})


def compile_program(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    config: Config,
    *,
    world_size: int,
    layouts: list[UnitLayout] | None = None,
    cost_model=None,
    kwargs: Mapping[str, Any] | None = None,
    forward_only: bool = False,
    device: Any = "cpu",
    traced: Optional[TracedJoint] = None,
) -> CompiledProgram:
    """Trace `model(*example_inputs, **kwargs)` (tensors give shapes and dtypes; other arguments
    are constants of the program) and schedule it for `world_size` ranks.

    Args:
        cost_model: a `fxzero.cost.CostModel` the passes use to choose how collectives run;
            None keeps the native ones.
        forward_only: the program of a forward under `torch.no_grad()`: traced without the
            backward, every unit compiled as frozen (gathered, computed with, freed; nothing kept
            for a backward, no reduce-scatter, no update), so it costs forward memory only.
        device: the device type the program runs on ("cpu" or "cuda"): its kernels and the
            tensors it creates are that device's, whatever machine compiles it
            ([Note: tracing for a device] in `fxzero/target_device.py`).
        traced: `trace_for`'s trace of this model and call under a config that traces alike
            (the same mixed precision, recompute and trainable units; stage, offload and
            prefetch do not enter the trace): the passes run on a copy of its graph, so one
            trace serves several configs (`fxzero plan` compiles one per stage and offload).
    """
    if layouts is None:
        layouts = plan_layouts(model, config, world_size, cost_model)
    if forward_only:
        layouts = [dataclasses.replace(layout, trainable=False) for layout in layouts]
    if traced is None:
        traced = trace_for(model, example_inputs, config, layouts=layouts, kwargs=kwargs, forward_only=forward_only,
                           device=device)
    else:  # (the passes rewrite the graph in place: a copy keeps the trace for the next config)
        traced = dataclasses.replace(traced, gm=copy.deepcopy(traced.gm))
    ctx = PassContext(layouts=layouts, signature=traced.signature, world_size=world_size)
    joint, records = run_pipeline(traced.gm, ctx, build_pipeline(config, layouts, cost_model))
    schedule = build_schedule(
        ctx.programs, layouts, stage=config.stage, world_size=world_size,
        persistent=persistent_units(config, layouts),
        prefetch_budget_bytes=ctx.outputs.get("prefetch_budget_bytes"), shapes=traced.shapes,
        device=target_device(device).type,
    )
    return CompiledProgram(traced.signature, layouts, ctx.programs, schedule, records, joint)

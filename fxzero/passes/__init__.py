"""The ordered pass pipeline. See README.md beside this file for the IR's invariants."""

from fxzero.config import Config
from fxzero.passes import (
    choose_collectives,
    insert_gather_free,
    insert_reduce_scatter,
    offload,
    partition,
    prefetch,
    separate_phases,
    split,
)
from fxzero.passes.runner import Pass
from fxzero.ir.layout import UnitLayout


def persistent_units(config: Config, layouts: list[UnitLayout]) -> frozenset[str]:
    """Units held whole for the whole step: all of them at stages 1-2, small ones at stage 3."""
    return frozenset(u.name for u in layouts if config.persistent(u.numel))


def build_pipeline(config: Config, layouts: list[UnitLayout], cost_model=None) -> list[Pass]:
    """The passes for a config: ZeRO stages and policies differ only in the knobs bound here.

    `cost_model` (a `fxzero.cost.CostModel`, or None) prices the choices passes make.
    """
    passes = [
        partition.make(persistent=persistent_units(config, layouts)),
        separate_phases.PASS,
        insert_gather_free.PASS,
        insert_reduce_scatter.make(keep_full=config.stage == 1),
    ]
    passes.append(choose_collectives.make(cost_model=cost_model))
    tiers = config.offload.tiers()
    if config.prefetch is not None:
        # A unit kept from the forward has no backward gather, which offloaded parameters need
        # (their backward fetch is what a step in the backward updates): not with offload.
        keep = config.prefetch.keep_for_backward and "param" not in tiers
        passes.append(prefetch.make(max_live_bytes=config.prefetch.max_live_bytes, keep_for_backward=keep))
    if "param" in tiers or "grad" in tiers:
        passes.append(offload.make(
            params=tiers.get("param"), grads=tiers.get("grad"), lookahead=config.offload.lookahead,
            cost_model=cost_model, step_in_backward=tiers.get("exp_avg") if config.offload.step_in_backward else None,
        ))
    passes.append(split.PASS)
    return passes

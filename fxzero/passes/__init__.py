"""The ordered pass pipeline. See README.md beside this file for the IR's invariants."""

from fxzero.config import Config
from fxzero.ir.layout import UnitLayout
from fxzero.passes import (
    activation_budget,
    canonicalize,
    check_gradients,
    choose_collectives,
    insert_gather_free,
    insert_reduce_scatter,
    keep_for_backward,
    offload_activations,
    offload_grads,
    offload_params,
    partition,
    prefetch,
    separate_phases,
    split,
    step_in_backward,
    step_program,
    tile,
)
from fxzero.passes.runner import Pass
from fxzero.units import persistent_units


def build_pipeline(config: Config, layouts: list[UnitLayout], cost_model=None) -> list[Pass]:
    """The passes for a config: ZeRO stages and policies differ only in the knobs bound here.

    `cost_model` (a `fxzero.cost.CostModel`, or None) prices the choices passes make.
    """
    persistent = persistent_units(config, layouts)
    mp = config.mixed_precision
    states = config.optimizer.states  # what the step keeps per element ([Note: optimizer states])
    low = mp.low_dtype if mp is not None else None  # (None: the masters are what the forward gathers)
    state_dtype = mp.optimizer_dtype if mp is not None else None  # (None: the masters' own)
    tiers = config.offload.tiers(mixed_precision=low is not None, optimizer=config.optimizer)
    lookahead = config.offload.lookahead
    tiled = any(tile.is_tile(lay) for lay in layouts)
    held = config.activations.memory_budget  # ([Note: planning activations under a budget])
    tier = config.activations.offload.tier if config.activations.offload is not None else None
    if held is not None and "offload" not in config.activations.budget_choices:
        tier = None  # (the planner keeps what it does not recompute; the tier's own rule does not run)
    if held is not None and cost_model is None:
        raise ValueError("Activations(memory_budget=...) prices recompute and offload with the cost model: "
                         "set Config.cost_model ('measure', a preset name from fxzero.cost.PRESETS, or a CostModel)")
    passes = [
        *([tile.PASS] if tiled else []),
        partition.make(persistent=persistent),
        separate_phases.make(recompute=config.activations.recompute, budget=held, cost_model=cost_model,
                             tier=tier, may_recompute="recompute" in config.activations.budget_choices,
                             keep_attention=config.activations.keep_attention),
        insert_gather_free.PASS,
        insert_reduce_scatter.make(keep_full=config.stage == 1, dtype=mp.grad_dtype if mp is not None else None),
        choose_collectives.make(cost_model=cost_model),
    ]
    if config.prefetch is not None:
        budget = config.prefetch.max_live_bytes
        if budget is None and tiled:  # the tiles gathered at once within the bound ([Note: tiling], tile.py)
            size = mp.param_dtype.itemsize if mp is not None else None
            budget = config.tiling.max_bytes + max((lay.padded_numel * (size or lay.itemsize) for lay in layouts
                                                    if not tile.is_tile(lay)), default=0)
        passes.append(prefetch.make(max_live_bytes=budget))
    if "param" in tiers:
        passes.append(offload_params.make(tier=tiers["param"], lookahead=lookahead, cost_model=cost_model, low_dtype=low))
        passes.append(keep_for_backward.make(buffer="fetched", count=lookahead + 1))
        if config.offload.step_in_backward:
            passes.append(step_in_backward.make(states=states, params=tiers["param"],
                                                optimizer=config.offload.optimizer.tier, lookahead=lookahead,
                                                cost_model=cost_model, low_dtype=low, state_dtype=state_dtype))
    elif config.prefetch is not None and config.prefetch.keep_for_backward is not False:
        # (With offloaded parameters the backward's gathers stay: they read the shards an update
        # in the backward writes; the fetched shards are kept instead.)
        passes.append(keep_for_backward.make(buffer="gathered"))
    if mp is not None and mp.loss_scale is not None:  # float16: an overflow anywhere skips the step
        passes.append(check_gradients.PASS)
    if "grad" in tiers:
        passes.append(offload_grads.make(tier=tiers["grad"], lookahead=lookahead))
    if config.activations.offload is not None:  # saved activations on a tier ([Note: activations on a tier])
        if held is not None:
            passes.append(activation_budget.make_plan_offload(budget=held, tier=config.activations.offload.tier,
                                                              cost_model=cost_model, may_offload=tier is not None))
        passes.append(offload_activations.make(tier=config.activations.offload.tier, cost_model=cost_model,
                                               min_bytes=config.activations.offload_min_bytes))
    passes += [
        canonicalize.PASS,
        split.PASS,
        step_program.make(states=states, tiers=tiers, lookahead=lookahead, persistent=persistent, low_dtype=low,
                          grad_dtype=mp.grad_dtype if mp is not None else None, state_dtype=state_dtype),
    ]
    return passes

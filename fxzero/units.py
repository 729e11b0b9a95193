"""Units: how parameters are grouped for sharding, and buckets of small units.

A unit is the granularity of sharding (FSDP's "wrapping"): its parameters live in one flat
buffer, padded to a multiple of the world size; rank r holds slice r. The grouping depends only
on the module tree and the `UnitsPolicy`, and the layout only on the grouping and the world size,
so every rank computes the same result without talking to the others.
"""

from __future__ import annotations

import torch.nn as nn

from fxzero.config import Config, UnitsPolicy
from fxzero.config.notices import warn_ineffective
from fxzero.ir.layout import ParamSlot, UnitLayout, unique_parameters
from fxzero.leaf_modules import z3_leaf_module

__all__ = ["FROZEN_SUFFIX", "ROOT", "TAIL", "bucket_units", "persistent_units", "plan_units"]

ROOT = "root"
TAIL = "root:tail"
"""The root's parameters registered after the blocks (final norm, untied head): see `plan_units`."""
FROZEN_SUFFIX = ":frozen"


def _is_block_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.Sequential)) and any(
        next(child.parameters(), None) is not None for child in module.children()
    )


def _unit_roots(model: nn.Module, policy: UnitsPolicy) -> list[str]:
    """FQNs of the modules that form units, outermost-first, in module order: those the policy
    matches, and leaf modules outside them ([Note: leaf modules are never split across units]),
    whose own children are then never units."""
    roots: list[str] = []
    if z3_leaf_module(model):  # (the whole model one piece: the root unit)
        return roots
    unsplit: list[str] = []  # leaves the policy would have split

    def visit(fqn: str, module: nn.Module) -> None:
        if fqn and (policy.matches(fqn, module) or z3_leaf_module(module)):
            roots.append(fqn)
            inside = [] if policy.matches(fqn, module) else [  # (else: the policy's own outermost-first rule)
                f"{fqn}.{name}" for name, m in module.named_modules() if name and policy.matches(f"{fqn}.{name}", m)]
            if inside:
                unsplit.append(f"{fqn!r} ({type(module).__name__}; the policy matches {inside[:2]}"
                               f"{' ...' if len(inside) > 2 else ''} inside it)")
            return
        if policy.is_default and _is_block_container(module):
            for name, child in module.named_children():
                if next(child.parameters(), None) is not None:
                    roots.append(f"{fqn}.{name}" if fqn else name)
            return
        for name, child in module.named_children():
            visit(f"{fqn}.{name}" if fqn else name, child)

    visit("", model)
    if unsplit:
        warn_ineffective([
            f"UnitsPolicy splits leaf modules, which are gathered whole ([Note: leaf modules are never split across "
            f"units]), so each is one unit: {'; '.join(unsplit)}. To split them, unflag them "
            "(deepspeed.utils.unset_z3_leaf_modules, or Config(leaf_modules=LeafModules(classes=())) for DeepSpeed's "
            "default classes)"], stacklevel=4)
    return roots


def _owner(fqn: str, roots: list[str]) -> str:
    for root in roots:
        if fqn.startswith(root + "."):
            return root
    return ROOT


def plan_units(model: nn.Module, policy: UnitsPolicy, world_size: int,
               frozen: frozenset[str] = frozenset()) -> list[UnitLayout]:
    """Group the model's unique parameters into units and lay each out as a flat buffer.

    The root unit (parameters outside every unit) comes first, then units in module order.
    The root's parameters registered after the last unit's (a final norm, an untied head) form
    their own unit, "root:tail", last: the forward uses them only at
    its end and the backward at its start, so neither phase waits at its edge for a gather or a
    reduction of the whole root (embedding and head) with no compute to hide it behind. A tied
    head stays with its embedding, where it was first registered. Within a unit, frozen
    parameters (requires_grad=False) are split into their own unit named `<unit>:frozen`, so a
    unit is either wholly trained or wholly frozen. `frozen` names parameters planned frozen
    although they require grad (those in no param group: [Note: parameters in no group] in
    `fxzero/runtime/optimizer.py`).

    Raises:
        ValueError: if a unit mixes dtypes, or a unit policy matched nothing.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    roots = _unit_roots(model, policy)
    if not policy.is_default and not any(policy.matches(fqn, m) for fqn, m in model.named_modules() if fqn):
        raise ValueError(
            "UnitsPolicy matched no module: check module_classes / fqn_prefixes / predicate "
            "against model.named_modules()"
        )
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {ROOT: []}
    for root in roots:
        groups[root] = []
    params = list(unique_parameters(model).items())
    owners = [_owner(fqn, roots) for fqn, _ in params]
    last_block = max((i for i, owner in enumerate(owners) if owner != ROOT), default=None)
    for i, ((fqn, p), owner) in enumerate(zip(params, owners)):
        if owner == ROOT and last_block is not None and i > last_block:
            owner = TAIL
        groups.setdefault(owner, []).append((fqn, p))
    if not groups[ROOT] and TAIL in groups:  # nothing before the blocks: the tail is the root
        groups[ROOT] = groups.pop(TAIL)

    layouts = []
    for name, params in groups.items():
        for trainable in (True, False):
            chosen = [(f, p) for f, p in params if (p.requires_grad and f not in frozen) == trainable]
            if not chosen:
                continue
            dtypes = {p.dtype for _, p in chosen}
            if len(dtypes) > 1:
                raise ValueError(
                    f"unit {name!r} mixes parameter dtypes {sorted(map(str, dtypes))}; a unit is one "
                    "flat buffer of one dtype: cast the model (model.to(dtype)) or split the unit "
                    "with a UnitsPolicy"
                )
            slots, offset = [], 0
            for fqn, p in chosen:
                slots.append(ParamSlot(fqn, tuple(p.shape), offset, p.numel()))
                offset += p.numel()
            unit_name = name if trainable else name + FROZEN_SUFFIX
            layouts.append(UnitLayout(unit_name, tuple(slots), dtypes.pop(), world_size, trainable))
    return layouts


def _merge(run: list[UnitLayout]) -> UnitLayout:
    slots, offset = [], 0
    for layout in run:
        for s in layout.slots:
            slots.append(ParamSlot(s.fqn, s.shape, offset, s.numel))
            offset += s.numel
    first = run[0]
    return UnitLayout("+".join(u.name for u in run), tuple(slots), first.dtype, first.world_size, first.trainable)


def bucket_units(layouts: list[UnitLayout], *, max_bytes: int) -> list[UnitLayout]:
    """Merge runs of adjacent small units into buckets of at most `max_bytes` each.

    A unit of fewer than `max_bytes` bytes joins the bucket before it when both are trained
    (or both frozen), share a dtype and fit together; a bucket is one flat buffer, so its units
    are gathered and reduced by one collective each. The order of units, and so the order of
    collectives, is kept. A bucket is named after its units: "blocks.0+blocks.1".
    """
    out: list[UnitLayout] = []
    run: list[UnitLayout] = []

    def nbytes(units: list[UnitLayout]) -> int:
        return sum(u.numel * u.itemsize for u in units)

    def flush() -> None:
        if run:
            out.append(_merge(run) if len(run) > 1 else run[0])
            run.clear()

    for layout in layouts:
        small = layout.numel * layout.itemsize < max_bytes
        fits = (
            run
            and run[-1].trainable == layout.trainable
            and run[-1].dtype == layout.dtype
            and nbytes(run) + layout.numel * layout.itemsize <= max_bytes
        )
        if not (small and fits):
            flush()
        if small:
            run.append(layout)
        else:
            out.append(layout)
    flush()
    return out


def persistent_units(config: Config, layouts: list[UnitLayout]) -> frozenset[str]:
    """Units held whole for the whole step: all of them at stages 1-2, small ones at stage 3 (never
    a tile: [Note: tiling] in `fxzero/passes/tile.py`)."""
    return frozenset(u.name for u in layouts if config.persistent(u.numel)
                     and not any(s.param_shape is not None for s in u.slots))


def persistence_differences(config: Config, layouts: list[UnitLayout]) -> list[str]:
    """Where `Config.persist_threshold` (per unit) keeps less whole than DeepSpeed's
    stage3_param_persistence_threshold (per parameter) would: one message, or none."""
    if config.stage != 3 or not config.persist_threshold:
        return []
    small = [(s.fqn, s.numel) for u in layouts if not config.persistent(u.numel) for s in u.slots
             if s.numel < config.persist_threshold]
    if not small:
        return []
    names = ", ".join(f for f, _ in small[:3]) + (" ..." if len(small) > 3 else "")
    return [f"persist_threshold={config.persist_threshold} is per unit in fxzero: {len(small)} parameters "
            f"({sum(n for _, n in small)} elements; {names}) are below it but sit in units of more parameters, "
            "so fxzero shards them with their unit where DeepSpeed's per-parameter "
            "stage3_param_persistence_threshold would keep each whole. The result is the same; only the gathers "
            "differ (each such parameter is gathered with its unit)"]

"""plan_units: the grouping of parameters into units and each unit's flat, padded layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxzero.config import UnitsPolicy
from fxzero.ir.layout import ParamSlot, UnitLayout
from fxzero.units import plan_units
from tests.passes.toys import META, WORLD_SIZES, Block, build


def _names(layouts):
    return [u.name for u in layouts]


def _fqns(layouts, name):
    return [s.fqn for s in next(u for u in layouts if u.name == name).slots]


def test_sequential_items_are_units_without_a_root_unit():
    layouts = plan_units(build("mlp"), UnitsPolicy(), 2)
    assert _names(layouts) == ["0", "2", "4"]
    assert _fqns(layouts, "2") == ["2.weight", "2.bias"]
    assert all(u.trainable and u.dtype == torch.float32 for u in layouts)


def test_module_list_items_are_units_after_the_root_unit():
    layouts = plan_units(build("tied"), UnitsPolicy(), 2)
    # The root's parameters after the blocks form the tail unit, last.
    assert _names(layouts) == ["root", "blocks.0", "blocks.1", "root:tail"]
    # The head's weight is the embedding's: it is laid out once, under its first name.
    assert _fqns(layouts, "root") == ["emb.weight"]
    assert _fqns(layouts, "root:tail") == ["norm.weight", "norm.bias"]
    assert _fqns(layouts, "blocks.1") == [
        "blocks.1.fc.weight",
        "blocks.1.fc.bias",
        "blocks.1.norm.weight",
        "blocks.1.norm.bias",
    ]


def test_slots_are_contiguous_in_module_order():
    (unit,) = [u for u in plan_units(build("tied"), UnitsPolicy(), 4) if u.name == "blocks.0"]
    assert unit.slots == (
        ParamSlot("blocks.0.fc.weight", (8, 8), 0, 64),
        ParamSlot("blocks.0.fc.bias", (8,), 64, 8),
        ParamSlot("blocks.0.norm.weight", (8,), 72, 8),
        ParamSlot("blocks.0.norm.bias", (8,), 80, 8),
    )
    assert unit.numel == 88


def test_frozen_params_are_split_into_frozen_units():
    layouts = plan_units(build("frozen"), UnitsPolicy(), 2)
    assert [(u.name, u.trainable) for u in layouts] == [
        ("layers.0", True),
        ("layers.1:frozen", False),
        ("layers.2", True),
        ("layers.2:frozen", False),
    ]
    assert _fqns(layouts, "layers.2") == ["layers.2.bias"]
    assert _fqns(layouts, "layers.2:frozen") == ["layers.2.weight"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_padding_to_a_multiple_of_world_size(world_size):
    for layout in plan_units(build("tied"), UnitsPolicy(), world_size) + plan_units(
        build("mlp"), UnitsPolicy(), world_size
    ):
        assert layout.world_size == world_size
        assert layout.padded_numel % world_size == 0
        assert 0 <= layout.padded_numel - layout.numel < world_size
        assert layout.shard_numel * world_size == layout.padded_numel
        ranges = [layout.shard_range(r) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("world_size, padded", [(1, 27), (2, 28), (4, 28)])
def test_padding_of_an_odd_unit(world_size, padded):
    unit = plan_units(build("mlp"), UnitsPolicy(), world_size)[2]  # 3x8 weight + 3 bias = 27
    assert (unit.numel, unit.padded_numel) == (27, padded)


def test_shard_ranges_cover_parameters_not_padding():
    unit = plan_units(build("mlp"), UnitsPolicy(), 2)[2]  # [weight 0..24) [bias 24..27) [pad 27]
    assert unit.shard_range(1) == (14, 28)
    assert unit.shard_ranges(0) == [(0, 14)]
    assert unit.shard_ranges(1) == [(0, 13)]  # weight and bias merged, padding left out
    assert unit.shard_ranges(0, skip=frozenset({"4.weight"})) == []
    assert unit.shard_ranges(1, skip=frozenset({"4.weight"})) == [(10, 13)]


def test_shard_ranges_with_a_skipped_middle_slot():
    slots = (ParamSlot("a", (3,), 0, 3), ParamSlot("b", (2,), 3, 2), ParamSlot("c", (3,), 5, 3))
    unit = UnitLayout("u", slots, torch.float32, 2, True)
    assert unit.shard_ranges(0) == [(0, 4)]
    assert unit.shard_ranges(0, skip=frozenset({"b"})) == [(0, 3)]
    assert unit.shard_ranges(1, skip=frozenset({"b"})) == [(1, 4)]


def test_layout_json_round_trip():
    for layout in plan_units(build("frozen"), UnitsPolicy(), 4):
        assert UnitLayout.from_json(layout.to_json()) == layout


def test_policy_by_module_class():
    layouts = plan_units(build("tied"), UnitsPolicy(module_classes=(nn.LayerNorm,)), 2)
    assert _names(layouts) == ["root", "blocks.0.norm", "blocks.1.norm", "norm"]
    assert _fqns(layouts, "root") == [
        "emb.weight",
        "blocks.0.fc.weight",
        "blocks.0.fc.bias",
        "blocks.1.fc.weight",
        "blocks.1.fc.bias",
    ]
    same_as_default = plan_units(build("tied"), UnitsPolicy(module_classes=(Block,)), 2)
    assert same_as_default == plan_units(build("tied"), UnitsPolicy(), 2)


def test_policy_by_fqn_replaces_the_default():
    layouts = plan_units(build("tied"), UnitsPolicy(fqn_prefixes=("blocks.1",)), 2)
    assert _names(layouts) == ["root", "blocks.1", "root:tail"]
    assert "blocks.0.fc.weight" in _fqns(layouts, "root")


def test_policy_by_predicate_and_tied_head():
    policy = UnitsPolicy(predicate=lambda fqn, m: isinstance(m, nn.Linear))
    layouts = plan_units(build("tied"), policy, 2)
    # The head matches, but its only parameter is the embedding's, owned by the root unit.
    assert _names(layouts) == ["root", "blocks.0.fc", "blocks.1.fc", "root:tail"]
    assert "emb.weight" in _fqns(layouts, "root")
    assert _fqns(layouts, "root:tail") == ["blocks.1.norm.weight", "blocks.1.norm.bias", "norm.weight", "norm.bias"]


def test_policy_matches_outermost_first():
    policy = UnitsPolicy(fqn_prefixes=("blocks",), module_classes=(nn.Linear,))
    assert _names(plan_units(build("tied"), policy, 2)) == ["root", "blocks", "root:tail"]


def test_policy_matching_nothing_raises():
    with pytest.raises(ValueError, match="matched no module"):
        plan_units(build("mlp"), UnitsPolicy(fqn_prefixes=("nope",)), 2)


def test_policy_rejects_non_module_classes():
    with pytest.raises(TypeError, match="module_classes must hold nn.Module subclasses"):
        UnitsPolicy(module_classes=("Linear",))


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3, dtype=torch.float64)


def test_mixed_dtypes_in_a_unit_raise():
    with META:
        model = _MixedDtypes()
    with pytest.raises(ValueError, match=r"unit 'root' mixes parameter dtypes.*float32.*float64"):
        plan_units(model, UnitsPolicy(), 2)
    # Giving each its own unit is the way out the message names.
    layouts = plan_units(model, UnitsPolicy(fqn_prefixes=("b",)), 2)
    assert [(u.name, u.dtype) for u in layouts] == [("root", torch.float32), ("b", torch.float64)]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        plan_units(build("mlp"), UnitsPolicy(), 0)

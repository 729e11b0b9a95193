"""insert_gather_free and insert_reduce_scatter, checked as Before/Expected on the joint graph."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from torch.testing import FileCheck

import fxzero
from fxzero.ir.alias import alias_closure
from tests.passes.toys import (
    META,
    MODELS_WITH_PARAMS,
    STAGES,
    WORLD_SIZES,
    cached_pipeline,
    kind,
    meta_of,
    of_kind,
    output_args,
    positions,
)

FORWARD, BACKWARD = "forward", "backward"


def _gathers(gm) -> dict[tuple[str, str], list]:
    out = collections.defaultdict(list)
    for n in of_kind(gm, "all_gather"):
        out[(meta_of(n)["unit"], meta_of(n)["phase"])].append(n)
    return out


# ---------------------------------------------------------------------------------------------
# insert_gather_free


@pytest.mark.parametrize(
    "name, expected",
    [
        # Layer 0's input needs no gradient, so its weight is not needed in the backward.
        ("mlp", {FORWARD: {"0", "2", "4"}, BACKWARD: {"2", "4"}}),
        ("tied", {FORWARD: {"root", "blocks.0", "blocks.1", "root:tail"}, BACKWARD: {"root", "blocks.0", "blocks.1", "root:tail"}}),
        # Frozen units are gathered like the others: layers.1's weight carries the gradient to layers.0.
        ("frozen", {FORWARD: {"layers.0", "layers.1:frozen", "layers.2", "layers.2:frozen"},
                    BACKWARD: {"layers.1:frozen", "layers.2:frozen"}}),
    ],
)
def test_expected_gathers_per_unit_and_phase(name, expected):
    gathers = _gathers(cached_pipeline(name, "insert_gather_free").gm)
    assert {p: {u for u, q in gathers if q == p} for p in (FORWARD, BACKWARD)} == expected


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_one_gather_wait_free_per_unit_and_phase(name, world_size):
    run = cached_pipeline(name, "insert_gather_free", 3, world_size)
    gm = run.gm
    pos = positions(gm)
    gathers = _gathers(gm)
    assert all(len(v) == 1 for v in gathers.values())
    waits = {n.args[0]: n for n in of_kind(gm, "wait")}
    frees = collections.Counter(n.args[0] for n in of_kind(gm, "free"))
    for (unit, which), (gather,) in gathers.items():
        assert kind(gather.args[0]) == "unit" and meta_of(gather.args[0])["unit"] == unit
        assert gather.args[1:] == (unit, world_size)
        wait = waits[gather]
        assert meta_of(wait)["phase"] == which and meta_of(wait)["waits_for"] == gather.name
        assert list(gather.users) == [wait]
        assert frees[wait] == 1
        (free,) = [u for u in wait.users if kind(u) == "free"]
        assert meta_of(free)["phase"] == which
        # The gather precedes every view of the unit in this phase, and they all read the wait.
        views = [
            v for v in of_kind(gm, "param_view") if (meta_of(v)["unit"], meta_of(v)["phase"]) == (unit, which)
        ]
        assert views and all(v.args[0] is wait and pos[gather] < pos[wait] < pos[v] for v in views)
        # The free follows the last use of the gathered buffer or any view of it.
        readers = [u for a in alias_closure(wait) for u in a.users if u is not free]
        assert pos[free] > max(pos[r] for r in readers)
    assert len(frees) == len(gathers) == len(of_kind(gm, "free"))
    assert run.records[-1].summary == {"all_gathers": len(gathers), "frees": len(gathers)}


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_sharded_unit_placeholders_feed_only_gathers_and_hold_a_shard(name):
    run = cached_pipeline(name, "insert_gather_free", 3, 4)
    layout = {u.name: u for u in run.layouts}
    for unit in of_kind(run.gm, "unit"):
        assert all(kind(u) == "all_gather" for u in unit.users)
        assert tuple(unit.meta["val"].shape) == (layout[meta_of(unit)["unit"]].shard_numel,)


def test_free_waits_for_the_views_reached_through_split():
    # chunk -> split -> getitem -> t: the free must come after the deepest view's reader.
    gm = cached_pipeline("chunked", "insert_gather_free").gm
    pos = positions(gm)
    for free in of_kind(gm, "free"):
        closure = alias_closure(free.args[0])
        assert any(n.target is torch.ops.aten.split.Tensor for n in closure)
        mms = [u for a in closure for u in a.users if u.target is torch.ops.aten.mm.default]
        assert mms and pos[free] > max(pos[m] for m in mms)


def test_expected_forward_code_for_mlp():
    gm = cached_pipeline("mlp", "insert_gather_free").gm
    check = FileCheck()
    for unit in ("0", "2", "4"):
        (check.check(f"fxzero.all_gather.default(unit_{unit}, '{unit}', 2)")
         .check("fxzero.wait.default(all_gather")
         .check("aten.as_strided.default(wait")
         .check("aten.addmm")
         .check("fxzero.free.default(wait"))
    check.run(gm.code)


@pytest.mark.parametrize("stage", (1, 2))
def test_unsharded_stages_get_no_gather_or_free(stage):
    run = cached_pipeline("tied", "insert_gather_free", stage)
    assert not of_kind(run.gm, "all_gather", "free", "wait")
    assert run.records[-1].changed is False
    assert all(kind(v.args[0]) == "unit" for v in of_kind(run.gm, "param_view"))
    layout = {u.name: u for u in run.layouts}
    for unit in of_kind(run.gm, "unit"):
        assert tuple(unit.meta["val"].shape) == (layout[meta_of(unit)["unit"]].padded_numel,)


class _ReturnsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x), self.lin.weight


def test_gathered_parameter_as_output_raises():
    with META:
        model = _ReturnsWeight()
    with pytest.raises(ValueError, match=r"unit 'root'.*graph output.*\.clone\(\)"):
        fxzero.compile_program(model, [torch.empty(2, 3, device=META)], fxzero.Config(stage=3), world_size=2)


# ---------------------------------------------------------------------------------------------
# insert_reduce_scatter


def _chains(gm) -> dict[str, tuple]:
    """unit -> (flatten_grads, reduce_scatter, wait)."""
    out = {}
    for flat in of_kind(gm, "flatten_grads"):
        (rs,) = flat.users
        (wait,) = rs.users
        out[meta_of(flat)["unit"]] = (flat, rs, wait)
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_one_flatten_reduce_scatter_wait_per_trainable_unit(name, stage):
    before = cached_pipeline(name, "insert_gather_free", stage)
    run = cached_pipeline(name, "insert_reduce_scatter", stage)
    gm, sig = run.gm, run.signature
    trainable = [u for u in run.layouts if u.trainable]
    chains = _chains(gm)
    assert set(chains) == {u.name for u in trainable}
    assert len(of_kind(gm, "reduce_scatter")) == len(trainable)
    grads_before = dict(zip(sig.trainable_fqns, output_args(before.gm)[sig.num_outputs :]))
    pos = positions(gm)
    for layout in trainable:
        flat, rs, wait = chains[layout.name]
        assert flat.next is rs and rs.next is wait  # issued as soon as the gradient is complete
        grads, numels, padded, dtype = flat.args
        expected = [grads_before[s.fqn] for s in layout.slots]
        assert [g.name if g is not None else None for g in grads] == [
            g.name if g is not None else None for g in expected
        ]
        assert (numels, padded, dtype) == ([s.numel for s in layout.slots], layout.padded_numel, layout.dtype)
        assert all(pos[g] < pos[flat] for g in grads if g is not None)
        assert rs.args == (flat, layout.name, 2, stage == 1)
        assert meta_of(rs)["keep_full"] is (stage == 1)
        assert meta_of(wait)["waits_for"] == rs.name
        assert {meta_of(n)["phase"] for n in (flat, rs, wait)} == {BACKWARD}


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_outputs_become_one_grad_shard_per_trainable_unit(name):
    run = cached_pipeline(name, "insert_reduce_scatter")
    sig = run.signature
    trainable = [u.name for u in run.layouts if u.trainable]
    assert run.ctx.outputs["grad_units"] == trainable
    outs = output_args(run.gm)
    assert len(outs) == sig.num_outputs + len(trainable) + len(sig.mutated_buffers)
    shards = outs[sig.num_outputs : sig.num_outputs + len(trainable)]
    assert [meta_of(s)["unit"] for s in shards] == trainable
    assert all(kind(s) == "wait" and kind(s.args[0]) == "reduce_scatter" for s in shards)


def test_frozen_units_get_no_reduce_scatter():
    run = cached_pipeline("frozen", "insert_reduce_scatter")
    assert sorted(_chains(run.gm)) == ["layers.0", "layers.2"]
    assert run.records[-1].summary == {"reduce_scatters": 2}


def test_unused_param_is_flattened_as_a_missing_gradient():
    run = cached_pipeline("unused", "insert_reduce_scatter", 3, 4)
    flat, rs, _ = _chains(run.gm)["root"]
    grads, numels, padded, _ = flat.args
    assert grads == [None] and numels == [5] and padded == 8
    assert rs.args[2] == 4

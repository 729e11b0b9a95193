"""partition and separate_phases, checked as Before/Expected on the joint graph."""

from __future__ import annotations

import pytest
import torch
from torch.testing import FileCheck

from fxzero.config import UnitsPolicy
from fxzero.passes.runner import PassContext, run_pipeline
from fxzero.trace import trace_joint
from fxzero.units import plan_units
from tests.passes.toys import (
    MODELS_WITH_PARAMS,
    build,
    cached_pipeline,
    depends_only_on_units,
    example_inputs,
    kind,
    meta_of,
    of_kind,
    output_args,
    passes_by_name,
    placeholders,
)

FORWARD, BACKWARD = "forward", "backward"


def _phase(node) -> str:
    return meta_of(node).get("phase")


# ---------------------------------------------------------------------------------------------
# partition


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_partition_replaces_params_by_one_unit_placeholder_each(name):
    before = cached_pipeline(name, None)
    assert of_kind(before.gm, "param")
    run = cached_pipeline(name, "partition")
    assert not of_kind(run.gm, "param")
    units = of_kind(run.gm, "unit")
    assert [meta_of(n)["unit"] for n in units] == [u.name for u in run.layouts]
    assert all(n.op == "placeholder" and meta_of(n)["sharded"] is True for n in units)
    # Unit placeholders come first; the other placeholders keep their order.
    kinds = [kind(n) for n in placeholders(run.gm)]
    assert kinds[: len(units)] == ["unit"] * len(units)
    assert kinds[len(units) :] == [kind(n) for n in placeholders(before.gm) if kind(n) != "param"]


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_each_used_param_is_one_as_strided_view_at_its_offset(name):
    run = cached_pipeline(name, "partition", 3, 4)
    views = {meta_of(n)["fqn"]: n for n in of_kind(run.gm, "param_view")}
    assert len(views) == len(of_kind(run.gm, "param_view"))  # one view per parameter
    unit_node = {meta_of(n)["unit"]: n for n in of_kind(run.gm, "unit")}
    gradless = set(run.signature.gradless_fqns)
    for layout in run.layouts:
        assert tuple(unit_node[layout.name].meta["val"].shape) == (layout.padded_numel,)
        for slot in layout.slots:
            if slot.fqn in gradless:
                assert slot.fqn not in views  # an unused parameter needs no view
                continue
            view = views[slot.fqn]
            assert view.target is torch.ops.aten.as_strided.default
            src, shape, _, offset = view.args
            assert (src, tuple(shape), offset) == (unit_node[layout.name], slot.shape, slot.offset)
            assert meta_of(view)["unit"] == layout.name
            assert tuple(view.meta["val"].shape) == slot.shape


def test_partition_expected_code_for_mlp():
    code = cached_pipeline("mlp", "partition").gm.code
    (FileCheck()
     .check("def forward(self, unit_0, unit_2, unit_4,")
     .check("aten.as_strided.default(unit_0, [8, 4], [4, 1], 0)")
     .check("aten.as_strided.default(unit_0, [8], [1], 32)")
     .check("aten.addmm")
     .check("aten.as_strided.default(unit_2, [8, 8], [8, 1], 0)")
     .check("aten.as_strided.default(unit_2, [8], [1], 64)")
     .check("aten.as_strided.default(unit_4, [3, 8], [8, 1], 0)")
     .check("aten.as_strided.default(unit_4, [3], [1], 24)")
     .check_not("fxzero.")
     .run(code))


def test_partition_is_the_same_for_every_stage_but_the_sharded_flag():
    for stage, sharded in ((1, False), (2, False), (3, True)):
        run = cached_pipeline("tied", "partition", stage)
        assert {meta_of(n)["sharded"] for n in of_kind(run.gm, "unit")} == {sharded}
    assert cached_pipeline("tied", "partition", 1).gm.code == cached_pipeline("tied", "partition", 3).gm.code


def test_tied_weight_is_one_view_used_by_embedding_and_head():
    run = cached_pipeline("tied", "partition")
    (view,) = [n for n in of_kind(run.gm, "param_view") if meta_of(n)["fqn"] == "emb.weight"]
    targets = {str(u.target) for u in view.users}
    assert "aten.embedding.default" in targets and "aten.t.default" in targets


def test_partition_summary():
    (record,) = cached_pipeline("frozen", "partition").records
    assert record.changed
    assert (record.summary["units"], record.summary["params"]) == (4, 6)


def test_partition_without_params_returns_unchanged():
    run = cached_pipeline("no_params", "partition")
    before = cached_pipeline("no_params", None)
    assert run.records[0].changed is False
    assert run.gm.code == before.gm.code
    assert not of_kind(run.gm, "unit", "param_view")


def test_partition_rejects_layouts_of_another_model():
    tr = trace_joint(build("mlp"), example_inputs("mlp"))
    layouts = plan_units(build("frozen"), UnitsPolicy(), 2)
    ctx = PassContext(layouts=layouts, signature=tr.signature, world_size=2)
    with pytest.raises(ValueError, match=r"unit layouts do not match the traced parameters"):
        run_pipeline(tr.gm, ctx, [passes_by_name(3, layouts)["partition"]])


# ---------------------------------------------------------------------------------------------
# separate_phases


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_every_node_gets_a_phase(name):
    gm = cached_pipeline(name, "separate_phases").gm
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        expected = BACKWARD if kind(n) == "grad_output" else FORWARD if n.op == "placeholder" else None
        assert _phase(n) in (FORWARD, BACKWARD), n.name
        if expected is not None:
            assert _phase(n) == expected, n.name


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_outputs_and_new_buffers_are_forward_gradients_backward(name):
    run = cached_pipeline(name, "separate_phases")
    sig = run.signature
    outs = output_args(run.gm)
    n_out, n_grads = sig.num_outputs, len(sig.trainable_fqns)
    assert all(_phase(o) == FORWARD for o in outs[:n_out] + outs[n_out + n_grads :])
    assert all(_phase(g) == BACKWARD for g in outs[n_out : n_out + n_grads] if g is not None)


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_forward_never_reads_backward(name):
    gm = cached_pipeline(name, "separate_phases").gm
    for n in gm.graph.nodes:
        if _phase(n) == FORWARD:
            assert all(_phase(i) == FORWARD for i in n.all_input_nodes), n.name


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_backward_recomputes_param_derived_values(name):
    gm = cached_pipeline(name, "separate_phases").gm
    for n in gm.graph.nodes:
        if _phase(n) != BACKWARD or n.op != "call_function":
            continue
        for i in n.all_input_nodes:
            # Unit placeholders are inputs of both programs; computed values must not cross.
            assert not (i.op == "call_function" and _phase(i) == FORWARD and depends_only_on_units(i)), (
                f"backward node {n.name} reads forward parameter-derived value {i.name}"
            )


def test_mlp_backward_gets_its_own_weight_views():
    run = cached_pipeline("mlp", "separate_phases")
    views = of_kind(run.gm, "param_view")
    by_phase = {p: sorted(meta_of(v)["fqn"] for v in views if _phase(v) == p) for p in (FORWARD, BACKWARD)}
    assert by_phase[FORWARD] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    # Gradients w.r.t. activations need the weights of layers 2 and 4; layer 0's input needs none.
    assert by_phase[BACKWARD] == ["2.weight", "4.weight"]
    assert all(kind(v.args[0]) == "unit" for v in views)
    assert run.records[-1].summary["recomputed_in_backward"] == 4  # two as_strided, two t


def test_batchnorm_statistics_are_forward_values():
    gm = cached_pipeline("bn", "separate_phases").gm
    # The trace decomposes native_batch_norm: var_mean gives the batch statistics.
    (stats,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.var_mean.correction]
    assert _phase(stats) == FORWARD
    assert len(stats.users) == 2 and all(_phase(u) == FORWARD for u in stats.users)


def test_random_ops_are_not_recomputed_in_backward():
    gm = cached_pipeline("weight_dropout", "separate_phases").gm
    seeded = torch.Tag.nondeterministic_seeded
    random = [n for n in gm.graph.nodes if n.op == "call_function" and seeded in getattr(n.target, "tags", ())]
    assert random, "expected the dropout mask in the graph"
    assert [n.name for n in random if _phase(n) == BACKWARD] == []

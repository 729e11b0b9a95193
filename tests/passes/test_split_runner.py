"""split (the forward and backward programs) and the generic pass runner."""

from __future__ import annotations

import pytest

import fxzero
from fxzero.passes import build_pipeline
from fxzero.passes.runner import Pass, PassResult, check_pipeline, run_pipeline
from tests.passes.toys import (
    MODELS_WITH_PARAMS,
    PASS_NAMES,
    STAGES,
    alias_root,
    cached_pipeline,
    kind,
    meta_of,
    of_kind,
    output_args,
    passes_by_name,
    pipeline_upto,
    placeholders,
)

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "wait", "free")


def _programs(name, stage=3, world_size=2):
    run = cached_pipeline(name, "split", stage, world_size)
    return run, run.ctx.programs["forward"], run.ctx.programs["backward"]


def _input_kinds(program):
    return [k for k, _ in program.inputs]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_program_inputs_by_kind(name, stage):
    run, fwd, bwd = _programs(name, stage)
    n_units, n_buffers = len(run.layouts), len(run.signature.buffer_fqns)
    assert _input_kinds(fwd) == ["unit"] * n_units + ["buffer"] * n_buffers + ["input"]
    assert [key for k, key in fwd.inputs if k == "unit"] == [u.name for u in run.layouts]
    assert [key for k, key in fwd.inputs if k == "buffer"] == list(run.signature.buffer_fqns)
    kinds = _input_kinds(bwd)
    n_saved = kinds.count("saved")
    assert kinds == ["unit"] * n_units + ["saved"] * n_saved + ["grad_output"]
    # Placeholders line up with the declared inputs.
    assert len(placeholders(fwd.gm)) == len(fwd.inputs) and len(placeholders(bwd.gm)) == len(bwd.inputs)


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_saved_values_pass_from_forward_outputs_to_backward_inputs(name):
    run, fwd, bwd = _programs(name)
    sig = run.signature
    assert fwd.outputs[: sig.num_outputs] == [("output", i) for i in range(sig.num_outputs)]
    n_fixed = sig.num_outputs + len(sig.mutated_buffers)
    assert fwd.outputs[sig.num_outputs : n_fixed] == [("buffer", f) for f in sig.mutated_buffers]
    saved_out = fwd.outputs[n_fixed:]
    assert all(k == "saved" for k, _ in saved_out)
    assert [key for k, key in bwd.inputs if k == "saved"] == [key for _, key in saved_out]
    assert len(output_args(fwd.gm)) == len(fwd.outputs)
    assert bwd.outputs == [("grad", u.name) for u in run.layouts if u.trainable]
    assert len(output_args(bwd.gm)) == len(bwd.outputs)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_no_saved_value_is_a_gathered_or_unit_buffer(name, stage):
    run, fwd, _ = _programs(name, stage)
    n_fixed = run.signature.num_outputs + len(run.signature.mutated_buffers)
    for value in output_args(fwd.gm)[n_fixed:]:
        root = alias_root(value)
        assert kind(root) not in ("wait", "unit", "param_view"), (value.name, root.name)


@pytest.mark.parametrize("name", MODELS_WITH_PARAMS)
def test_forward_program_has_no_grad_output_and_backward_phase_nodes_stay_apart(name):
    _, fwd, bwd = _programs(name)
    assert not of_kind(fwd.gm, "grad_output", "reduce_scatter", "flatten_grads")
    assert all(meta_of(n).get("phase") == "forward" for n in fwd.gm.graph.nodes if n.op == "call_function")
    assert all(meta_of(n).get("phase") == "backward" for n in bwd.gm.graph.nodes if n.op == "call_function")
    assert len(of_kind(bwd.gm, "grad_output")) == 1
    for gm in (fwd.gm, bwd.gm):
        gm.graph.lint()


@pytest.mark.parametrize("stage", (1, 2))
def test_unsharded_programs_read_unit_buffers_directly(stage):
    _, fwd, bwd = _programs("tied", stage)
    assert not of_kind(fwd.gm, *COLLECTIVE_KINDS)
    assert {kind(n) for n in of_kind(bwd.gm, *COLLECTIVE_KINDS)} == {"reduce_scatter", "wait"}


def test_split_summary_counts_the_programs():
    run, fwd, bwd = _programs("mlp")
    calls = lambda gm: sum(1 for n in gm.graph.nodes if n.op == "call_function")  # noqa: E731
    assert run.records[-1].summary == {
        "forward_nodes": calls(fwd.gm),
        "backward_nodes": calls(bwd.gm),
        "saved": sum(1 for k, _ in fwd.outputs if k == "saved"),
    }
    # The input, and each ReLU output (read by the weight gradients and threshold_backward).
    inputs = [p.name for p in placeholders(fwd.gm) if kind(p) == "input"]
    assert [key for k, key in fwd.outputs if k == "saved"] == inputs + ["relu", "relu_1"]


# ---------------------------------------------------------------------------------------------
# runner


def _split_before_reduce_scatter():
    passes = passes_by_name(3, cached_pipeline("mlp", None).layouts)
    order = ("partition", "separate_phases", "insert_gather_free", "split", "insert_reduce_scatter")
    return [passes[name] for name in order]


def test_pipeline_order_is_checked_naming_the_pass_and_its_predecessors():
    with pytest.raises(ValueError) as err:
        check_pipeline(_split_before_reduce_scatter())
    assert str(err.value).startswith(
        "pass 'split' requires ['grads_reduced'], which no earlier pass provides "
        "(runs after: partition, separate_phases, insert_gather_free)"
    )


def test_first_pass_with_missing_requirements_runs_after_nothing():
    phases = passes_by_name(3, [])["separate_phases"]
    expected = r"pass 'separate_phases' requires \['units_partitioned'\].*runs after: nothing"
    with pytest.raises(ValueError, match=expected):
        check_pipeline([phases])
    check_pipeline([phases], available=frozenset({"units_partitioned"}))


@pytest.mark.parametrize("stage", STAGES)
def test_real_pipelines_pass_the_check(stage):
    layouts = cached_pipeline("mlp", None).layouts
    check_pipeline(build_pipeline(fxzero.Config(stage=stage), layouts))
    check_pipeline(build_pipeline(fxzero.Config(stage=stage, prefetch=None), layouts))


def test_nothing_runs_when_the_order_is_wrong():
    calls = []

    def spy(gm, ctx):
        calls.append(gm)
        return PassResult(gm, changed=False)

    run = pipeline_upto("mlp", None)
    code = run.gm.code
    with pytest.raises(ValueError, match="pass 'split'"):
        run_pipeline(run.gm, run.ctx, [Pass("spy", spy)] + _split_before_reduce_scatter())
    assert calls == [] and run.gm.code == code


def test_pass_returning_something_else_is_a_type_error():
    run = pipeline_upto("mlp", None)
    with pytest.raises(TypeError, match="pass 'bad' returned NoneType, not a PassResult"):
        run_pipeline(run.gm, run.ctx, [Pass("bad", lambda gm, ctx: None)])


def test_runner_lints_after_each_pass():
    def breaks_graph(gm, ctx):
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        calls[0].args = (calls[-1], *calls[0].args[1:])  # reads a value defined later
        return PassResult(gm, changed=True)

    run = pipeline_upto("mlp", None)
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        run_pipeline(run.gm, run.ctx, [Pass("breaks", breaks_graph)])


@pytest.mark.parametrize("stage", STAGES)
def test_pass_trace_records_each_pass_with_node_counts(stage):
    run = cached_pipeline("tied", "step_program", stage)
    records = run.records
    pipeline = build_pipeline(fxzero.Config(stage=stage, prefetch=None), run.layouts)
    assert [r.name for r in records] == [p.name for p in pipeline]
    assert [r.name for r in records if r.name in PASS_NAMES] == list(PASS_NAMES)
    assert records[-1].nodes_after == len(run.gm.graph.nodes)
    for prev, rec in zip(records, records[1:]):
        assert rec.nodes_before == prev.nodes_after
    for rec in records:
        assert rec.seconds >= 0 and sum(rec.kinds_after.values()) == rec.nodes_after
        assert set(rec.to_json()) == {
            "name", "changed", "seconds", "nodes_before", "nodes_after", "kinds_after", "summary"
        }
    final = records[-1].kinds_after
    assert final["unit"] == len(run.layouts)
    assert final.get("param", 0) == 0
    # Four units (root, two blocks, the tail), gathered in both phases at stage 3.
    assert final.get("all_gather", 0) == (8 if stage == 3 else 0)
    assert final["reduce_scatter"] == 4
    changed = {r.name: r.changed for r in records}
    assert [changed[n] for n in PASS_NAMES] == [True, True, stage == 3, True, True]


def test_pass_trace_counts_change_as_expected():
    records = {r.name: r for r in cached_pipeline("mlp", "split").records}
    assert records["partition"].kinds_after["param_view"] == 6
    gathers = records["insert_gather_free"]
    assert gathers.nodes_after - gathers.nodes_before == 3 * 5  # gather + wait + free, 5 times
    scatters = records["insert_reduce_scatter"]
    assert scatters.kinds_after["flatten_grads"] == 3
    assert scatters.kinds_after["wait"] == 5 + 3

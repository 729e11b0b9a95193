"""trace_joint: the joint forward+backward graph and its signature, before any pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.trace import trace_joint
from tests.passes.toys import META, build, example_inputs, kind, meta_of, output_args, placeholders, traced


def _kinds(gm) -> list[str]:
    return [kind(n) for n in placeholders(gm)]


def test_placeholders_are_tagged_param_input_grad_output_in_order():
    tr = traced("mlp")
    params = [fqn for fqn, _ in build("mlp").named_parameters()]
    assert _kinds(tr.gm) == ["param"] * len(params) + ["input", "grad_output"]
    assert [meta_of(n)["fqn"] for n in placeholders(tr.gm)[: len(params)]] == params
    assert meta_of(placeholders(tr.gm)[-2]) == {"kind": "input", "index": 0}
    assert meta_of(placeholders(tr.gm)[-1]) == {"kind": "grad_output", "index": 0}
    assert tr.signature.param_fqns == tuple(params)
    assert tr.signature.trainable_fqns == tuple(params)
    assert tr.signature.num_inputs == 1 and tr.signature.num_outputs == 1
    assert tr.signature.differentiable == (True,)


def test_buffers_are_tagged_after_params():
    tr = traced("bn")
    buffers = ("2.running_mean", "2.running_var", "2.num_batches_tracked")
    assert tr.signature.buffer_fqns == buffers
    tagged = [meta_of(n).get("fqn") for n in placeholders(tr.gm) if kind(n) == "buffer"]
    assert tuple(tagged) == buffers
    kinds = _kinds(tr.gm)
    assert kinds.index("buffer") > max(i for i, k in enumerate(kinds) if k == "param")


def test_placeholders_carry_fake_values_with_the_model_shapes():
    tr = traced("mlp")
    shapes = {fqn: tuple(p.shape) for fqn, p in build("mlp").named_parameters()}
    for n in placeholders(tr.gm):
        if kind(n) == "param":
            assert tuple(n.meta["val"].shape) == shapes[meta_of(n)["fqn"]]


def test_tied_parameter_is_one_placeholder():
    model = build("tied")
    tr = traced("tied")
    fqns = [meta_of(n)["fqn"] for n in placeholders(tr.gm) if kind(n) == "param"]
    assert "emb.weight" in fqns and "head.weight" not in fqns
    assert len(fqns) == len(set(fqns)) == len(list(model.parameters()))
    # One gradient per unique parameter: the tied weight's two uses are summed in the graph.
    assert len(tr.signature.trainable_fqns) == len(fqns)


def test_no_fxzero_ops_before_the_passes():
    tr = traced("tied")
    targets = {str(n.target) for n in tr.gm.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxzero.") for t in targets)
    assert all(n.op in ("placeholder", "call_function", "output") for n in tr.gm.graph.nodes)


def test_batchnorm_running_stats_come_out_as_outputs():
    tr = traced("bn")
    sig = tr.signature
    assert sig.mutated_buffers == ("2.running_mean", "2.running_var", "2.num_batches_tracked")
    outs = output_args(tr.gm)
    assert len(outs) == sig.num_outputs + len(sig.trainable_fqns) + len(sig.mutated_buffers)
    new_buffers = outs[-len(sig.mutated_buffers) :]
    # New values, not the old placeholders, and no in-place copy_ left in the graph.
    assert all(isinstance(n, torch.fx.Node) and n.op == "call_function" for n in new_buffers)
    assert not [n for n in tr.gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert new_buffers[2].meta["val"].dtype == torch.long


def test_batchnorm_in_eval_mode_mutates_nothing():
    model = build("bn").eval()
    tr = trace_joint(model, example_inputs("bn"))
    assert tr.signature.mutated_buffers == ()
    assert len(output_args(tr.gm)) == tr.signature.num_outputs + len(tr.signature.trainable_fqns)


def test_frozen_params_get_no_grad_output():
    tr = traced("frozen")
    sig = tr.signature
    frozen = {"layers.1.weight", "layers.1.bias", "layers.2.weight"}
    assert set(sig.param_fqns) - set(sig.trainable_fqns) == frozen
    assert sig.trainable_fqns == ("layers.0.weight", "layers.0.bias", "layers.2.bias")
    assert len(output_args(tr.gm)) == sig.num_outputs + 3
    # Frozen parameters are still inputs of the graph.
    assert {meta_of(n)["fqn"] for n in placeholders(tr.gm) if kind(n) == "param"} >= frozen


def test_unused_param_lands_in_gradless_fqns():
    tr = traced("unused")
    sig = tr.signature
    assert sig.gradless_fqns == ("unused",)
    assert "unused" in sig.trainable_fqns
    grads = output_args(tr.gm)[sig.num_outputs : sig.num_outputs + len(sig.trainable_fqns)]
    by_fqn = dict(zip(sig.trainable_fqns, grads))
    assert by_fqn["unused"] is None
    assert all(isinstance(g, torch.fx.Node) for f, g in by_fqn.items() if f != "unused")


def test_integer_input_gives_one_grad_output_for_the_float_output():
    tr = traced("tied")
    assert _kinds(tr.gm).count("input") == 1
    assert _kinds(tr.gm).count("grad_output") == 1
    assert tr.signature.differentiable == (True,)


class _MutatesParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            self.scale.add_(1)
        return x * self.scale


class _PlainTensorAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.offset = torch.zeros(3)

    def forward(self, x):
        return self.lin(x) + self.offset


def test_in_place_parameter_mutation_raises_naming_it():
    with META:
        model = _MutatesParam()
    with pytest.raises(ValueError, match=r"mutates param scale in place"):
        trace_joint(model, [torch.empty(2, 3, device=META)])


def test_plain_tensor_attribute_raises_type_error():
    with META:
        model = _PlainTensorAttr()
    with pytest.raises(TypeError, match=r"plain tensor attribute 'offset'.*register_buffer\('offset'"):
        trace_joint(model, [torch.empty(2, 3, device=META)])


def test_bad_inputs_raise_type_error():
    model = build("mlp")
    with pytest.raises(TypeError, match="input 0 is a object; fxzero traces tensors and constants"):
        trace_joint(model, [object()])
    with pytest.raises(TypeError, match=r"input x\['a'\]\[1\] is a bytearray"):
        trace_joint(model, [], kwargs={"x": {"a": [1, bytearray(b"?")]}})



def test_an_input_that_requires_grad_gets_its_gradient_as_the_last_output():
    """[Note: inputs that require grad]: the joint graph's last output is the input's gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(2, 4, requires_grad=True)
    traced = trace_joint(model, [x])
    assert traced.signature.input_grads == (0,)
    out = model(x)
    g = torch.randn_like(out)
    (want,) = torch.autograd.grad(out, x, g)
    params = [p.detach() for p in dict(model.named_parameters()).values()]
    buffers = [b for b in dict(model.named_buffers()).values()]
    results = traced.gm(*params, *buffers, x.detach(), g)
    assert torch.equal(traced.signature.input_grad_results(results)[0], want)
    assert trace_joint(model, [x.detach()]).signature.input_grads == ()


class _BranchOnValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        h = self.layers[0](x)
        if h.sum() > 0:  # the line the error names
            h = h * 2
        return self.layers[1](h)


@pytest.mark.timeout(60)
def test_a_branch_on_a_tensor_value_is_explained_naming_the_models_line():
    from fxzero.trace import DataDependentControlFlow

    with pytest.raises(DataDependentControlFlow) as info:
        trace_joint(_BranchOnValue(), [torch.randn(2, 4)])
    message = str(info.value)
    assert message.startswith("the forward reads a tensor's value in Python at ")
    assert f"{__file__}:" in message and "(`if h.sum() > 0:  # the line the error names`)" in message
    assert "torch.cond" in message and "one static program" in message
    # the engine runs such a forward eagerly (at ZeRO-3, every unit held for it), saying so once, naming the line
    torch.manual_seed(0)
    model = _BranchOnValue()
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, persist_threshold=0))
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"\[rank 0\] the forward reads a tensor's value in Python at .*eagerly"):
        out = engine(x)
    torch.manual_seed(0)
    torch.testing.assert_close(out, _BranchOnValue()(x), rtol=0, atol=0)


class _ConstantFromData(torch.nn.Module):
    def __init__(self, values) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.values = values

    def forward(self, x):
        return self.lin(x) + torch.tensor(self.values)


def test_tensor_constants_from_python_values_are_made_in_the_graph_or_named():
    """One value repeated (a `torch.tensor(-inf)`, an empty KV cache's `torch.tensor([])`) becomes
    a node that creates it; several values are an error saying to register a buffer."""
    x = torch.randn(3, 2)
    model = _ConstantFromData([0.5, 0.5])
    traced = trace_joint(model, [x])
    assert not [n for n in traced.gm.graph.nodes if n.op == "get_attr"]
    assert any(n.target is torch.ops.aten.full.default for n in traced.gm.graph.nodes)
    with pytest.raises(ValueError, match=r"constant tensor of shape \(2,\) from Python data .* register_buffer"):
        trace_joint(_ConstantFromData([1.0, 2.0]), [x])


class _InPlace(nn.Module):
    """In-place operators of every kind a model writes: an in-place activation, dropout (whose
    decomposition draws with `bernoulli_`), and a tensor updated with `add_` and `mul_`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.act, self.drop = nn.ReLU(inplace=True), nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.a(x)))
        h.add_(1.0).mul_(0.5)
        return self.b(h).sum()


@pytest.mark.parametrize("name", ["mlp", "tied", "bn", "frozen", "chunked", "weight_dropout", "in_place"])
def test_the_joint_graph_mutates_nothing(name):
    """The passes read a functional graph: whether the first trace had in-place operators to
    rewrite (dropout, BatchNorm's running statistics, the model's own `add_`) or none (then it is
    kept as it is: [Note: a trace with nothing to functionalize]), no operator in what
    trace_joint returns writes into an argument."""
    if name == "in_place":
        torch.manual_seed(0)
        tr = trace_joint(_InPlace(), [torch.randn(3, 4)])
    else:
        tr = traced(name)
    mutating = [str(n.target) for n in tr.gm.graph.nodes if n.op == "call_function"
                and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
    assert mutating == []
    assert any(n.op == "call_function" for n in tr.gm.graph.nodes)


class _OwnCheckpoint(nn.Module):
    """Two blocks of dropout MLPs, the second calling torch.utils.checkpoint itself."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
                                    for _ in range(2))

    def forward(self, x):
        x = x + self.blocks[0](x)
        return x + torch.utils.checkpoint.checkpoint(self.blocks[1], x, use_reentrant=False)


@pytest.mark.parametrize("model, spec", [("own checkpoint", None), ("gpt-tiny", "gpt-tiny")])
def test_a_trace_without_its_unit_regions_compiles_as_one_traced_without_them(model, spec):
    # `fxzero plan` traces once with every unit a recompute region and compiles the candidates that
    # recompute nothing from a copy without those regions: the same program as a trace of its own.
    import dataclasses

    from fxzero.compiler import compile_program, plan_layouts, recompute_scopes, trace_for
    from fxzero.config import Activations, Config
    from fxzero.modelspec import build_model
    from fxzero.trace import without_regions

    torch.manual_seed(0)
    net = build_model(spec) if spec else _OwnCheckpoint()
    x = torch.zeros(2, 32, dtype=torch.long) if spec else torch.randn(4, 16)
    config = Config(units=fxzero.UnitsPolicy(module_classes=(nn.Sequential,))) if not spec else Config()
    unit = dataclasses.replace(config, activations=Activations(recompute="unit"))
    scopes = recompute_scopes(net, unit)
    assert scopes
    regions = trace_for(net, (x,), unit, layouts=plan_layouts(net, unit, 2))
    assert set(scopes) == {n.meta.get("fxzero_scope") for n in regions.gm.graph.nodes} - {None}
    without = without_regions(regions, scopes)
    # The model's own checkpoint call holds the unit blocks.1: without the unit regions its nodes
    # are the checkpoint's region, which the backward recomputes under any policy.
    own = {n.meta.get("fxzero_scope") for n in without.gm.graph.nodes} - {None}
    assert own == ({"checkpoint:1"} if spec is None else set())
    shared = compile_program(net, (x,), config, world_size=2, traced=without)
    fresh = compile_program(net, (x,), config, world_size=2)
    assert shared.joint.code == fresh.joint.code
    assert [(i.kind, i.unit) for i in shared.schedule.program("backward").instructions] == \
        [(i.kind, i.unit) for i in fresh.schedule.program("backward").instructions]

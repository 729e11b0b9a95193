"""Symbolic sizes in one process ([Note: any size, one program] in `fxzero/ir/shapes.py`): a dim
traced symbolic with the guards torch recorded, the calls a program accepts and the ones that
get another program, the schedule's figures evaluated at the traced size (equal to a program
traced at that size alone) and saying so in its JSON, sizes that depend on the data estimated
at their largest, and the errors where a data-dependent size cannot be followed.
(Training on 2 ranks against eager: tests/dist/test_dynamic_shapes.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero import zoo
from fxzero.compiler import compile_program
from fxzero.schedule import Schedule
from fxzero.trace import DataDependentControlFlow, DataDependentShape, trace_joint
from tests.dist.reference import lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(180)


def _dynamic(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """An alias of t with `dims` marked dynamic (torch's mark for torch.compile, which fxzero reads)."""
    t = t.detach()
    for d in dims:
        torch._dynamo.mark_dynamic(t, d)
    return t


def _counting(engine) -> list:
    calls, compile_program_ = [], engine._compile

    def counted(*args):
        calls.append(1)
        return compile_program_(*args)

    engine._compile = counted
    return calls


class _Tokens(nn.Module):
    """Embedding, a block, a head over the positions whose label is not -100 (nonzero)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = torch.relu(block(h))
        picked = torch.nonzero((labels != -100).view(-1)).view(-1)
        h = torch.index_select(h.view(-1, 8), 0, picked)
        return F.cross_entropy(self.head(h), torch.index_select(labels.view(-1), 0, picked))


def _tokens(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (rows, length), generator=g)
    labels = torch.where(torch.rand(rows, length, generator=g) < 0.4, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]
    return ids, labels


def test_a_marked_dim_is_traced_symbolic_and_its_guards_say_which_calls_it_serves():
    ids, labels = _tokens(4, 7, seed=0)
    static = trace_joint(_Tokens(), [ids, labels])
    assert static.shapes.shapes == ((4, 7), (4, 7)) and not static.shapes.dynamic and not static.shapes.guards
    traced = trace_joint(_Tokens(), [_dynamic(ids, 1), _dynamic(labels, 1)])
    shapes = traced.shapes
    (a, length), (b, other) = shapes.shapes
    assert (a, b) == (4, 4) and isinstance(length, str) and isinstance(other, str) and shapes.dynamic
    assert dict(shapes.sizes)[length] == 7  # the figures are for the example's length
    assert "2 <= L['t0'].size()[1]" in shapes.guards  # (0/1 specialization: length 1 is another program)
    assert any(n.target is torch.ops.aten.sym_size.int for n in traced.gm.graph.nodes)
    assert shapes.accepts([torch.zeros(4, 30, dtype=torch.long), torch.zeros(4, 11, dtype=torch.long)])
    assert not shapes.accepts([torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, 11, dtype=torch.long)])
    assert not shapes.accepts([torch.zeros(3, 9, dtype=torch.long), torch.zeros(3, 9, dtype=torch.long)])


def test_the_schedule_s_figures_are_for_the_traced_size_and_its_json_says_so():
    """A symbolic program's bytes and FLOPs, evaluated at the example's sizes, are those of the
    program traced at that size alone; the JSON names the sizes; guards read back from a file
    are shown, never run."""
    ids, labels = _tokens(4, 7, seed=0)
    config = fxzero.Config(stage=3, cost_model=None)
    static = compile_program(_Tokens(), [ids, labels], config, world_size=2).schedule
    dynamic = compile_program(_Tokens(), [_dynamic(ids, 1), _dynamic(labels, 1)], config, world_size=2).schedule
    for name in ("forward", "backward", "step"):
        for field in ("bytes", "flops", "read_bytes"):
            total = [sum(getattr(i, field) for i in s.program(name).instructions) for s in (static, dynamic)]
            assert total[0] == total[1] and (total[0] > 0 or name == "step"), (name, field, total)
    assert dynamic.peak_gathered_bytes == static.peak_gathered_bytes
    assert dynamic.fingerprint == static.fingerprint  # the same collectives, whatever the length
    text = dynamic.dumps()
    back = Schedule.loads(text)
    assert back.shapes == dynamic.shapes and '"sizes"' in text and "figures at" in back.shapes.describe()
    with pytest.raises(RuntimeError, match="read from a file: their guards are shown, never run"):
        back.shapes.accepts([ids, labels])


def test_a_data_dependent_size_is_estimated_at_its_largest():
    """nonzero's count is an unbacked size; the figures take every position as selected (an upper
    bound on memory): the head's matmul moves rows x length rows."""
    ids, labels = _tokens(4, 7, seed=0)
    compiled = compile_program(_Tokens(), [ids, labels], fxzero.Config(stage=3, cost_model=None), world_size=1)
    shapes = compiled.schedule.shapes
    (symbol,) = shapes.estimated
    assert dict(shapes.sizes)[symbol] == 4 * 7 and "data-dependent" in shapes.describe()
    graph = compiled.programs["forward"].gm.graph
    (logits,) = [n for n in graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)
                 if n.meta["val"].shape[-1] == 32]
    assert str(logits.meta["val"].shape[0]) == symbol  # rows: the selected positions, a symbol
    head = [i for i in compiled.schedule.program("forward").instructions if i.name == logits.name]
    assert head and head[-1].bytes == 4 * 7 * 32 * 4  # (28 rows of 32 logits, float32)


def test_one_program_serves_every_length_after_the_second_and_equals_eager():
    """The first length is traced at its size, the second with the length symbolic; that one
    serves every later length. A batch of other rows (the last, smaller one) makes the rows
    symbolic too, once. Losses and parameters equal eager."""
    torch.manual_seed(0)
    model = _Tokens()
    ref = copy.deepcopy(model)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, optimizer=fxzero.AdamW(lr=1e-2)))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    compiles = _counting(engine)
    programs = []
    calls = [(4, 7), (4, 9), (4, 5), (4, 12), (4, 3), (4, 7), (4, 16), (3, 10), (4, 6), (2, 13)]
    for step, (rows, length) in enumerate(calls):
        ids, labels = _tokens(rows, length, seed=step)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        want = ref(ids, labels)
        want.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=0)
        programs.append(engine.program)
    assert len(compiles) == 3 and all(p is programs[1] for p in programs[1:7])
    assert all(p is programs[7] for p in programs[7:])
    assert all(isinstance(d, str) for shape in programs[7].shapes.shapes for d in shape)
    state = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_a_dim_marked_by_the_user_is_symbolic_from_the_first_call():
    engine = fxzero.compile(zoo.build("gpt-tiny"), fxzero.Config(stage=3, cost_model=None))
    compiles = _counting(engine)
    for length in (8, 5, 13):
        x, y = make_gpt_batches(zoo.GPT_SIZES["tiny"], 1, 2, seed=length)[0]
        engine.backward(lm_loss(engine(_dynamic(x[:, :length], 1)), y[:, :length]))
        engine.step()
    assert len(compiles) == 1 and engine.program.shapes.dynamic


class _BranchOnLength(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        x = self.layers[0](x)
        if x.shape[1] > 4:  # a guard of the symbolic program: a shorter call gets another program
            x = self.layers[1](x)
        return self.layers[2](x).sum()


def test_a_call_outside_a_program_s_guards_gets_another_program():
    torch.manual_seed(0)
    model = _BranchOnLength()
    ref = copy.deepcopy(model)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    compiles = _counting(engine)
    seen = {}
    for length in (8, 6, 3, 7, 2, 5):
        x = torch.randn(2, length, 4)
        out = engine(x)
        torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
        seen[length] = engine.program
    assert len(compiles) == 3, len(compiles)  # 8 alone; 6 with the length symbolic (> 4); 3: at most 4
    assert seen[6] is seen[7] is seen[5] and seen[3] is seen[2] and seen[3] is not seen[6]
    assert "5 <= L['t0'].size()[1]" in seen[6].shapes.guards
    assert "2 <= L['t0'].size()[1] and L['t0'].size()[1] <= 4" in seen[3].shapes.guards


class _BranchOnCount(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, labels):
        picked = torch.nonzero(labels >= 0).view(-1)
        if picked.numel() > 0:  # the line the error names
            x = x[picked]
        return self.lin(x).sum()


class _ReturnsSelected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, labels):
        return self.lin(x)[labels >= 0]


class _OneHot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, labels):
        return (self.lin(x).sum(-1, keepdim=True) * F.one_hot(labels)).sum()  # the line the error names


def test_a_data_dependent_size_the_trace_cannot_follow_is_an_error_naming_the_line_and_the_ways_out():
    x, labels = torch.randn(6, 4), torch.tensor([0, -1, 2, 3, -1, 1])
    with pytest.raises(DataDependentShape) as info:  # (the engine runs such a forward eagerly: test_trace.py)
        trace_joint(_BranchOnCount(), [x, labels])
    message = str(info.value)
    assert message.startswith("the forward decides in Python on a size that depends on the data")
    assert f"{__file__}:" in message and "(`if picked.numel() > 0:  # the line the error names`)" in message
    assert "torch.where(mask, x, 0)" in message and "ignore_index=-100" in message

    with pytest.raises(DataDependentShape, match=r"output is a differentiable tensor whose size depends on the data|"
                                                 r"returns a differentiable tensor whose size depends on the data"):
        trace_joint(_ReturnsSelected(), [x, labels])
    with torch.no_grad():  # without a gradient to trace, the selected rows are an output like any other
        got = fxzero.compile(_ReturnsSelected(), fxzero.Config(cost_model=None))(x, labels)
    assert got.shape == (4, 4)

    with pytest.raises(DataDependentControlFlow) as info:
        trace_joint(_OneHot(), [x, labels.clamp(min=0)])
    assert "(`return (self.lin(x).sum(-1, keepdim=True) * F.one_hot(labels)).sum()  # the line the error names`)" in str(
        info.value)


class _LoopOverLength(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return sum(h[:, i] * (i + 1) for i in range(x.shape[1])).sum()  # the length as a Python int


def test_a_model_that_needs_the_length_at_one_size_compiles_each_and_says_where():
    torch.manual_seed(0)
    model = _LoopOverLength()
    ref = copy.deepcopy(model)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    compiles = _counting(engine)
    with pytest.warns(UserWarning, match=r"\[rank 0\] the model needs some input sizes that change between calls at "
                                         r"one size: input 0 dim 1 \(fixed at .*test_dynamic_shapes.py:\d+"):
        for length in (4, 6, 5):
            x = torch.randn(2, length, 4)
            torch.testing.assert_close(engine(x), ref(x), rtol=1e-6, atol=1e-6)
    assert len(compiles) == 3 and not engine.program.shapes.dynamic

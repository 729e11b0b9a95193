"""`Activations(recompute="unit")` ([Note: recomputing a unit] in `fxzero/config/activations.py`).

One rank here (2 ranks: `tests/dist/test_recompute.py`). A Hugging Face GPT-2 with its dropouts
trains bit for bit as the resident run does, with the same collectives, and keeps a third of the
bytes for the backward; what it keeps of a unit is what flows into it or out of it and what a
dropout drew, checked node by node; the backward's all-gathers are the resident program's, none
added.
"""

from __future__ import annotations


import pytest
import torch

import fxzero
from fxzero.ir.rng import rng_state

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

CONFIG = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64)  # dropouts at GPT-2's 0.1


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG)).state_dict()


def _batches(n: int = 4) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _train(recompute: str, stage: int = 3):
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    config = fxzero.Config(stage=stage, cost_model=None, activations=fxzero.Activations(recompute=recompute))
    engine = fxzero.compile(model, config, state_dict=_state())
    torch.manual_seed(5)  # (the dropout masks: the same draws in both runs)
    losses = []
    for ids in _batches():
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return engine, losses


def _saved(engine) -> list[torch.fx.Node]:
    """The forward program's values kept for the backward (its outputs past the model's own)."""
    forward = engine._stepping.compiled.programs["forward"]
    outputs = next(n for n in forward.gm.graph.nodes if n.op == "output").args[0]
    return [n for n in outputs if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]


def _bytes(nodes) -> int:
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in nodes)


@pytest.fixture(scope="module")
def runs():
    return {recompute: _train(recompute) for recompute in ("none", "unit", "selective")}


@pytest.mark.parametrize("policy", ["unit", "selective"])
def test_a_recomputed_step_equals_the_resident_one_bit_for_bit(runs, policy):
    (resident, want), (recomputed, got) = runs["none"], runs[policy]
    assert got == want
    state, expected = recomputed.full_state_dict(), resident.full_state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert recomputed.comm_report() == resident.comm_report()  # the same gathers and reductions


def test_the_backward_gathers_no_more_than_the_resident_one(runs):
    def gathers(engine):
        return [i.unit for i in engine._stepping.compiled.schedule.program("backward").instructions
                if i.kind == "all_gather"]

    assert gathers(runs["unit"][0]) == gathers(runs["none"][0])
    assert gathers(runs["selective"][0]) == gathers(runs["none"][0])


def _pass_summary(engine, name: str) -> dict:
    return next(r for r in engine._stepping.compiled.pass_trace if r.name == name).summary


def test_selective_keeps_matmul_outputs_and_recomputes_the_cheap_operators(runs):
    """[Note: selective recompute]: of each unit, what is kept is an input, a random draw, a
    value leaving the unit, or the cut's choice; nothing a matmul computes is recomputed; it keeps
    between what "unit" and the resident run keep, and the pass trace records the cut."""
    engine = runs["selective"][0]
    forward = engine._stepping.compiled.programs["forward"].gm.graph
    backward = engine._stepping.compiled.programs["backward"].gm.graph
    assert not [n for n in backward.nodes if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                                                         torch.ops.aten.mm.default)
                and n.meta.get("fxzero", {}).get("phase") == "forward"]
    recomputed_matmuls = [n for n in backward.nodes if n.target is torch.ops.aten.addmm.default]
    assert not recomputed_matmuls  # (GPT-2's Conv1D is addmm: its backward is mm's only)
    unit_bytes, resident_bytes = _bytes(_saved(runs["unit"][0])), _bytes(_saved(runs["none"][0]))
    kept = _bytes(_saved(engine))
    assert unit_bytes < kept < resident_bytes
    summary = _pass_summary(engine, "separate_phases")
    assert summary["cut_recomputed_values"] > 0 and summary["cut_kept_bytes"] > 0
    assert summary["recomputed_in_backward"] < _pass_summary(runs["unit"][0], "separate_phases")["recomputed_in_backward"]


class _TwoBranches(torch.nn.Module):
    """A block whose cheap tail reads two matmuls: tanh(a(x) + b(x)) * 2. Tanh's backward reads
    its output; keeping both matmul outputs to recompute it costs twice what keeping the sum (or
    tanh's output) does."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.a(x) + self.b(x)) * 2


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_TwoBranches(), _TwoBranches()])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * 1.5
        return self.head(x).sum()


def test_the_cut_keeps_the_sum_not_both_matmul_outputs():
    """The minimum cut, not the greedy rule "keep every costly input of a recomputed value":
    the greedy rule keeps a(x) and b(x), 2 tensors of (6, 8) per block; the cut keeps one (the
    sum or tanh's output: the same bytes; the block's input is made outside it). Trains as the
    resident run."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    state = _Stack().state_dict()
    engines = {}
    for policy in ("none", "selective"):
        config = fxzero.Config(stage=3, cost_model=None,
                               activations=fxzero.Activations(recompute=policy))
        engines[policy] = engine = fxzero.compile(_Stack(), config, state_dict=state)
        for _ in range(2):
            engine.backward(engine(x))
            engine.step()
    assert engines["selective"].full_state_dict().keys() == engines["none"].full_state_dict().keys()
    for k, v in engines["none"].full_state_dict().items():
        assert torch.equal(engines["selective"].full_state_dict()[k], v), k
    forward = engines["selective"]._stepping.compiled.programs["forward"].gm.graph
    by_name = {n.name: n for n in forward.nodes}
    kept = {}
    for node in _saved(engines["selective"]):
        scope = by_name[node.name].meta.get("fxzero_scope")
        if scope is not None:
            kept.setdefault(scope, []).append(tuple(node.meta["val"].shape))
    assert kept == {"blocks.0": [(6, 8)], "blocks.1": [(6, 8)]}, kept


def test_a_unit_keeps_what_crosses_its_edge_and_the_generator_states(runs):
    """Of a unit, "unit" keeps what leaves it and, for each dropout, the generator state it drew
    from ([Note: replaying random operators] in fxzero/ir/rng.py): no mask."""
    engine = runs["unit"][0]
    forward = engine._stepping.compiled.programs["forward"].gm.graph
    by_name = {n.name: n for n in forward.nodes}
    states = 0
    for node in _saved(engine):
        scope = node.meta.get("fxzero_scope")
        if scope is None:
            continue  # (the root unit's computation stays resident)
        made = by_name[node.name]
        if made.target is rng_state:
            states += 1
            assert node.meta["val"].numel() == torch.get_rng_state().numel()
            continue
        leaves = any(u.op == "call_function" and u.meta.get("fxzero_scope") != scope for u in made.users)
        assert leaves, f"{node.name} of {scope} is kept but does not leave the unit"
    assert states == 3 * CONFIG["n_layer"]  # (GPT-2's block: attention's, the projection's, the MLP's dropout)
    resident = _bytes(_saved(runs["none"][0]))
    assert _bytes(_saved(engine)) <= 0.27 * resident  # (measured 0.26, 0.34 with masks kept: inputs, root resident)


def _train_checkpointed_hf(eager: bool):
    """GPT-2 after gradient_checkpointing_enable() (torch.utils.checkpoint around each block):
    fxzero's engine, or eager PyTorch."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))
    model.gradient_checkpointing_enable()
    if eager:
        model.load_state_dict(_state())
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    else:
        config = fxzero.Config(stage=3, cost_model=None, optimizer=fxzero.AdamW(lr=1e-3, weight_decay=0.0))
        model = engine = fxzero.compile(model, config, state_dict=_state())
    torch.manual_seed(5)
    losses = []
    for ids in _batches(3):
        out = model(input_ids=ids, labels=ids, use_cache=False)
        if eager:
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.backward(out.loss)
            engine.step()
        losses.append(out.loss.item())
    return losses, (model.state_dict() if eager else engine.full_state_dict()), (None if eager else engine)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_a_model_that_checkpoints_itself_trains_as_eager_and_keeps_less(runs):
    """Hugging Face's gradient_checkpointing_enable(): each checkpoint call is a recompute region
    ([Note: recompute regions] in fxzero/trace.py); it equals eager PyTorch's checkpointed run
    (its dropout masks restored from the RNG state, fxzero's kept) and keeps what "unit" keeps."""
    got, state, engine = _train_checkpointed_hf(eager=False)
    want, expected, _ = _train_checkpointed_hf(eager=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for k in expected:
        if k in state:
            torch.testing.assert_close(state[k], expected[k], rtol=1e-5, atol=1e-6)
    assert _bytes(_saved(engine)) == _bytes(_saved(runs["unit"][0]))


def test_recompute_is_refused_by_name_for_what_it_does_not_know():
    with pytest.raises(ValueError, match=r"Activations\(recompute=...\) must be one of \('none', 'unit', 'selective'\), got 'all'"):
        fxzero.Activations(recompute="all")


def test_memory_report_counts_the_activations_kept_until_the_backward():
    held = {}
    for recompute in ("none", "unit"):
        engine, _ = _train(recompute)
        ids = _batches(1)[0]
        assert engine.memory_report()["activations"] == 0  # (every forward's backward has run)
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        held[recompute] = engine.memory_report()["activations"]  # (the storages held: views count once)
        engine.backward(out.loss)
        assert engine.memory_report()["activations"] == 0
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        del out  # (a forward whose graph is dropped without a backward releases them too)
        assert engine.memory_report()["activations"] == 0
        assert engine.memory_report()["activations_peak"] >= held[recompute] > 0
    assert held["unit"] < 0.5 * held["none"]


def _train_llama(checkpointed: bool) -> tuple[list[float], dict, dict, int]:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(config).state_dict()
    model = transformers.LlamaForCausalLM(config)
    if checkpointed:
        model.gradient_checkpointing_enable()
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None), state_dict=state)
    losses = []
    for ids in _batches(3):
        out = engine(input_ids=ids, labels=ids, use_cache=False)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses, engine.full_state_dict(), engine.comm_report(), _bytes(_saved(engine))


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_a_llama_that_checkpoints_itself_trains_as_the_resident_run_bit_for_bit():
    """Hugging Face Llama after gradient_checkpointing_enable(): each decoder layer a recompute
    region, the steps equal fxzero's resident run bit for bit with the same collectives, and
    less kept for the backward."""
    want, expected, traffic, resident = _train_llama(checkpointed=False)
    got, state, checkpointed_traffic, kept = _train_llama(checkpointed=True)
    assert got == want
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert checkpointed_traffic == traffic
    assert kept < resident

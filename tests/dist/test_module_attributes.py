"""Module attributes the user changes between calls (a temperature annealed every step, Dropout's
`p`, a Hugging Face config's `output_hidden_states`) are what the next call computes with, on 2
ranks ([Note: module attributes changed after compile] in `fxzero/runtime/engine.py`).

Before, the programs held the values they were traced with: a temperature annealed by the
training loop stayed at its first value, a Dropout whose `p` was raised kept dropping nothing,
without a word. The reference is eager PyTorch making the same changes between the same steps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from tests.dist.harness import run_ranks
from tests.dist.reference import assert_state_close, eager_data_parallel

pytestmark = pytest.mark.timeout(300)

WORLD, STEPS = 2, 4


class Tempered(nn.Module):
    """Logits divided by a temperature the loop anneals; a Dropout whose rate the loop sets."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(6, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.0)
        self.tau = 1.0

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.drop(torch.tanh(self.body(x)))) / self.tau, y)


def _model() -> Tempered:
    torch.manual_seed(0)
    return Tempered()


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(3, 6, generator=g), torch.randint(0, 4, (3,), generator=g)


def _anneal(model: Tempered, step: int) -> None:
    model.tau = 1.0 / (1 + step)  # (every step: each traces again)
    if step == STEPS - 1:
        model.drop.p = 1.0  # (drops everything: the head sees zeros, deterministically)


def _eager() -> tuple[list[float], dict]:
    model = _model()
    return eager_data_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1), _batch, STEPS, WORLD, _anneal)


def _run(rank: int, world_size: int, stage: int) -> dict:
    model = _model()
    engine = fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.SGD(lr=0.1), cost_model=None))
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            _anneal(model, step)
            loss = engine(*_batch(step, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
    mean = torch.stack(losses)
    torch.distributed.all_reduce(mean)
    said = [str(w.message) for w in caught if "changed since the last call" in str(w.message)]
    return {"losses": (mean / world_size).tolist(), "state": engine.full_state_dict(), "said": said}


@pytest.mark.parametrize("stage", [1, 3])
def test_attributes_changed_between_steps_are_what_the_next_step_computes_with(stage):
    want_losses, want_state = _eager()
    for rank, got in enumerate(run_ranks(_run, WORLD, stage, timeout_s=240)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=0, atol=1e-6)
        assert_state_close(got["state"], want_state, f"rank {rank}", atol=1e-6)
        assert len(got["said"]) == 1 and "tau (1.0 -> 0.5)" in got["said"][0], got["said"]  # (said once)


def _hf_run(rank: int, world_size: int) -> dict:
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    engine = fxzero.compile(transformers.GPT2LMHeadModel(config), fxzero.Config(stage=3, cost_model=None))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = engine(input_ids=ids).hidden_states
        engine.module.config.output_hidden_states = True
        after = engine(input_ids=ids).hidden_states
    return {"before": before is None, "after": None if after is None else len(after)}


def test_a_hugging_face_config_flag_set_after_compile_is_honoured():
    for got in run_ranks(_hf_run, WORLD, timeout_s=240):
        assert got == {"before": True, "after": 3}, got  # (the embeddings' output and each layer's)


def _replaced_run(rank: int, world_size: int, stage: int) -> dict:
    model = _model()
    engine = fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.SGD(lr=0.1), cost_model=None))
    engine.backward(engine(*_batch(0, rank)))
    engine.step()
    model.head = nn.Linear(16, 4)  # (re-headed after compile)
    out = {"keys": sorted(model.state_dict())}  # (the model's own state dict still reads, the new head's its own)
    for what, call in (("forward", lambda: engine(*_batch(1, rank))), ("step", engine.step)):
        try:
            call()
            out[what] = None
        except RuntimeError as e:
            out[what] = str(e)
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_module_replaced_after_compile_is_refused_by_name(stage):
    for got in run_ranks(_replaced_run, WORLD, stage, timeout_s=240):
        assert got["keys"] == sorted(_model().state_dict())
        for what in ("forward", "step"):
            assert "parameters changed after compile (replaced ['head.bias', 'head.weight'])" in got[what], got[what]


def _adapters_run(rank: int, world_size: int) -> dict:
    import peft
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = base(input_ids=ids).logits
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-2), cost_model=None))
    traces, compile_program = [0], engine._compile

    def counted(*args, **kwargs):
        traces[0] += 1
        return compile_program(*args, **kwargs)

    engine._compile = counted
    reference = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):  # (DPO's reference forward through the same model, adapters off; then the policy's)
            with torch.no_grad(), model.disable_adapter():
                reference.append(engine(input_ids=ids).logits)
            loss = engine(input_ids=ids).logits.float().square().mean()
            engine.backward(loss)
            engine.step()
    return {"first": torch.equal(reference[0], want), "traces": traces[0]}


def test_peft_adapters_toggled_every_step_trace_once_per_state():
    got = run_ranks(_adapters_run, 1, timeout_s=240)[0]
    assert got["first"]  # (adapters off: the base model's logits)
    assert got["traces"] == 2, got  # (adapters off, under no_grad; on, with its backward: each traced once)


def _halve(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 0.5


def _hooks(model: Tempered, step: int) -> None:
    """A forward hook added after two steps (as a callback adds NEFTune's noise hook), removed after three."""
    if step == 2:
        model._halving = model.body.register_forward_hook(_halve)
    if step == 3:
        model._halving.remove()


def _hooks_run(rank: int, world_size: int, stage: int) -> dict:
    model = _model()
    engine = fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.SGD(lr=0.1), cost_model=None))
    for step in range(STEPS + 1):
        _hooks(model, step)
        engine.backward(engine(*_batch(step, rank)))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_forward_hook_added_and_removed_after_compile_is_followed(stage):
    model = _model()
    _, want = eager_data_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1), _batch, STEPS + 1, WORLD, _hooks)
    for rank, got in enumerate(run_ranks(_hooks_run, WORLD, stage, timeout_s=240)):
        assert_state_close(got, want, f"rank {rank}", atol=1e-6)


def _steady_run(rank: int, world_size: int) -> dict:
    import types

    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-2), cost_model=None))
    traces, compile_program = [0], engine._compile

    def counted(*args, **kwargs):
        traces[0] += 1
        return compile_program(*args, **kwargs)

    engine._compile = counted
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):  # (train, then generate from the model directly, as an RLHF loop does)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            with torch.no_grad():
                model.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0, synced_gpus=True)
        steady = traces[0]
        forward = model.transformer.forward
        model.transformer.forward = types.MethodType(  # (a library replacing a module's forward on the instance)
            lambda self, *a, **k: forward(*a, **k), model.transformer)
        engine(input_ids=ids, labels=ids)
    return {"steady": steady, "after_replacing_forward": traces[0]}


def test_nothing_changed_traces_nothing_and_a_replaced_forward_traces_again():
    for got in run_ranks(_steady_run, WORLD, timeout_s=240):
        assert got == {"steady": 1, "after_replacing_forward": 2}, got


class ReadsExtra(nn.Module):
    """A forward that reads a buffer if the model has one (`getattr(self, "extra", None)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        extra = getattr(self, "extra", None)
        return self.lin(x) if extra is None else self.lin(x) + extra


def _new_buffer_run(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = ReadsExtra()
    engine = fxzero.compile(model, fxzero.Config(stage=1, cost_model=None))
    x = torch.randn(2, 4)
    engine(x)
    model.register_buffer("extra", torch.full((3,), 5.0))
    try:
        engine(x)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_buffer_registered_after_compile_is_refused_by_name():
    message = run_ranks(_new_buffer_run, 1, timeout_s=120)[0]
    assert "the model's buffers changed after compile (new ['extra'])" in message, message

"""bfloat16 masters and optimizer states (`MixedPrecision(master_dtype=, optimizer_dtype=)`,
DeepSpeed's bf16_master_weights_and_grads / bf16_optimizer_states) and `Autocast` (DeepSpeed's
torch_autocast), in a world of one: parity with the eager references of
`tests/dist/low_precision_reference.py`, the bytes per parameter, checkpoints across master
dtypes, and the DeepSpeed keys. (Two ranks: tests/dist/test_low_precision_masters.py.)
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import warnings

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero import estimate, zoo
from fxzero.config import notices
from fxzero.config.deepspeed import read_deepspeed
from fxzero.runtime.checkpoint.export import export_checkpoint
from tests.dist.harness import ADAMW
from tests.dist.low_precision_reference import eager_bf16_masters
from tests.dist.reference import clone_state_dict, lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(300)

BF16 = torch.bfloat16
DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "deepspeedexamples_configs"
FULL = "training__bf16_master_weight__configs__bf16_full.json"


def _mp(optimizer_dtype=BF16, master_dtype=BF16) -> fxzero.MixedPrecision:
    return fxzero.MixedPrecision(param_dtype=BF16, reduce_dtype=None, master_dtype=master_dtype,
                                 optimizer_dtype=optimizer_dtype)


@functools.cache
def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return clone_state_dict(zoo.build("gpt-tiny"))


def _batches(n: int, seed: int = 5):
    return make_gpt_batches(zoo.GPT_SIZES["tiny"], n, 4, seed=seed)


def _engine(mp, stage: int = 3, **config) -> fxzero.Engine:
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    return fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.AdamW(**ADAMW), cost_model=None,
                                               mixed_precision=mp, **config), state_dict=_initial())


def _train(engine, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_WARNED", set())
    monkeypatch.setattr(notices, "_PRINTED", set())


# -- the policy -----------------------------------------------------------------------------------


def test_the_dtypes_are_fp32_or_the_compute_dtype():
    assert fxzero.MixedPrecision().low_dtype is BF16  # fp32 masters: a compute copy beside them
    assert _mp().low_dtype is None  # the masters are the compute copy
    for field in ("master_dtype", "optimizer_dtype"):
        with pytest.raises(ValueError, match=rf"MixedPrecision.{field} must be torch.float32 or param_dtype "
                                             r"\(torch.bfloat16\), got torch.float16"):
            fxzero.MixedPrecision(**{field: torch.float16})


# -- parity with the eager references --------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("states", [BF16, torch.float32], ids=["bf16-states", "fp32-states"])
def test_bf16_masters_train_as_the_eager_reference(stage, states):
    batches = _batches(3)
    engine = _engine(_mp(states), stage)
    losses = _train(engine, batches)
    want_losses, want, want_states = eager_bf16_masters(lambda: zoo.build("gpt-tiny"), _initial(), batches, 1, states)
    assert losses == want_losses
    got = engine.full_state_dict()
    assert {str(v.dtype) for v in got.values()} == {"torch.bfloat16"}
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert not engine.state.low  # no second copy of the parameters
    for fqn, param in engine.module.named_parameters():
        for kind in ("exp_avg", "exp_avg_sq"):
            state = fxzero.utils.safe_get_full_optimizer_state(param, kind)
            assert state.dtype == states == want_states[fqn][kind].dtype, (fqn, kind)
            assert torch.equal(state, want_states[fqn][kind]), (fqn, kind)
    module = engine.module.state_dict()  # the user's module: the trained values (gathered at ZeRO-3)
    assert all(torch.equal(module[k], v) for k, v in want.items())


@pytest.mark.parametrize("states, offload", [
    (torch.float32, fxzero.Offload(optimizer=fxzero.Cpu())),  # DeepSpeed's mode for fp32 states: offloaded
    (BF16, fxzero.Offload(params=fxzero.Cpu(), optimizer=fxzero.Cpu())),
    (BF16, fxzero.Offload(params=fxzero.Cpu(), optimizer=fxzero.Cpu(), step_in_backward=True)),
], ids=["fp32-states-on-cpu", "bf16-all-on-cpu", "bf16-step-in-backward"])
def test_bf16_masters_offloaded(states, offload):
    batches = _batches(3, seed=7)
    engine = _engine(_mp(states), 3, offload=offload)
    losses = _train(engine, batches)
    want_losses, want, _ = eager_bf16_masters(lambda: zoo.build("gpt-tiny"), _initial(), batches, 1, states)
    assert losses == want_losses
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    store = engine.state.store
    for unit in engine.layouts:  # on the tier as they are held: 2-byte masters, states in their dtype
        assert store.get("exp_avg", unit.name).dtype == store.get("exp_avg_sq", unit.name).dtype == states
        if offload.offloaded("param") and unit.name not in engine.state.whole:
            assert store.get("param", unit.name).dtype == BF16 and not store.has("low", unit.name)


def test_accumulation_adds_the_micro_steps_in_bf16():
    batches = _batches(4, seed=9)
    engine = _engine(_mp(), 2, gradient_accumulation_steps=2)
    losses = _train(engine, batches)
    want_losses, want, _ = eager_bf16_masters(lambda: zoo.build("gpt-tiny"), _initial(), batches, 1, BF16, 2)
    assert losses == want_losses and engine.global_steps == 2
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_torch_keeps_adam_states_in_the_parameters_dtype():
    """What "bf16 optimizer states" equals: torch.optim.AdamW on a bfloat16 parameter."""
    p = nn.Parameter(torch.randn(4, dtype=BF16))
    p.grad = torch.randn(4, dtype=BF16)
    opt = torch.optim.AdamW([p])
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == BF16


# -- memory -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mp, per_param", [
    (fxzero.MixedPrecision(reduce_dtype=None), 2 + 2 + 4 + 8),  # the compute copy, gradient, fp32 master, moments
    (_mp(torch.float32), 2 + 2 + 8),  # the bf16 master is the compute copy; fp32 moments
    (_mp(BF16), 2 + 2 + 4),  # DeepSpeed's bf16_full
], ids=["fp32-masters", "bf16-masters", "bf16-masters-and-states"])
def test_model_states_per_parameter(mp, per_param):
    engine = _engine(mp)
    x, y = _batches(1)[0]
    _train(engine, [(x, y)])
    engine.backward(lm_loss(engine(x), y))  # gradients held, optimizer states made
    states = estimate.runtime_model_states(engine.layouts, 3, "mixed", mixed_precision=mp)
    assert engine.memory_report()["model_states"] == states.total
    phi = sum(u.numel for u in engine.layouts)  # a world of one: no padding
    assert states.total == per_param * phi


# -- checkpoints ------------------------------------------------------------------------------------


def test_a_checkpoint_of_bf16_masters_resumes_exactly(tmp_path):
    batches = _batches(4, seed=11)
    engine = _engine(_mp())
    _train(engine, batches[:2])
    engine.save_checkpoint(str(tmp_path), tag="t")
    later = _train(engine, batches[2:])
    resumed = _engine(_mp())
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert _train(resumed, batches[2:]) == later
    got, want = resumed.full_state_dict(), engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    manifest = json.loads((tmp_path / "t" / "fxzero.json").read_text())
    assert {t[2] for t in manifest["tensors"]} == {"bfloat16"}  # the masters as they are, 2 bytes each


def test_checkpoints_load_across_master_dtypes(tmp_path):
    """bf16 masters into an fp32-master run: widened, exactly; fp32 masters into a bf16-master run:
    rounded, and said so."""
    batches = _batches(2, seed=13)
    low = _engine(_mp())
    _train(low, batches)
    low.save_checkpoint(str(tmp_path), tag="bf16")
    wide = _engine(fxzero.MixedPrecision(reduce_dtype=None))
    wide.load_checkpoint(str(tmp_path), tag="bf16")
    saved = low.full_state_dict()
    got = wide.full_state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], saved[k].float()) for k in saved)
    p = next(iter(wide.module.parameters()))
    assert torch.equal(fxzero.utils.safe_get_full_optimizer_state(p, "exp_avg"),
                       fxzero.utils.safe_get_full_optimizer_state(next(iter(low.module.parameters())),
                                                                  "exp_avg").float())
    _train(wide, batches[:1])  # and it trains on
    wide.save_checkpoint(str(tmp_path), tag="fp32")
    back = _engine(_mp())
    with pytest.warns(UserWarning, match=r"master parameters are float32 .* and this run's are bfloat16 "
                                         r"\(MixedPrecision.master_dtype\): they are rounded to bfloat16"):
        back.load_checkpoint(str(tmp_path), tag="fp32")
    fp32 = wide.full_state_dict()
    assert all(torch.equal(v, fp32[k].to(BF16)) for k, v in back.full_state_dict().items())
    # `fxzero export` gives the masters as saved: bfloat16 from a bfloat16-master checkpoint.
    from safetensors.torch import load_file
    export_checkpoint(str(tmp_path / "bf16"), str(tmp_path / "out"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in exported.items())


# -- DeepSpeed's keys ---------------------------------------------------------------------------------


def test_deepspeedexamples_bf16_full_config_is_read():
    reading = read_deepspeed(DATA / FULL)
    assert reading.fields["mixed_precision"] == _mp(BF16)
    assert reading.fields["autocast"] == fxzero.Autocast(dtype=BF16)
    assert reading.fields["stage"] == 3 and not reading.notes


@pytest.mark.parametrize("bf16, zero, match", [
    ({"bf16_optimizer_states": True}, {"stage": 3},
     r"bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads"),
    ({"enabled": False, "bf16_master_weights_and_grads": True}, {"stage": 3},
     r"bf16_master_weights_and_grads needs bfloat16 training: set \"bf16\": \{\"enabled\": true\}"),
    ({"bf16_master_weights_and_grads": True}, {"stage": 0}, r"is for ZeRO stages 1, 2 and 3"),
    ({"bf16_master_weights_and_grads": True}, {}, r"is for ZeRO stages 1, 2 and 3"),  # DeepSpeed's default stage 0
])
def test_deepspeeds_conditions_are_kept(bf16, zero, match):
    with pytest.raises(ValueError, match=match):
        read_deepspeed({"bf16": {"enabled": True, **bf16}, "zero_optimization": zero})


def test_bf16_masters_with_fp32_states_read_anywhere_and_said_once():
    reading = read_deepspeed({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                              "zero_optimization": {"stage": 2}, "communication_data_type": "fp32"})
    assert reading.fields["mixed_precision"] == fxzero.MixedPrecision(
        param_dtype=BF16, reduce_dtype=torch.float32, master_dtype=BF16, optimizer_dtype=torch.float32)
    assert any("DeepSpeed runs this only with offload_optimizer on the cpu" in n for n in reading.notes)
    assert any("gradients are reduced and held in fp32" in n for n in reading.notes)
    offloaded = read_deepspeed({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    assert offloaded.fields["mixed_precision"].optimizer_dtype == torch.float32 and not offloaded.notes


# -- torch_autocast -------------------------------------------------------------------------------------


@pytest.mark.parametrize("section, match", [
    ({"enabled": True}, r"\"torch_autocast\" is enabled with no \"dtype\""),
    ({"enabled": True, "dtype": "torch.float16"}, r"torch_autocast to float16 without \"fp16\" enabled"),
    ({"enabled": True, "dtype": "fp32"}, r"torch_autocast.dtype 'fp32': autocast runs in"),
])
def test_torch_autocast_refusals(section, match):
    with pytest.raises(ValueError, match=match):
        read_deepspeed({"torch_autocast": section})
    with pytest.raises(ValueError, match=r"torch_autocast.dtype 'bf16' and the enabled \"fp16\" section differ"):
        read_deepspeed({"torch_autocast": {"enabled": True, "dtype": "bf16"}, "fp16": {"enabled": True}})


def test_torch_autocast_of_an_fp32_model_is_read_with_a_note():
    reading = read_deepspeed({"torch_autocast": {"enabled": True, "dtype": "bfloat16",
                                                 "lower_precision_safe_modules": ["torch.nn.Linear"]}})
    assert reading.fields["autocast"] == fxzero.Autocast() and reading.fields["mixed_precision"] is None
    assert any("lower_precision_safe_modules" in n and "in fp32" in n for n in reading.notes)
    assert any("torch_autocast.lower_precision_safe_modules' has no effect" in w for w in reading.ineffective)
    assert read_deepspeed({"torch_autocast": {"enabled": False, "dtype": "torch.float16"}}).fields["autocast"] is None


class _Net(nn.Module):
    """Ops autocast treats in different ways: Linear (to bf16), LayerNorm (in fp32), GELU and
    log_softmax (in their input's dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
                                    for _ in range(2))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return torch.log_softmax(self.head(x), -1)


@pytest.mark.parametrize("mp", [None, _mp()], ids=["fp32-model", "bf16-masters"])
def test_autocast_runs_the_engine_as_eager_autocast(mp):
    """Config.autocast: each call as eager under torch.autocast, the caller's autocast replaced
    (here: none, then a disabled one), step by step equal to eager AdamW on the same parameters."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model).to(BF16 if mp is not None else torch.float32)
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None, mixed_precision=mp,
                                                 autocast=fxzero.Autocast(), optimizer=fxzero.AdamW(**ADAMW)))
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
        caller = dict(dtype=torch.float16) if step % 2 else dict(enabled=False)
        with torch.autocast("cpu", **caller):  # the engine's own autocast replaces the caller's
            out = engine(x)
        loss = nn.functional.nll_loss(out.float(), y)
        engine.backward(loss)
        engine.step()
        with torch.autocast("cpu", dtype=BF16):
            want = ref(x.to(BF16) if mp is not None else x)
        want_loss = nn.functional.nll_loss(want.float(), y)
        want_loss.backward()
        opt.step()
        opt.zero_grad()
        assert out.dtype == want.dtype
        assert float(loss.detach()) == float(want_loss), step
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    assert len(engine._cache) == 1  # one program: the caller's autocast does not reach it


def test_autocast_float16_needs_float16_mixed_precision():
    with pytest.raises(ValueError, match=r"Autocast\(dtype=torch.float16\)\) needs loss scaling"):
        fxzero.Config(autocast=fxzero.Autocast(dtype=torch.float16))
    with pytest.raises(ValueError, match=r"Config.autocast.dtype torch.bfloat16 and mixed_precision.param_dtype "
                                         r"torch.float16 differ"):
        fxzero.Config(autocast=fxzero.Autocast(), mixed_precision=fxzero.MixedPrecision(param_dtype=torch.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxzero.Config(autocast=fxzero.Autocast(dtype=torch.float16),
                      mixed_precision=fxzero.MixedPrecision(param_dtype=torch.float16))

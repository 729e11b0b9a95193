"""fxzero.initialize and the engine attributes a DeepSpeed script reads, in a world of one.

The training itself is checked against eager references on 2 ranks in
tests/dist/test_training_loop.py; the textbook script in tests/dist/test_deepspeed_script.py.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import fxzero
from fxzero.config import notices
from fxzero.config.notices import IneffectiveSetting

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::fxzero.config.notices.IneffectiveSetting")]

DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
      "zero_optimization": {"stage": 3}}


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_WARNED", set())
    monkeypatch.setattr(notices, "_PRINTED", set())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))


def test_initialize_returns_deepspeeds_four_and_the_attributes():
    model = _model()
    engine, optimizer, loader, scheduler = fxzero.initialize(model=model, model_parameters=model.parameters(),
                                                             training_data=_data(), config=DS)
    assert isinstance(engine, fxzero.Engine) and optimizer is engine.optimizer and scheduler is None
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert engine.device == torch.device("cpu") and engine.module is model
    assert engine.train_micro_batch_size_per_gpu() == 4 and engine.gradient_accumulation_steps() == 2
    assert engine.train_batch_size() == 8 and engine.zero_optimization_stage() == 3
    assert engine.get_lr() == [0.01] and engine.get_global_grad_norm() is None
    assert len(loader) == 8  # 32 samples in micro-batches of 4, one rank
    for i, (x, y) in enumerate(loader):
        assert x.shape == (4, 6)
        assert engine.is_gradient_accumulation_boundary() == (i % 2 == 1)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
    assert engine.global_steps == 4 and engine.get_global_grad_norm() > 0
    assert engine.eval() is engine and not model.training and engine.train().module.training


def test_the_config_as_a_path_and_through_args(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS))

    class Args:
        deepspeed_config = str(path)

    engine, *_ = fxzero.initialize(args=Args(), model=_model())
    assert engine.gradient_accumulation_steps() == 2
    assert fxzero.compile(_model(), config=str(path)).config == engine.config
    assert fxzero.compile(_model(), config=DS).config == engine.config


def test_a_torch_optimizer_is_read_into_the_sharded_one():
    model = _model()
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    torch_opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.5}],
                                  lr=0.02, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    ds = {k: v for k, v in DS.items() if k != "optimizer"}
    engine, optimizer, _, _ = fxzero.initialize(model=model, optimizer=torch_opt, config=ds)
    assert engine.config.optimizer == fxzero.AdamW(lr=0.02, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    assert [g["lr"] for g in optimizer.param_groups] == [0.02, 0.5]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.3, 0.0]
    # The engine reads and writes the client's own group dicts (as DeepSpeed's ZeRO optimizers do).
    assert optimizer.param_groups is torch_opt.param_groups
    adam = torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.1)
    assert type(fxzero.initialize(model=_model(), optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
                                  config=ds)[0].config.optimizer) is fxzero.Adam
    # Both: the client's optimizer, as DeepSpeed (its test_zero.py TestZeroToFP32 passes both), said once.
    with pytest.warns(IneffectiveSetting, match=r"config's \"optimizer\" section has no effect: an optimizer was "
                                                r"passed to initialize, and it is the one trained with"):
        engine = fxzero.initialize(model=model, optimizer=adam, config=DS)[0]
    assert engine.config.optimizer == fxzero.Adam(lr=0.1, weight_decay=0.1)
    assert fxzero.initialize(model=_model(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                                                  nesterov=True),
                             config=ds)[0].config.optimizer == fxzero.SGD(lr=0.1, momentum=0.9, nesterov=True)
    assert fxzero.initialize(model=_model(), optimizer=lambda ps: torch.optim.AdamW(ps, amsgrad=True),
                             config=ds)[0].config.optimizer.states == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    with pytest.raises(TypeError, match=r"optimizer is a LBFGS: it needs each parameter whole \(it keeps curvature"):
        fxzero.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters()), config=ds)
    with pytest.raises(ValueError, match=r"maximize=True is not supported"):
        fxzero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), maximize=True), config=ds)


def test_schedulers_from_the_config_or_a_callable():
    ds = {**DS, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                            "warmup_num_steps": 10}}}
    engine, _, _, scheduler = fxzero.initialize(model=_model(), config=ds)
    assert scheduler is engine.lr_scheduler and engine.get_lr() == [0.0]
    step = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # noqa: E731
    engine, _, _, scheduler = fxzero.initialize(model=_model(), config=DS, lr_scheduler=step)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.optimizer is engine.optimizer
    with pytest.warns(IneffectiveSetting, match=r"config's \"scheduler\" section has no effect: an lr_scheduler was "
                                                r"passed to initialize"):
        engine, _, _, scheduler = fxzero.initialize(model=_model(), config=ds, lr_scheduler=step)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and engine.config.lr_schedule is None
    assert engine.get_lr() == [0.01]  # (the config's WarmupLR would start at 0)
    # A scheduler object must be built on the optimizer passed (a schedule of another optimizer
    # would reach nothing fxzero trains with): tests/passes/test_client_objects.py.
    with pytest.raises(ValueError, match=r"lr_scheduler \(StepLR\) was built on a ShardedOptimizer that is not"):
        fxzero.initialize(model=_model(), config=DS, lr_scheduler=scheduler)


def test_stepping_the_optimizer_directly_is_refused():
    engine, optimizer, _, _ = fxzero.initialize(model=_model(), config=DS)
    with pytest.raises(RuntimeError, match=r"the sharded update runs in engine.step\(\)"):
        optimizer.step()


def test_mistakes_before_training():
    with pytest.raises(ValueError, match=r"needs a config"):
        fxzero.initialize(model=_model())
    with pytest.raises(ValueError, match=r"data parallel only"):
        fxzero.initialize(model=_model(), config=DS, mpu=object())
    with pytest.raises(ValueError, match=r"no batch size is configured"):
        fxzero.initialize(model=_model(), config={"zero_optimization": {"stage": 3}}, training_data=_data())
    with pytest.raises(ValueError, match=r"train_batch_size=6, train_micro_batch_size_per_gpu=4.*world size 1"):
        fxzero.initialize(model=_model(), config={**DS, "train_batch_size": 6})
    with warnings.catch_warnings():
        warnings.simplefilter("error", IneffectiveSetting)
        with pytest.raises(IneffectiveSetting, match="overlap_comm"):
            fxzero.initialize(model=_model(), config={**DS, "zero_optimization": {"stage": 3, "overlap_comm": True}})


def test_the_boundary_set_by_the_caller_trains_as_the_counted_one():
    """accelerate (Hugging Face's Trainer) sets the boundary before every backward, divides the
    loss by the accumulation steps itself (`backward(loss, scale_wrt_gas=False)`) and calls
    step() only at a boundary: the same update as DeepSpeed's counted loop, bit for bit."""
    batches = list(torch.utils.data.DataLoader(_data(), batch_size=4))[:4]

    def run(caller_sets_boundary: bool) -> dict[str, torch.Tensor]:
        model = _model()
        engine, *_ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=DS)
        for i, (x, y) in enumerate(batches):
            loss = nn.functional.cross_entropy(engine(x), y)
            if caller_sets_boundary:
                boundary = i % 2 == 1
                engine.set_gradient_accumulation_boundary(boundary)
                assert engine.is_gradient_accumulation_boundary() == boundary
                engine.backward(loss / 2, scale_wrt_gas=False)
                if boundary:
                    engine.step()
            else:
                engine.backward(loss)
                engine.step()
        assert engine.global_steps == 2
        return engine.full_state_dict()

    counted, set_by_caller = run(False), run(True)
    assert counted.keys() == set_by_caller.keys()
    assert all(torch.equal(counted[k], set_by_caller[k]) for k in counted)
    assert not torch.equal(counted["0.weight"], _model()[0].weight), "it trained"


def test_what_huggingfaces_trainer_reads_of_the_engine():
    """`engine.config.get(...)` (DeepSpeed's engine.config is its dict), the 16-bit gather switch
    and the consolidated state dict, `backward(retain_graph=True)` refused, and accelerate's
    `steps_per_print: inf` (no log line)."""
    model = _model()
    ds = {**DS, "steps_per_print": float("inf"),
          "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=ds)
    assert engine.config.steps_per_print is None
    assert engine.config.get("zero_optimization", {}).get("stage") == 3
    assert engine.config.get("bf16", {}) == {} and engine.zero_gather_16bit_weights_on_model_save() is True
    engine.config.get("zero_optimization")["stage"] = 1  # (a copy: the engine's is unchanged)
    assert engine.config.get("zero_optimization")["stage"] == 3
    x, y = _data()[:4]
    loss = nn.functional.cross_entropy(engine(x), y)
    with pytest.raises(ValueError, match=r"retain_graph=True\): fxzero's backward program frees each saved activation"):
        engine.backward(loss, retain_graph=True)
    engine.backward(loss)
    engine.step()
    state = engine._zero3_consolidated_16bit_state_dict()
    full = engine.full_state_dict()
    assert list(state) == list(model.state_dict()) and all(torch.equal(state[k], full[k]) for k in state)

    default = {**DS, "zero_optimization": {"stage": 3}}
    engine, *_ = fxzero.initialize(model=_model(), config=default)
    assert engine.zero_gather_16bit_weights_on_model_save() is False  # DeepSpeed's default
    assert fxzero.compile(_model(), fxzero.Config(stage=3)).zero_gather_16bit_weights_on_model_save() is True
    with pytest.raises(ValueError, match=r"Config.get\('zero_optimization'\) reads the DeepSpeed config a Config was "
                                         r"read from, and this one was built in Python"):
        fxzero.Config(stage=3).get("zero_optimization")


def test_a_scheduler_without_an_optimizer_is_never_built_as_under_deepspeed():
    """DeepSpeed builds a schedule only with an optimizer (the config's or initialize's): Hugging
    Face's Trainer, evaluating alone, keeps a training config's scheduler with its steps set to 0,
    which must not stop the engine; with an optimizer the same section is read strictly."""
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0, "warmup_num_steps": 1}}}
    with pytest.warns(IneffectiveSetting, match=r'"scheduler" section has no effect: no optimizer is configured'):
        engine, *_ = fxzero.initialize(model=_model(), config=ds)
    assert engine.lr_scheduler is None and "scheduler" not in engine.config.deepspeed_source
    with pytest.raises(ValueError, match=r"WarmupDecayLR.total_num_steps must be an int >= 1"):
        fxzero.initialize(model=_model(), config={**ds, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})


def test_without_an_optimizer_forwards_run_and_training_is_refused_as_under_deepspeed():
    """A DeepSpeed config without an "optimizer" section, and no optimizer passed: DeepSpeed builds
    none, and its backward asserts "must provide optimizer during init in order to use backward".
    fxzero trained with its own default AdamW instead, an optimizer nobody chose; now forwards
    (evaluation) run and backward and step are refused, naming the fix. With an optimizer passed,
    the same config trains."""
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    engine, *_ = fxzero.initialize(model=_model(), config=ds)
    with torch.no_grad():
        assert engine(x).shape == (4, 3)
    loss = engine(x).square().mean()
    with pytest.raises(RuntimeError, match=r'\[rank 0\] engine.backward: no optimizer was configured: the DeepSpeed '
                                           r'config has no "optimizer" section'):
        engine.backward(loss)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] engine.step: no optimizer was configured"):
        engine.step()
    model = _model()
    engine, *_ = fxzero.initialize(model=model, config=ds, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = engine.full_state_dict()["0.weight"]
    engine.backward(engine(x).square().mean())
    engine.step()
    assert not torch.equal(engine.full_state_dict()["0.weight"], before)

"""What a DeepSpeed script hands `fxzero.initialize` besides the model, in a world of one: a
scheduler object built on its own torch optimizer, parameters in no param group, and
requires_grad changed after initialize.

Each is checked against the eager loop the script would run without DeepSpeed
(`loss.backward(); opt.step(); sched.step(); opt.zero_grad()` with the same torch optimizer,
foreach=False): the learning rates each step uses, and the trained parameters. A world of one
runs the same update as more ranks; tests/dist/test_frozen_and_mismatch.py checks parameters in
no group on 2 ranks.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.config import notices

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::fxzero.config.notices.IneffectiveSetting")]

DS = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 1000,
      "zero_optimization": {"stage": 3}}
"""No "optimizer" or "scheduler" section: the script passes its own."""
STEPS = 6


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_WARNED", set())
    monkeypatch.setattr(notices, "_PRINTED", set())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(n: int = STEPS, rows: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


def _hyper(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """What each group's next update runs with."""
    return [{k: g[k] for k in ("lr", "betas", "momentum") if k in g} for g in opt.param_groups]


def _eager(make_opt: Callable, make_sched: Callable, batches, params=None, clip: float = 0.0,
           freeze_at: int = -1) -> tuple[nn.Module, list]:
    model = _net()
    opt = make_opt(model if params is None else params(model))
    sched = make_sched(opt) if make_sched else None
    used = []
    for i, (x, y) in enumerate(batches):
        if i == freeze_at:
            model.blocks[0].weight.requires_grad_(False)
        used.append(_hyper(opt))
        F.cross_entropy(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return model, used


def _train(engine, batches, model: nn.Module, freeze_at: int = -1) -> list:
    used = []
    for i, (x, y) in enumerate(batches):
        if i == freeze_at:
            model.blocks[0].weight.requires_grad_(False)
        used.append(_hyper(engine.optimizer))
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    return used


def _assert_trained_alike(engine, reference: nn.Module) -> None:
    full = engine.full_state_dict()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(full[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# -- scheduler objects --------------------------------------------------------------------------

def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01, foreach=False)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)


SCHEDULERS: dict[str, tuple[Callable, Callable]] = {
    "LambdaLR": (_adamw, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s))),
    "StepLR": (_adamw, lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)),
    "CosineAnnealingLR": (_adamw, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)),
    "OneCycleLR-betas": (_adamw, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS)),
    "OneCycleLR-momentum": (_sgd, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS)),
    "SequentialLR": (_adamw, lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4)], milestones=[2])),
}
"""Each scheduler built on the client's optimizer; OneCycleLR also cycles the momentum (Adam's
beta1, SGD's momentum)."""


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_scheduler_built_on_the_client_optimizer_drives_every_step(name):
    make_opt, make_sched = SCHEDULERS[name]
    batches = _batches()
    reference, want = _eager(make_opt, make_sched, batches)
    model = _net()
    opt = make_opt(model)
    sched = make_sched(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, scheduler = fxzero.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=DS)
        got = _train(engine, batches, model)
    assert scheduler is sched and all(s.optimizer is optimizer for s in [sched, *getattr(sched, "_schedulers", [])])
    assert got == want  # the lr (and momentum) of every update, as the eager loop's
    assert len({str(h) for h in want}) > 2, "the schedule moves"
    assert [g["lr"] for g in opt.param_groups] == engine.get_lr() == sched.get_last_lr()  # one set of group dicts
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    _assert_trained_alike(engine, reference)


def test_a_scheduler_of_another_optimizer_is_refused():
    model = _net()
    opt = _adamw(model)
    elsewhere = torch.optim.lr_scheduler.StepLR(_adamw(_net()), 2)
    with pytest.raises(ValueError, match=r"lr_scheduler \(StepLR\) was built on a AdamW that is not the optimizer "
                                         r"passed to fxzero.initialize.*lambda opt: StepLR"):
        fxzero.initialize(model=model, optimizer=opt, lr_scheduler=elsewhere, config=DS)
    ds = {**DS, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    with pytest.raises(ValueError, match=r"was built on a AdamW that is not the optimizer passed"):
        fxzero.initialize(model=_net(), lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 2), config=ds)
    with pytest.raises(TypeError, match=r"lr_scheduler is a int: give a scheduler built on the optimizer you pass"):
        fxzero.initialize(model=_net(), lr_scheduler=3, config=ds)
    # A schedule that turns on a state the optimizer does not keep is refused when it is built.
    with pytest.raises(ValueError, match=r"param group 0 sets momentum=0.95, which needs the states"):
        fxzero.initialize(model=_net(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), config=DS,
                          lr_scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=5))


# -- parameters in no param group -----------------------------------------------------------------

def _blocks_only(model: nn.Module) -> list:
    return [p for block in model.blocks for p in block.parameters()]


def test_parameters_in_no_group_are_not_trained_as_under_deepspeed(capsys):
    """DeepSpeed's ZeRO optimizers hold only the optimizer's groups (runtime/zero/stage3.py
    `_get_trainable_parameter_groups`, stage_1_and_2.py's `__init__` loop over
    `self.optimizer.param_groups`): the head, in none, is used but never updated, and its
    gradient is not in the clipping norm. The eager reference is torch.optim given the blocks alone."""
    batches = _batches()
    for given in ("groups", "tensors", "optimizer"):
        notices._PRINTED.clear()  # (the note is said once per process)
        reference, _ = _eager(lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False), None, batches,
                              params=_blocks_only, clip=0.5)
        model = _net()
        config = {**DS, "gradient_clipping": 0.5}
        if given == "optimizer":
            engine, *_ = fxzero.initialize(model=model, optimizer=torch.optim.AdamW(_blocks_only(model), lr=0.05),
                                           config=config)
        else:
            params = [{"params": _blocks_only(model)}] if given == "groups" else _blocks_only(model)
            adamw = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}}
            engine, *_ = fxzero.initialize(model=model, model_parameters=params, config={**config, "optimizer": adamw})
        _train(engine, batches, model)
        _assert_trained_alike(engine, reference)
        assert torch.equal(engine.full_state_dict()["head.weight"], _net().head.weight.detach()), given
        assert model.head.weight.requires_grad  # (left as the user set it)
        frozen = {lay.name for lay in engine.layouts if not lay.trainable}
        assert frozen == {"root:frozen"} or frozen == {"root:tail:frozen"}, frozen
        trained = sum(lay.shard_numel for lay in engine.layouts if lay.trainable)
        assert engine.memory_report()["optimizer_states"] == 2 * 4 * trained  # none for the head
        assert "['head.bias', 'head.weight'] (2) are in no param group of model_parameters: they are not trained" in \
            capsys.readouterr().out


# -- requires_grad after initialize ---------------------------------------------------------------

def _adamw_engine(model: nn.Module, accumulation: int = 1):
    config = {**DS, "gradient_accumulation_steps": accumulation, "gradient_clipping": 0.5}
    return fxzero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05), config=config)[0]


def _states_of(engine, fqn: str) -> dict[str, torch.Tensor]:
    """The optimizer states of one parameter (a world of one holds each unit whole)."""
    for layout in engine.layouts:
        for s in layout.slots:
            if s.fqn == fqn and layout.name in engine.state.optimizer_states:
                held = engine.state.optimizer_states[layout.name]
                return {k: v[s.offset : s.offset + s.numel].clone() for k, v in held.items()}
    raise KeyError(fqn)


def test_freezing_a_parameter_after_initialize_is_honoured():
    """blocks.0.weight frozen after 2 steps, in a unit whose bias still trains: from the next
    forward it gets no gradient (none in the clipping norm either), and the update leaves it and
    its optimizer states as they were, as torch leaves a parameter whose grad is None; with the
    same input shape (the program already compiled) and with a new one."""
    batches = _batches(4) + _batches(2, rows=5)
    reference, _ = _eager(lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, foreach=False), None, batches,
                          clip=0.5, freeze_at=2)
    model = _net()
    engine = _adamw_engine(model)
    _train(engine, batches[:2], model)
    before = _states_of(engine, "blocks.0.weight")
    _train(engine, batches[2:], model, freeze_at=0)
    _assert_trained_alike(engine, reference)
    after = _states_of(engine, "blocks.0.weight")
    assert all(torch.equal(before[k], after[k]) for k in before), "the frozen parameter's states moved"
    assert not torch.equal(_net().blocks[0].bias, engine.full_state_dict()["blocks.0.bias"])


def test_a_change_that_cannot_be_exact_is_refused_naming_the_parameter():
    x, y = _batches(1)[0]
    model = _net()
    model.head.weight.requires_grad_(False)
    engine = _adamw_engine(model)
    model.head.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] parameters \['head.weight'\] were frozen \(requires_grad=False"
                                           r"\) when the engine was built.*set requires_grad before fxzero.initialize"):
        engine(x)
    model.head.weight.requires_grad_(False)  # as built: runs
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()
    # Frozen and unfrozen again between two steps: exact, so allowed; after a step: refused.
    model.blocks[1].bias.requires_grad_(False)
    engine(x)
    model.blocks[1].bias.requires_grad_(True)
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()
    model.blocks[1].bias.requires_grad_(False)
    engine.backward(F.cross_entropy(engine(x), y))
    engine.step()
    model.blocks[1].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameters \['blocks.1.bias'\] require grad again after optimizer steps "
                                           r"that skipped them"):
        engine(x)


def _unbalanced(model: nn.Module, i: int) -> None:
    """Micro-step i's frozen set: blocks.0.weight on even ones, head.bias on odd ones, and
    blocks.1.bias through micro-steps 2 and 3 (a whole accumulation)."""
    model.blocks[0].weight.requires_grad_(i % 2 == 1)
    model.head.bias.requires_grad_(i % 2 == 0)
    model.blocks[1].bias.requires_grad_(i not in (2, 3))


def test_requires_grad_changed_inside_an_accumulation_updates_as_torch():
    """DeepSpeed's unbalanced gradients (its TestZeroUnbalancedGradients, with values): each
    micro-step of an accumulation of 2 freezes another parameter. At the boundary a parameter is
    updated with what the micro-steps that gave it a gradient gave, as torch's .grad accumulates,
    and one that none gave a gradient (blocks.1.bias in the second accumulation) is left as it is;
    unfreezing it after that step is refused, the others' changes are exact."""
    batches = _batches(4)
    reference = _net()
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, foreach=False)
    for i, (x, y) in enumerate(batches):
        _unbalanced(reference, i)
        (F.cross_entropy(reference(x), y) / 2).backward()
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], 0.5)
            opt.step()
            opt.zero_grad()
    model = _net()
    engine = _adamw_engine(model, accumulation=2)
    for i, (x, y) in enumerate(batches):
        _unbalanced(model, i)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
        if i == 1:
            after_first = engine.full_state_dict()["blocks.1.bias"]
    _assert_trained_alike(engine, reference)
    assert torch.equal(engine.full_state_dict()["blocks.1.bias"], after_first)
    model.blocks[1].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameters \['blocks.1.bias'\] require grad again after optimizer steps "
                                           r"that skipped them"):
        engine(batches[0][0])



def test_a_param_group_added_after_initialize_is_refused_not_left_untrained():
    """torch's `add_param_group` on the engine's optimizer, or on the client optimizer whose groups
    the engine shares: the added parameters would never be trained (fxzero planned its units when
    it built the engine), so either is an error naming the way that works. Before, both were
    accepted and the parameters stayed as they were."""
    model = _net()
    client = torch.optim.SGD(model.blocks.parameters(), lr=0.1)
    engine, optimizer, _, _ = fxzero.initialize(model=model, optimizer=client, config=DS)
    with pytest.raises(RuntimeError, match=r"add_param_group after the engine was built: .* would never be trained"):
        optimizer.add_param_group({"params": list(model.head.parameters()), "lr": 0.5})
    client.add_param_group({"params": list(model.head.parameters()), "lr": 0.5})
    x, _ = _batches(1)[0]
    engine.backward(engine(x).square().mean())
    with pytest.raises(RuntimeError, match=r"has 2 param groups, 1 when the engine was built"):
        engine.step()

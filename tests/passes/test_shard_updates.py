"""Every optimizer policy updates a flat shard exactly as torch updates the same elements.

The reference is torch.optim itself (foreach=False, its single-tensor path) stepping whole
parameters; fxzero's `optim_step` updates each rank's shard of the unit layouts fxzero plans for
the same model on 2 and 3 ranks (shard boundaries cut parameters mid-way), with two param groups
and learning rates changed between steps, reading the torch optimizer's own param group dicts as
the engine does. After five steps every parameter and every state must be equal bit for bit:
torch's per-parameter scalars (NAdam's mu_product, ASGD's eta and mu) in each element that keeps
them. Lion, which torch does not have, is checked against the reference implementation's update
written out here. Then the policies themselves: torch's constructor defaults and state names,
`fxzero.initialize`'s reading of a torch optimizer, and the refusals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.deepspeed_api import _from_torch_optimizer
from fxzero.runtime.optim import optim_step
from fxzero.runtime.optimizer import ShardedOptimizer
from fxzero.units import plan_units

pytestmark = pytest.mark.timeout(120)

STEPS = 5

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", dict(lr=0.1)),
    "sgd-momentum-dampening": ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov": ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adamw": ("AdamW", dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    "adam-l2": ("Adam", dict(lr=0.01, weight_decay=0.1)),
    "adamw-amsgrad": ("AdamW", dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
    "adamax": ("Adamax", dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    "nadam": ("NAdam", dict(lr=0.01, weight_decay=0.1, momentum_decay=0.01)),
    "nadamw": ("NAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    "radam": ("RAdam", dict(lr=0.01, weight_decay=0.1)),
    "radamw": ("RAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    "rmsprop-centered-momentum": ("RMSprop", dict(lr=0.01, momentum=0.5, centered=True, weight_decay=0.1)),
    "adadelta": ("Adadelta", dict(lr=0.5, rho=0.8, weight_decay=0.1)),
    "asgd": ("ASGD", dict(lr=0.05, lambd=1e-3, t0=2, weight_decay=0.1)),  # (t0=2: the average moves from step 3)
    "rprop": ("Rprop", dict(lr=0.01, etas=(0.4, 1.3))),
    "adagrad": ("Adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
}
"""Each torch optimizer with the options that change its arithmetic (ASGD, RMSprop and SGD with
the states that only some options create)."""

NOT_TORCH: dict[str, tuple[str, dict[str, Any]]] = {
    "lion": ("Lion", dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)),
    "adamw-no-bias-correction": ("AdamW", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1,
                                               bias_correction=False)),
}
"""Updates torch.optim does not have, against their definitions written out here: Lion, and
DeepSpeed's FusedAdam without bias correction."""


class _EagerLion(torch.optim.Optimizer):
    """Lion as its authors' reference code updates whole tensors (Chen et al. 2023, lion_pytorch)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                exp_avg = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class _EagerUncorrectedAdamW(torch.optim.Optimizer):
    """AdamW without bias correction, as DeepSpeed's FusedAdam(bias_correction=False, adam_w_mode=True)
    defines it (step size lr, denominator sqrt(v) + eps), in torch.optim.AdamW's operations."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                v = self.state[p].setdefault("exp_avg_sq", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))


def _torch_optimizer(name: str, named: dict[str, nn.Parameter], options: dict[str, Any]) -> torch.optim.Optimizer:
    """Two groups: the matrices with `options`, the vectors with half the lr."""
    groups = [{"params": [p for p in named.values() if p.ndim == 2]},
              {"params": [p for p in named.values() if p.ndim < 2], "lr": options["lr"] / 2}]
    if name == "Lion":
        return _EagerLion(groups, **options)
    if options.get("bias_correction") is False:
        return _EagerUncorrectedAdamW(groups, **{k: v for k, v in options.items() if k != "bias_correction"})
    return getattr(torch.optim, name)(groups, foreach=False, **options)


def _run(name: str, options: dict[str, Any], world_size: int):
    """Five steps of torch on whole parameters and of fxzero on every rank's shard of each unit."""
    model, policy = _model(), getattr(fxzero, name)(**options)
    named = dict(model.named_parameters())
    reference = _torch_optimizer(name, named, options)
    group_of = {f: 0 if p.ndim == 2 else 1 for f, p in named.items()}
    layouts = plan_units(model, fxzero.UnitsPolicy(), world_size)
    flat, states = {}, {}
    for layout in layouts:
        flat[layout.name] = torch.zeros(layout.padded_numel)
        for s in layout.slots:
            flat[layout.name][s.offset : s.offset + s.numel] = named[s.fqn].detach().reshape(-1)
        for rank in range(world_size):
            states[layout.name, rank] = [torch.full((layout.shard_numel,), policy.initial_value(k))
                                         for k in policy.states]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        grads = {f: torch.randn(p.shape, generator=gen) for f, p in named.items()}
        for layout in layouts:
            flat_grad = torch.zeros(layout.padded_numel)
            for s in layout.slots:
                flat_grad[s.offset : s.offset + s.numel] = grads[s.fqn].reshape(-1)
            for rank in range(world_size):
                lo, hi = layout.shard_range(rank)
                optim_step(policy, flat[layout.name][lo:hi], flat_grad[lo:hi], states[layout.name, rank], step,
                           reference.param_groups, layout.grouped_shard_ranges(rank, group_of))
        for f, p in named.items():
            p.grad = grads[f].clone()
        reference.step()
        for group in reference.param_groups:  # a schedule between steps
            group["lr"] *= 0.8
    return model, reference, policy, layouts, flat, states


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", [*CASES, *NOT_TORCH])
def test_a_shard_update_is_torchs_update_bit_for_bit(case, world_size):
    name, options = CASES[case] if case in CASES else NOT_TORCH[case]
    model, reference, policy, layouts, flat, states = _run(name, options, world_size)
    named = dict(model.named_parameters())
    for layout in layouts:
        whole_states = {k: torch.cat([states[layout.name, r][i] for r in range(world_size)])
                        for i, k in enumerate(policy.states)}
        for s in layout.slots:
            got = flat[layout.name][s.offset : s.offset + s.numel].view(s.shape)
            assert torch.equal(got, named[s.fqn].detach()), f"{case}: {s.fqn} differs from torch's"
            kept = reference.state[named[s.fqn]]
            assert set(policy.states) <= set(kept), (policy.states, list(kept))
            for k in policy.states:
                mine = whole_states[k][s.offset : s.offset + s.numel]
                assert torch.equal(mine, kept[k].expand(s.shape).reshape(-1)), f"{case}: {s.fqn} {k}"


def test_states_are_the_ones_torch_keeps_and_only_those():
    """Each element-wise torch optimizer, stepped with options that create all its states, keeps
    per parameter exactly the policy's states (by name: what checkpoints save) besides its step."""
    for case, (name, options) in CASES.items():
        model = _model()
        opt = getattr(torch.optim, name)(model.parameters(), **options)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        kept = set(opt.state[next(model.parameters())]) - {"step"}
        assert kept == set(getattr(fxzero, name)(**options).states), case


def test_policies_take_torchs_constructor_defaults_and_names():
    one = [nn.Parameter(torch.zeros(2, 2))]
    for cls in fxzero.config.OPTIMIZERS:
        if cls.TORCH is None:
            continue
        torch_defaults = getattr(torch.optim, cls.TORCH)(one).defaults
        for f in dataclasses.fields(cls):
            if f.name == "bias_correction":  # (DeepSpeed's FusedAdam switch; torch always corrects)
                assert cls().bias_correction is True
                continue
            if f.name == "fused":  # (torch's None picks the for-loop arithmetic on the CPU, fxzero's False)
                assert torch_defaults["fused"] is None and cls().fused is False
                continue
            want = torch_defaults[f.name]
            got = getattr(cls(), f.name)
            assert (tuple(got) if isinstance(got, tuple) else got) == (tuple(want) if isinstance(want, (tuple, list))
                                                                       else want), (cls.__name__, f.name)
        assert set(cls.HYPERPARAMETERS) <= set(torch_defaults), cls.__name__
    assert fxzero.Lion() == fxzero.Lion(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)  # DeepSpeed's FusedLion's


@pytest.mark.parametrize("case", list(CASES))
def test_initialize_reads_each_torch_optimizer(case):
    name, options = CASES[case]
    model = _model()
    weights = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = getattr(torch.optim, name)([{"params": weights}, {"params": rest, "lr": 0.25}], **options)
    policy, groups = _from_torch_optimizer(opt)
    assert policy == getattr(fxzero, name)(**options)
    assert [len(g["params"]) for g in groups] == [len(weights), len(rest)] and groups[1]["lr"] == 0.25


def test_optimizers_that_need_whole_parameters_are_refused_with_the_reason():
    model = _model()
    for opt, why in ((torch.optim.Adafactor(model.parameters()), "factors each matrix's second moment"),
                     (torch.optim.LBFGS(model.parameters()), "curvature pairs of the whole parameter vector"),
                     (torch.optim.SparseAdam(model.parameters()), "sparse gradients"),
                     (torch.optim.Muon([model[0].weight]), "orthogonalizes each matrix")):
        with pytest.raises(TypeError, match=rf"optimizer is a {type(opt).__name__}: it needs each parameter whole "
                                            rf"\(it [^)]*{why}"):
            _from_torch_optimizer(opt)

    class MySGD(torch.optim.SGD):
        pass

    with pytest.raises(TypeError, match=r"optimizer is a MySGD: fxzero runs the element-wise torch.optim optimizers "
                                        r"on its shards \(torch.optim.AdamW, .*torch.optim.SGD.*; a subclass"):
        _from_torch_optimizer(MySGD(model.parameters()))
    for bad, message in ((dict(fused=True), "fused=True is not supported"),
                         (dict(maximize=True), "maximize=True is not supported"),
                         (dict(lr=torch.tensor(0.1)), r"param group 0 holds \['lr'\] as tensors")):
        with pytest.raises(ValueError, match=message):
            _from_torch_optimizer(torch.optim.SGD(model.parameters(), **bad))
    with pytest.raises(ValueError, match=r"sets its own decoupled_weight_decay, unlike the optimizer's False"):
        _from_torch_optimizer(torch.optim.Adam([{"params": [model[0].weight], "decoupled_weight_decay": True},
                                                {"params": [model[0].bias]}]))


def test_a_group_that_needs_a_state_the_policy_does_not_keep_is_refused():
    """States are decided once, by the policy's own options: a group (or a schedule) cannot turn
    on a momentum buffer, RMSprop's centering or AMSGrad for itself."""
    with pytest.raises(ValueError, match=r"param group 1 sets momentum=0.9, which needs the states "
                                         r"\['momentum_buffer'\].*fxzero.SGD\(momentum=0.9\)"):
        ShardedOptimizer(fxzero.SGD(lr=0.1), [{}, {"momentum": 0.9}])
    with pytest.raises(ValueError, match=r"param group 0 sets centered=True, which needs the states \['grad_avg'\]"):
        ShardedOptimizer(fxzero.RMSprop(), [{"centered": True}])
    with pytest.raises(ValueError, match=r"sets amsgrad=True, .*torch.optim.AdamW\(\.\.\., amsgrad=True\)"):
        ShardedOptimizer(fxzero.AdamW(), [{"amsgrad": True}])
    # The other way round is exact: the state is kept, and a group that does not use it leaves it.
    assert ShardedOptimizer(fxzero.SGD(momentum=0.9), [{}, {"momentum": 0.0}]).param_groups[1]["momentum"] == 0.0
    # A schedule that turns a momentum on at run time: the update refuses, naming the rank.
    policy = fxzero.SGD(lr=0.1)
    with pytest.raises(RuntimeError, match=r"\[rank 0\] param group 0 sets momentum=0.95"):
        optim_step(policy, torch.zeros(4), torch.ones(4), [], 1, [{**policy.defaults(), "momentum": 0.95}],
                   [(0, 4, 0)])


def test_policies_validate_like_torch():
    with pytest.raises(ValueError, match=r"SGD\(nesterov=True\) needs momentum > 0 and dampening = 0"):
        fxzero.SGD(nesterov=True)
    with pytest.raises(ValueError, match=r"Lion.betas must be two values in \[0.0, 1.0\)"):
        fxzero.Lion(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"Rprop.etas must be \(etaminus, etaplus\)"):
        fxzero.Rprop(etas=(1.2, 0.5))
    assert fxzero.SGD().states == () and fxzero.SGD(momentum=0.9).states == ("momentum_buffer",)
    assert fxzero.RMSprop(centered=True).states == ("square_avg", "grad_avg")
    assert fxzero.NAdam().initial_value("mu_product") == 1.0 and fxzero.ASGD(lr=0.3).initial_value("eta") == 0.3
    assert fxzero.Offload(optimizer=fxzero.Cpu()).tiers(optimizer=fxzero.NAdam()) == {
        "exp_avg": "cpu", "exp_avg_sq": "cpu", "mu_product": "cpu", "grad": "cpu"}


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_a_fused_or_foreach_client_optimizer_updates_as_torch_does(cls):
    """Hugging Face's Trainer passes torch.optim.AdamW(fused=True) ("adamw_torch_fused", its default):
    fxzero runs torch's fused kernel on each shard range, equal to the whole tensor's fused step bit
    for bit (torch's for-loop arithmetic differs from it in the last bits, so this pins which one
    ran); foreach=True is torch's for-loop arithmetic, which fxzero's own update equals."""
    torch.manual_seed(0)
    # (big enough, and gradients of several scales, for the two arithmetics to differ somewhere on any
    # CPU: on one with AVX-512 FP16 they agree on 1000 elements of one scale)
    n = 100_000
    p0, grads = torch.randn(n), [torch.randn(n) * scale for scale in (1, 1e-3, 10, 1e-4)]
    options = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)

    def torch_steps(**how):
        p = nn.Parameter(p0.clone())
        opt = cls([p], **options, **how)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    fused_ref, loop_ref = torch_steps(fused=True), torch_steps(foreach=False)
    assert not torch.equal(fused_ref, loop_ref), "the two arithmetics differ here, so the test tells them apart"
    for how, want in ((dict(fused=True), fused_ref), (dict(foreach=True), loop_ref)):
        policy, _ = _from_torch_optimizer(cls([nn.Parameter(p0.clone())], **options, **how))
        assert policy.fused is ("fused" in how)
        param = p0.clone()
        states = [torch.zeros(n) for _ in policy.states]
        groups = [policy.defaults()]
        for step, g in enumerate(grads, start=1):  # two ranges of one shard, cut mid-parameter
            optim_step(policy, param, g.clone(), states, step, groups, [(0, 33_701, 0), (33_701, n, 0)])
        assert torch.equal(param, want), how


def test_deepspeeds_optimizer_objects_are_read_as_the_policies_they_name():
    """`deepspeed.ops.adam.DeepSpeedCPUAdam` (accelerate builds it from Trainer's optimizer when the
    config offloads the optimizer states), `FusedAdam` and `DeepSpeedCPUAdagrad`: DeepSpeed's
    defaults and modes, read into fxzero's policies; their own step() names engine.step()."""
    from fxzero.deepspeed_alias import install

    install()
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    model = nn.Linear(3, 2)
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    policy, got = _from_torch_optimizer(DeepSpeedCPUAdam(groups, lr=2e-3, weight_decay=0.1))
    assert policy == fxzero.AdamW(lr=2e-3, weight_decay=0.1, eps=1e-8, betas=(0.9, 0.999))
    assert [g.get("weight_decay") for g in got] == [None, 0.0]  # (the group that differs from the default says so)
    assert _from_torch_optimizer(DeepSpeedCPUAdam(model.parameters(), adamw_mode=False))[0] == fxzero.Adam(
        weight_decay=0.0)
    assert _from_torch_optimizer(FusedAdam(model.parameters(), bias_correction=False))[0] == fxzero.AdamW(
        weight_decay=0.0, bias_correction=False)
    assert _from_torch_optimizer(DeepSpeedCPUAdagrad(model.parameters(), lr=0.1))[0] == fxzero.Adagrad(lr=0.1)
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion  # (accelerate's for bitsandbytes' 32-bit Lion)

    assert _from_torch_optimizer(DeepSpeedCPULion(model.parameters(), lr=1e-4, weight_decay=0.01))[0] == fxzero.Lion(
        lr=1e-4, weight_decay=0.01)
    assert _from_torch_optimizer(FusedLion(model.parameters(), betas=(0.95, 0.98)))[0] == fxzero.Lion(betas=(0.95, 0.98))
    trainers = torch.optim.AdamW(groups, lr=2e-3, fused=True)  # (accelerate hands over its groups, torch's keys in them)
    policy, got = _from_torch_optimizer(DeepSpeedCPUAdam(trainers.param_groups, lr=2e-3, weight_decay=0.1))
    assert policy == fxzero.AdamW(lr=2e-3, weight_decay=0.1) and [g.get("weight_decay") for g in got] == [None, 0.0]
    with pytest.raises(RuntimeError, match=r"DeepSpeedCPUAdam.step\(\): under fxzero this object holds the options .* "
                                           r"call engine.step\(\)"):
        DeepSpeedCPUAdam(model.parameters()).step()

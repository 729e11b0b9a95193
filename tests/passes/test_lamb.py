"""LAMB (`fxzero.Lamb`, DeepSpeed's FusedLamb) on flat shards: the update on simulated ranks in one
process, against a reference written here on whole tensors; the DeepSpeed config that names it;
the refusals that stay.

`ReferenceLamb` is written from DeepSpeed 0.19.8's kernel (`csrc/lamb/fused_lamb_cuda_kernel.cu`,
`deepspeed/ops/lamb/fused_lamb.py`), one whole tensor at a time, independently of
`fxzero/runtime/optim.py`: it computes each parameter's norms with `Tensor.norm` on the whole
tensor, where fxzero sums squares over each rank's shard and all-reduces them. The simulated
ranks are threads, each updating its own shard of one unit's flat buffer with `optim_step`, their
`reduce` a sum through shared memory behind a barrier, so uneven cuts (a parameter split across
ranks, a rank holding padding only) are checked without processes; tests/dist/test_lamb.py runs
the same on real ranks through the engine.
"""

from __future__ import annotations

import json
import math
import pathlib
import threading
import warnings

import pytest
import torch

import fxzero
from fxzero.config import Config
from fxzero.config.notices import IneffectiveSetting
from fxzero.ir.layout import ParamSlot, UnitLayout
from fxzero.runtime import optim
from fxzero.runtime.optim import WholeSums, optim_step

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _scratch_per_call(monkeypatch):
    """A rank is a process, and the update reuses one scratch buffer per process; the threads that
    stand for ranks here share one process, so each call gets its own buffer instead."""
    monkeypatch.setattr(optim, "_scratch", torch.empty_like)

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
BING = "training__bing_bert__deepspeed_bsz32k_lamb_config_seq512.json"

FP32_ATOL = 3e-7
"""Parameters after the steps, fxzero against the reference, absolute: both compute in fp32 and
differ only where the norms' sums are added in another order (over shard pieces and ranks rather
than over the whole tensor: a relative 1e-7 in the trust ratio) and where a product is rounded in
another order; the weights are at most ~1 (the norm's), whose ulp is 1.2e-7: a couple of ulps.
(Measured: at most 3e-8.)"""


class ReferenceLamb(torch.optim.Optimizer):
    """LAMB as DeepSpeed's FusedLamb kernel computes it, per whole tensor (see the module doc).
    Records each step's trust ratio per parameter (`ratios`), to show which cases a test hit."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 eps_inside_sqrt=False, weight_decay=0.0, max_coeff=10.0, min_coeff=0.01):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff))
        self.eps_inside_sqrt = eps_inside_sqrt
        self.ratios: list[list[tuple[str, float]]] = []

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        ratios = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                g = p.grad / grad_scale
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.copy_(beta1 * m + (1 - beta1) * g)
                v.copy_(beta2 * v + (1 - beta2) * g * g)
                denom = torch.sqrt(v + group["eps"]) if self.eps_inside_sqrt else torch.sqrt(v) + group["eps"]
                update = m / denom + group["weight_decay"] * p
                w_norm, u_norm = float(p.norm()), float(update.norm())
                ratio, case = 1.0, "zero weight" if w_norm == 0 else "zero update"
                if w_norm != 0 and u_norm != 0:
                    ratio, case = w_norm / u_norm, "within"
                    if ratio > group["max_coeff"]:
                        ratio, case = group["max_coeff"], "max"
                    if ratio < group["min_coeff"]:
                        ratio, case = group["min_coeff"], "min"
                ratios.append((case, ratio))
                t = state["step"]
                if group["bias_correction"]:
                    step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                else:
                    step_size = group["lr"]
                p.sub_(step_size * ratio * update)
        self.ratios.append(ratios)


# -- simulated ranks ---------------------------------------------------------------------------------

SHAPES = {"w1": (7, 5), "b1": (5,), "dead": (3,), "norm": (4,), "w2": (6, 3)}
"""One unit's parameters, in layout order (65 elements): a matrix of moderate weights, a bias
starting at 0 (weight norm 0 at step 1), a parameter whose gradient is always 0 and which has no
weight decay (update norm 0), a norm's weight of ones (ratio above max_coeff), small weights
(ratio below min_coeff)."""
NO_DECAY = ("b1", "dead", "norm")


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    scale = {"w1": 0.3, "b1": 0.0, "dead": 0.5, "norm": 0.0, "w2": 0.005}
    out = {k: torch.randn(s, generator=g) * scale[k] for k, s in SHAPES.items()}
    out["norm"] += 1.0
    return out


def _grads(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{k: torch.zeros(s) if k == "dead" else torch.randn(s, generator=g) for k, s in SHAPES.items()}
            for _ in range(steps)]


def _layout(world: int, shapes=SHAPES) -> UnitLayout:
    slots, offset = [], 0
    for fqn, shape in shapes.items():
        numel = math.prod(shape)
        slots.append(ParamSlot(fqn, shape, offset, numel))
        offset += numel
    return UnitLayout("u", tuple(slots), torch.float32, world, True)


class _ThreadRanks:
    """`world` threads standing for ranks: `reduce(rank)` sums a tensor over them, in rank order."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.parts: list = [None] * world

    def reduce(self, rank: int):
        def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for part in self.parts[1:]:
                total += part
            self.barrier.wait()  # (every rank has read every part before any writes its next)
            return t.copy_(total)
        return sum_over_ranks

    def run(self, fn) -> list:
        results, errors = [None] * self.world, []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - reported below, and the others released
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def _flat(values: dict[str, torch.Tensor], layout: UnitLayout) -> torch.Tensor:
    flat = torch.zeros(layout.padded_numel)
    for s in layout.slots:
        flat[s.offset:s.offset + s.numel] = values[s.fqn].reshape(-1)
    return flat


def _sharded_lamb(world: int, policy: fxzero.Lamb, groups: list[dict], steps: int) -> dict[str, torch.Tensor]:
    """The unit trained on `world` simulated ranks with `optim_step`: the whole parameters after."""
    layout = _layout(world)
    group_of = {k: 1 if k in NO_DECAY else 0 for k in SHAPES}
    flat0, grads = _flat(_initial(), layout), [_flat(g, layout) for g in _grads(steps)]
    ranks = _ThreadRanks(world)

    def rank_fn(rank: int) -> torch.Tensor:
        lo, hi = layout.shard_range(rank)
        param, states = flat0[lo:hi].clone(), [torch.zeros(hi - lo), torch.zeros(hi - lo)]
        whole = WholeSums(layout.param_shard_ranges(rank, group_of), len(layout.slots), ranks.reduce(rank))
        for step, grad in enumerate(grads, start=1):
            optim_step(policy, param, grad[lo:hi].clone(), states, step, groups, [], whole)
        return param

    flat = torch.cat(ranks.run(rank_fn))
    assert torch.equal(flat[layout.numel:], torch.zeros(layout.padded_numel - layout.numel)), "padding moved"
    return {s.fqn: flat[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots}


def _reference(options: dict, steps: int) -> tuple[dict[str, torch.Tensor], ReferenceLamb]:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in _initial().items()}
    opt = ReferenceLamb([{"params": [p for k, p in params.items() if k not in NO_DECAY]},
                         {"params": [p for k, p in params.items() if k in NO_DECAY], "weight_decay": 0.0}],
                        **options)
    for grads in _grads(steps):
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}, opt


VARIANTS = {
    "bias-correction": dict(lr=0.01, weight_decay=0.1, max_coeff=0.3, min_coeff=0.05),
    "bing-bert": dict(lr=2e-3, weight_decay=0.01, bias_correction=False, max_coeff=0.3, min_coeff=0.01),
    "eps-inside-sqrt": dict(lr=0.01, weight_decay=0.1, max_coeff=0.3, min_coeff=0.05, eps_inside_sqrt=True,
                            betas=(0.8, 0.99), eps=1e-6),
}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lamb_on_shards_is_lamb_on_whole_tensors(world, variant):
    options, steps = VARIANTS[variant], 4
    want, ref = _reference(options, steps)
    policy = fxzero.Lamb(**options)
    groups = [policy.defaults(), {**policy.defaults(), "weight_decay": 0.0}]
    got = _sharded_lamb(world, policy, groups, steps)
    for k in SHAPES:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=FP32_ATOL, msg=lambda m, k=k: f"{k}: {m}")
    assert torch.equal(got["dead"], _initial()["dead"]), "a zero update moves nothing"
    # What the steps exercised: both clamps, an unclamped ratio, and both zero norms (ratio 1).
    cases = {case for step in ref.ratios for case, _ in step}
    assert cases == {"within", "max", "min", "zero weight", "zero update"}, cases


def test_bfloat16_masters_with_fp32_states_widen_and_round_back():
    """Masters in bfloat16 and states in fp32 (MixedPrecision(master_dtype=torch.bfloat16)): each
    step computes in fp32 from the widened masters, norms included, and rounds the masters back,
    as the reference does here to its fp32 copy after each step. Both round the same fp32 values
    but for fp32 rounding, so they agree within one bfloat16 rounding step (2**-8 relative), where
    an fp32 difference straddles a bfloat16 rounding boundary (measured: equal bit for bit)."""
    options, steps, world = VARIANTS["bias-correction"], 4, 2
    params = {k: torch.nn.Parameter(v.bfloat16().float()) for k, v in _initial().items()}
    ref = ReferenceLamb([{"params": [p for k, p in params.items() if k not in NO_DECAY]},
                         {"params": [p for k, p in params.items() if k in NO_DECAY], "weight_decay": 0.0}],
                        **options)
    for grads in _grads(steps):
        for k, p in params.items():
            p.grad = grads[k].bfloat16().float()
        ref.step()
        with torch.no_grad():
            for p in params.values():
                p.copy_(p.bfloat16().float())

    layout, policy = _layout(world), fxzero.Lamb(**options)
    groups = [policy.defaults(), {**policy.defaults(), "weight_decay": 0.0}]
    group_of = {k: 1 if k in NO_DECAY else 0 for k in SHAPES}
    flat0 = _flat(_initial(), layout).bfloat16()
    grads = [_flat(g, layout).bfloat16() for g in _grads(steps)]
    ranks = _ThreadRanks(world)

    def rank_fn(rank: int) -> torch.Tensor:
        lo, hi = layout.shard_range(rank)
        param, states = flat0[lo:hi].clone(), [torch.zeros(hi - lo), torch.zeros(hi - lo)]
        whole = WholeSums(layout.param_shard_ranges(rank, group_of), len(layout.slots), ranks.reduce(rank))
        for step, grad in enumerate(grads, start=1):
            optim_step(policy, param, grad[lo:hi].clone(), states, step, groups, [], whole)
        return param

    flat = torch.cat(ranks.run(rank_fn))
    assert flat.dtype == torch.bfloat16
    for s in layout.slots:
        got = flat[s.offset:s.offset + s.numel].view(s.shape).float()
        torch.testing.assert_close(got, params[s.fqn].detach(), rtol=2**-8, atol=1e-6,
                                   msg=lambda m, k=s.fqn: f"{k}: {m}")


def test_a_rank_holding_only_padding_still_joins_the_reduction():
    """Three elements on four ranks: rank 3's shard is padding only; it all-reduces zeros with the
    others (a rank that skipped it would hang them), and every parameter still gets its norm."""
    shapes = {"a": (2,), "b": (1,)}
    layout = _layout(4, shapes)
    assert layout.param_shard_ranges(3, {}) == [] and layout.param_shard_ranges(1, {}) == [(0, 1, 0, 0)]
    ranks, calls = _ThreadRanks(4), [0] * 4
    flat0, grad = torch.tensor([3.0, 4.0, 2.0, 0.0]), torch.tensor([1.0, -1.0, 0.5, 0.0])
    policy = fxzero.Lamb(lr=0.1, max_coeff=100.0, min_coeff=0.0, bias_correction=False)

    def rank_fn(rank: int) -> torch.Tensor:
        reduce = ranks.reduce(rank)

        def counted(t: torch.Tensor) -> torch.Tensor:
            calls[rank] += 1
            assert t.shape == (2, 2)  # 2 parameters x 2 sums, whatever the shard holds
            return reduce(t)

        param, states = flat0[rank:rank + 1].clone(), [torch.zeros(1), torch.zeros(1)]
        whole = WholeSums(layout.param_shard_ranges(rank, {}), len(layout.slots), counted)
        optim_step(policy, param, grad[rank:rank + 1].clone(), states, 1, [policy.defaults()], [], whole)
        return param

    got = torch.cat(ranks.run(rank_fn))
    assert calls == [1, 1, 1, 1]
    # The step is lr * ratio * u = lr * |p| * u / |u|. a = [3, 4], |a| = 5, on ranks 0 and 1; its
    # update at step 1 (no bias correction) is 0.1 g / sqrt(0.001 g^2), along [1, -1]: unit [1, -1] / sqrt 2.
    step_a = 0.1 * (5 / math.sqrt(2)) * torch.tensor([1.0, -1.0])
    torch.testing.assert_close(got[:2], torch.tensor([3.0, 4.0]) - step_a, rtol=1e-6, atol=0)
    torch.testing.assert_close(got[2], torch.tensor(2.0 - 0.1 * (2.0 / 1.0) * 1.0), rtol=1e-6, atol=0)
    assert got[3] == 0  # padding


def test_the_policy_refuses_an_empty_clamp():
    with pytest.raises(ValueError, match=r"Lamb.max_coeff=0.1 is below Lamb.min_coeff=0.2"):
        fxzero.Lamb(max_coeff=0.1, min_coeff=0.2)
    assert fxzero.Lamb().states == ("exp_avg", "exp_avg_sq") and fxzero.Lamb.WHOLE_PARAMETER_SUMS == 2
    assert fxzero.AdamW.WHOLE_PARAMETER_SUMS == 0


# -- DeepSpeed's "Lamb" ------------------------------------------------------------------------------

def _read(ds) -> Config:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IneffectiveSetting)
        return Config.from_deepspeed(ds)


def test_the_bing_bert_lamb_config_is_read_with_fused_lambs_defaults():
    config = _read(DATA / "deepspeedexamples_configs" / BING)
    params = json.loads((DATA / "deepspeedexamples_configs" / BING).read_text())["optimizer"]["params"]
    # the file's params; the rest at FusedLamb's defaults (betas, eps, eps_inside_sqrt)
    assert config.optimizer == fxzero.Lamb(lr=params["lr"], weight_decay=params["weight_decay"],
                                           bias_correction=False, max_coeff=0.3, min_coeff=0.01,
                                           betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False)
    assert config.gradient_clipping == 1.0
    assert _read({"optimizer": {"type": "lamb"}}).optimizer == fxzero.Lamb(weight_decay=0.0, max_coeff=10.0)
    assert _read({"optimizer": {"type": "Lamb", "params": {"amsgrad": False}}}).optimizer == fxzero.Lamb()


@pytest.mark.parametrize("section, message", [
    ({"type": "Lamb", "params": {"amsgrad": True}}, r"optimizer.params.amsgrad=true is not supported by fxzero: "
                                                    r"FusedLamb has no AMSGrad"),
    ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, r"no 'max_grad_norm' for Lamb; clip with the top-level "
                                                         r"\"gradient_clipping\" key"),
    ({"type": "Lamb", "params": {"max_coef": 1.0}}, r"no 'max_coef' for Lamb; did you mean 'max_coeff'\?"),
    ({"type": "Lamb", "params": {"max_coeff": 0.01, "min_coeff": 0.1}}, r"max_coeff=0.01 is below"),
    ({"type": "OneBitLamb"}, r"optimizer type 'OneBitLamb' is not supported \(1-bit LAMB is not in fxzero"),
])
def test_lamb_mistakes_and_one_bit_lamb_are_refused(section, message):
    with pytest.raises(ValueError, match=message):
        _read({"optimizer": section})


def test_another_librarys_lamb_object_is_refused_naming_the_config_way():
    from fxzero.deepspeed_api import _from_torch_optimizer

    class FusedLamb(torch.optim.Optimizer):  # (as apex's or DeepSpeed's class is named)
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3})

    with pytest.raises(TypeError, match=r"optimizer is a FusedLamb: fxzero runs LAMB as DeepSpeed's FusedLamb "
                                        r"computes it.*\"type\": \"Lamb\""):
        _from_torch_optimizer(FusedLamb([torch.nn.Parameter(torch.ones(2))]))


def test_an_engine_agrees_on_the_updates_all_reduces():
    """The all-reduce each unit's update issues is in the collective sequence ranks compare before
    a forward ([Note: one collective sequence]), one per unit, sized by its parameter count."""
    from fxzero import zoo

    torch.manual_seed(0)
    engine = fxzero.compile(zoo.build("gpt-tiny"), config=Config(stage=3, cost_model=None, optimizer=fxzero.Lamb()))
    x = torch.randint(0, zoo.GPT_SIZES["tiny"].vocab_size, (2, 8))
    engine.backward(engine(x).float().mean())
    engine.step()
    lines = [line for line in engine._last.sequence if "sums over whole parameters" in line]
    trainable = [lay for lay in engine.layouts if lay.trainable]
    assert len(lines) == len(trainable)
    assert {f"all_reduce of {lay.name} ({2 * len(lay.slots)} x float32" for lay in trainable} == {
        line.split(": ", 1)[1].split(", the")[0] for line in lines}
    report = engine.comm_report()["all_reduce"]
    assert report == {"calls": len(trainable), "elements": sum(2 * len(lay.slots) for lay in trainable),
                      "bytes": 4 * sum(2 * len(lay.slots) for lay in trainable), "via_all_reduce": 0}

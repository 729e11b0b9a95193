"""float16 with dynamic loss scaling together with what a training loop brings, on 2 gloo ranks,
against eager fp32 loops written here from what DeepSpeed documents:

- an update is one AdamW step on the mean loss over every micro-batch of every rank (so with
  gradient_accumulation_steps=k each micro-batch's loss counts 1/(k * world));
- a step whose gradients overflowed on any rank is skipped on every rank: no update, and the LR
  schedule does not step (DeepSpeed's `_take_model_step` steps its scheduler only when the
  optimizer did not overflow); its micro-batches are lost;
- clipping is torch.nn.utils.clip_grad_norm_ of the unscaled mean gradient;
- the loss scale follows DeepSpeed's DynamicLossScaler (tests/passes/test_loss_scale.py holds
  its counting); the sequences here are spelled out.

The engine computes in float16 and the references in fp32, so parameters are compared to
`PARAM_ATOL`, norms to `NORM_RTOL`; each scenario's bug would move them by far more (say so
where it is not plain). Models are tiny (float16 matmuls are slow on a CPU): an MLP of width 16,
and a two-branch layer whose flat buffer puts one branch in each rank's shard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from tests.dist.harness import run_ranks
from tests.dist.reference import clone_state_dict, rank_slice

pytestmark = pytest.mark.timeout(600)

WORLD = 2
WIDTH = 16
MICRO = 4  # rows per rank per micro-step
OPT = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SCALE0 = 2.0 ** 8
PARAM_ATOL = 1e-3
"""float16 compute against the fp32 reference after 3-6 AdamW steps of lr up to 2e-2: measured
within 2.2e-4 in every scenario here; each reference moves some parameter by over 5x this."""
NORM_RTOL = 2e-3
"""Global gradient norms, float16 against fp32: measured within 1.3e-4 (relative)."""
WARMUP = dict(warmup_min_lr=2e-3, warmup_max_lr=2e-2, warmup_num_steps=4, warmup_type="linear")


class MLP(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class Branches(nn.Module):
    """One unit of two equal layers, a then b: on 2 ranks rank 0's shard is a's parameters and rank
    1's is b's, so an overflow in b's gradient alone is seen by rank 1 alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


@functools.cache
def _initial(model: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return clone_state_dict(MLP() if model == "mlp" else Branches())


@functools.cache
def _batches(steps: int, accumulation: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable regression: y = tanh(x A), global batches of WORLD * accumulation * MICRO rows."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(WIDTH, WIDTH, generator=g) / math.sqrt(WIDTH)
    rows = WORLD * accumulation * MICRO
    return [(x, torch.tanh(x @ a)) for x in (torch.randn(rows, WIDTH, generator=g) for _ in range(steps))]


def _micro_batches(x: torch.Tensor, y: torch.Tensor, rank: int, accumulation: int):
    return zip(rank_slice(x, rank, WORLD).chunk(accumulation), rank_slice(y, rank, WORLD).chunk(accumulation))


def _warmup_lr(i: int) -> float:
    """DeepSpeed's WarmupLR (linear) at its iteration i (from -1: built, then one per step() call)."""
    frac = min(max(i, 0) / WARMUP["warmup_num_steps"], 1.0)
    return WARMUP["warmup_min_lr"] + (WARMUP["warmup_max_lr"] - WARMUP["warmup_min_lr"]) * frac


# -- the eager fp32 reference --------------------------------------------------------------------


def eager_reference(steps: int, accumulation: int, *, skipped: frozenset = frozenset(), clip: Optional[float] = None,
                    warmup: bool = False) -> dict[str, Any]:
    """DeepSpeed's documented loop on one fp32 MLP over the global batches (module doc): the mean of
    every rank's micro-batch losses, clipped, AdamW; steps in `skipped` (0-based) do nothing, and
    the warmup's iteration advances only on steps taken."""
    model = MLP()
    model.load_state_dict(_initial("mlp"))
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    taken, lrs, norms = 0, [], []
    for step, (x, y) in enumerate(_batches(steps, accumulation)):
        if warmup:
            for group in opt.param_groups:
                group["lr"] = _warmup_lr(taken - 1)
        lrs.append(opt.param_groups[0]["lr"])
        if step in skipped:
            norms.append(None)
            continue
        for rank in range(WORLD):
            for xm, ym in _micro_batches(x, y, rank, accumulation):
                (F.mse_loss(model(xm), ym) / (accumulation * WORLD)).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else math.inf)
        norms.append(float(total))
        opt.step()
        opt.zero_grad()
        taken += 1
    return {"state": clone_state_dict(model), "lrs": lrs, "norms": norms}


# -- what each rank runs ---------------------------------------------------------------------------


def _fp16(window: int = 1000, hysteresis: int = 1) -> fxzero.MixedPrecision:
    return fxzero.MixedPrecision(param_dtype=torch.float16, loss_scale=fxzero.LossScale(
        initial_scale_power=int(math.log2(SCALE0)), window=window, hysteresis=hysteresis))


def _compile(model: str, **config: Any):
    config = dict(dict(optimizer=fxzero.AdamW(**OPT), cost_model=None, collective_timeout=60.0), **config)
    with torch.device("meta"):
        module = MLP() if model == "mlp" else Branches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (float16 on a CPU is slow: said by a SlowSetting warning)
        return fxzero.compile(module, fxzero.Config(**config), state_dict=_initial(model))


def _loop(engine, rank: int, steps: int, accumulation: int, overflows=frozenset()) -> dict[str, Any]:
    """Train on this rank's micro-batches; `overflows` holds (step, rank, micro-step) whose loss is
    made infinite (an overflow of that rank's gradients)."""
    out: dict[str, list] = {"lrs": [], "scales": [], "skipped": [], "applied": [], "norms": []}
    for step, (x, y) in enumerate(_batches(steps, accumulation)):
        out["lrs"].append(engine.get_lr()[0])
        for m, (xm, ym) in enumerate(_micro_batches(x, y, rank, accumulation)):
            loss = F.mse_loss(engine(xm).float(), ym)
            if (step, rank, m) in overflows:
                loss = loss * math.inf
            engine.backward(loss)
            engine.step()
        out["scales"].append(engine.loss_scale)
        out["skipped"].append(engine.skipped_steps)
        out["applied"].append(engine.was_step_applied())
        out["norms"].append(engine.get_global_grad_norm())
    out["state"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return out


OVERFLOW_STEP = 1  # scenario one_rank: the second step, rank 1's b gradient overflows
BIG = 1e4


def _branch_inputs(steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, z, t) global batches; at OVERFLOW_STEP rank 1's z is BIG times larger."""
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(steps):
        x, z, t = (torch.randn(WORLD * MICRO, WIDTH, generator=g) for _ in range(3))
        if step == OVERFLOW_STEP:
            z[MICRO:] *= BIG
        out.append((x, z, t))
    return out


def _branch_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Linear in the output, so its gradient does not grow with z: only b's gradient (z times it) does."""
    return (out.float() * t).mean()


def _one_rank(rank: int) -> dict[str, Any]:
    engine = _compile("branches", mixed_precision=_fp16())
    layout = engine.layouts[0]
    lo, hi = layout.shard_range(rank)
    shard = sorted({s.fqn for s in layout.slots if s.offset < hi and s.offset + s.numel > lo})
    out: dict[str, Any] = {"shard": shard, "scales": [], "skipped": [], "applied": []}
    for x, z, t in _branch_inputs(3):
        sl = functools.partial(rank_slice, rank=rank, world_size=WORLD)
        engine.backward(_branch_loss(engine(sl(x), sl(z)), sl(t)))
        engine.step()
        out["scales"].append(engine.loss_scale)
        out["skipped"].append(engine.skipped_steps)
        out["applied"].append(engine.was_step_applied())
    out["state"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return out


ACCUMULATION = 3
STEPS = 5
SCHEDULE_OVERFLOW = (2, 0, 0)  # scenario schedule: step 3's only micro-step, on rank 0
TOGETHER_OVERFLOW = (2, 1, 1)  # scenario together: step 3's second micro-step, on rank 1
CLIP = 0.1
WINDOW_PATTERN = "GGGGOGGOOGGGOO"
"""Scenario window: a step per letter, O overflowing (rank 1's last micro-step); window 2,
hysteresis 2 (the sequence of tests/passes/test_loss_scale.py)."""
WINDOW_SCALES = [256, 256, 512, 512, 512, 512, 512, 256, 128, 128, 128, 256, 256, 128]


def _together_config() -> fxzero.Config:
    """A DeepSpeed config, read as fxzero reads one: float16 with DeepSpeed's scaler keys,
    accumulation, clipping and a WarmupLR "scheduler"."""
    ds = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {k: list(v) if k == "betas" else v for k, v in OPT.items()}},
        "scheduler": {"type": "WarmupLR", "params": WARMUP},
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1},
        "zero_optimization": {"stage": 3},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dataclasses.replace(fxzero.Config.from_deepspeed(ds), cost_model=None, collective_timeout=60.0)


def _together(rank: int) -> dict[str, Any]:
    model = MLP()
    model.load_state_dict(_initial("mlp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, scheduler = fxzero.initialize(model=model, config=_together_config())
    assert scheduler is engine.lr_scheduler is not None
    return _loop(engine, rank, 6, 2, {TOGETHER_OVERFLOW})


def _bad_batch(rank: int) -> list[str]:
    """Triples that hold for one rank and not for two; each must refuse to start."""
    out = []
    for train, micro, accumulation in ((8, 4, 2), (8, 8, None), (8, None, 8)):
        try:
            _compile("mlp", train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                     gradient_accumulation_steps=accumulation)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


ACCUMULATE = {
    "accumulate": {},
    "accumulate_local": dict(gradient_accumulation="local"),  # one reduction per step, of the sum
    "accumulate_cpu": dict(offload=fxzero.Offload(optimizer=fxzero.Cpu())),  # checked and measured as written
}
"""Scenario accumulate, and the same with the gradients kept whole until the boundary, and with
the gradient shards on the cpu tier (checked for overflow and measured for the norm as the
backward writes them)."""


def _accumulate(rank: int, **options: Any) -> dict[str, Any]:
    engine = _compile("mlp", mixed_precision=_fp16(), gradient_accumulation_steps=ACCUMULATION, **options)
    return _loop(engine, rank, STEPS, ACCUMULATION)


def _all(rank: int, world_size: int) -> dict[str, Any]:
    assert world_size == WORLD
    runs = {
        "one_rank": lambda: _one_rank(rank),
        **{name: functools.partial(_accumulate, rank, **options) for name, options in ACCUMULATE.items()},
        "schedule": lambda: _loop(_compile("mlp", mixed_precision=_fp16(), lr_schedule=fxzero.WarmupLR(**WARMUP)),
                                  rank, STEPS, 1, {SCHEDULE_OVERFLOW}),
        "window": lambda: _loop(_compile("mlp", mixed_precision=_fp16(window=2, hysteresis=2)), rank,
                                len(WINDOW_PATTERN), 1, {(i, 1, 0) for i, c in enumerate(WINDOW_PATTERN) if c == "O"}),
        "together": lambda: _together(rank),
        "batch": lambda: _bad_batch(rank),
    }
    out = {}
    for name, run in runs.items():
        out[name] = run()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout_s=500)


def _assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
                         initial: dict[str, torch.Tensor]) -> None:
    """Within PARAM_ATOL of the reference, which itself moved by far more than that (or the
    comparison could not tell training from none)."""
    assert set(got) == set(want), what
    moved = max(float((want[k] - initial[k]).abs().max()) for k in want)
    assert moved > 5 * PARAM_ATOL, (what, moved)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=PARAM_ATOL, msg=lambda m, k=k: f"{what}: {k}\n{m}")


# -- tests -----------------------------------------------------------------------------------------


def test_an_overflow_on_one_rank_alone_skips_the_step_on_every_rank(runs):
    """Rank 1's shard is b's parameters, rank 0's is a's; at the second step rank 1's input z is
    1e4 times larger, so b's gradient (and so rank 1's reduced shard alone) overflows in float16.
    Both ranks skip that step and halve the scale (hysteresis 1); the parameters are those of the
    two other steps."""
    assert runs[0]["one_rank"]["shard"] == ["a.bias", "a.weight"]
    assert runs[1]["one_rank"]["shard"] == ["b.bias", "b.weight"]
    # The premise, from fp32 gradients of each rank's loss: times the scale, b's gradient on rank 1
    # is past float16's largest value (65504), a's (and rank 0's) well within it.
    model = Branches()
    model.load_state_dict(_initial("branches"))
    x, z, t = _branch_inputs(3)[OVERFLOW_STEP]
    for rank in range(WORLD):
        model.zero_grad()
        sl = functools.partial(rank_slice, rank=rank, world_size=WORLD)
        _branch_loss(model(sl(x), sl(z)), sl(t)).backward()
        largest = {n: float(p.grad.abs().max()) * SCALE0 for n, p in model.named_parameters()}
        assert largest["a.weight"] < 1000 and largest["a.bias"] < 1000, largest
        assert (largest["b.weight"] > 1e5) == (rank == 1), largest
    for rank in runs:
        got = rank["one_rank"]
        assert got["skipped"] == [0, 1, 1] and got["applied"] == [True, False, True], got
        assert got["scales"] == [SCALE0, SCALE0 / 2, SCALE0 / 2], got["scales"]
    # The reference: AdamW on the first and third steps' mean losses.
    model = Branches()
    model.load_state_dict(_initial("branches"))
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    for step, (x, z, t) in enumerate(_branch_inputs(3)):
        if step != OVERFLOW_STEP:
            _branch_loss(model(x, z), t).backward()
            opt.step()
            opt.zero_grad()
    _assert_params_close(runs[0]["one_rank"]["state"], clone_state_dict(model), "one rank's overflow",
                         _initial("branches"))


@pytest.mark.parametrize("kind", list(ACCUMULATE))
def test_fp16_with_accumulation_counts_each_micro_batch_once_over_k(runs, kind):
    """gradient_accumulation_steps=3 with float16 scaling: the loss divided by 3 exactly once, so
    the reported norm (unscaled, over all ranks) is the eager mean gradient's, and the parameters
    are eager AdamW's. Without the 1/k the norm is 3x, with it twice 1/3 (AdamW itself is blind to
    a constant factor on every gradient, up to eps: the norm is what shows it)."""
    ref = eager_reference(STEPS, ACCUMULATION)
    for rank in runs:
        got = rank[kind]
        assert got["skipped"] == [0] * STEPS and got["scales"] == [SCALE0] * STEPS
        torch.testing.assert_close(got["norms"], ref["norms"], rtol=NORM_RTOL, atol=0)
    _assert_params_close(runs[0][kind]["state"], ref["state"], f"fp16 with accumulation ({kind})", _initial("mlp"))


def test_a_skipped_step_does_not_step_the_lr_schedule(runs):
    """WarmupLR, linear over 4 steps, and step 3 overflowing on rank 0: steps 1-5 run at the
    warmup's iterations -1, 0, 1, 1, 2 (step 3's lr is used again by step 4), as DeepSpeed's
    engine does, which steps its scheduler only after an update."""
    ref = eager_reference(STEPS, 1, skipped=frozenset({SCHEDULE_OVERFLOW[0]}), warmup=True)
    want = [_warmup_lr(i) for i in (-1, 0, 1, 1, 2)]
    assert ref["lrs"] == want
    for rank in runs:
        got = rank["schedule"]
        assert got["skipped"] == [0, 0, 1, 1, 1] and got["applied"] == [True, True, False, True, True]
        torch.testing.assert_close(got["lrs"], want, rtol=1e-12, atol=0)
    _assert_params_close(runs[0]["schedule"]["state"], ref["state"], "warmup with a skipped step", _initial("mlp"))


def test_the_loss_scale_doubles_and_halves_on_deepspeeds_steps(runs):
    """window 2, hysteresis 2, through the engine: the scale after each step is DeepSpeed's."""
    skipped = [WINDOW_PATTERN[: i + 1].count("O") for i in range(len(WINDOW_PATTERN))]
    for rank in runs:
        got = rank["window"]
        assert got["scales"] == WINDOW_SCALES, got["scales"]
        assert got["skipped"] == skipped
        assert got["applied"] == [c == "G" for c in WINDOW_PATTERN]


def test_fp16_accumulation_a_skipped_step_clipping_and_a_schedule_together(runs):
    """A DeepSpeed config through fxzero.initialize: float16, 2 micro-steps, clipping at 0.1 and a
    WarmupLR; the third step's second micro-step overflows on rank 1 alone. That step is skipped
    everywhere and the scale halves; every other step is eager's: the mean over 2 micro-steps and
    2 ranks, clipped by its global norm, at the warmup's lr (not advanced by the skipped step)."""
    skipped_step = TOGETHER_OVERFLOW[0]
    ref = eager_reference(6, 2, skipped=frozenset({skipped_step}), clip=CLIP, warmup=True)
    assert all(n > CLIP for n in ref["norms"] if n is not None)  # the clip binds
    for rank in runs:
        got = rank["together"]
        assert got["skipped"] == [0, 0, 1, 1, 1, 1]
        assert got["scales"] == [SCALE0] * 2 + [SCALE0 / 2] * 4
        torch.testing.assert_close(got["lrs"], ref["lrs"], rtol=1e-12, atol=0)
        for i, (norm, want) in enumerate(zip(got["norms"], ref["norms"])):
            if want is None:  # a skipped step measures nothing: the last norm stays
                assert norm == got["norms"][i - 1]
            else:
                assert norm == pytest.approx(want, rel=NORM_RTOL), (i, got["norms"], ref["norms"])
    _assert_params_close(runs[0]["together"]["state"], ref["state"], "fp16, accumulation, clip, skip, warmup",
                         _initial("mlp"))


@pytest.mark.parametrize("i, why", [(0, "4 * 2 * 2 = 16, not 8"), (1, "8 is not a multiple of 8 * 2"),
                                    (2, "8 is not a multiple of 8 * 2")])
def test_a_batch_triple_right_for_one_rank_is_an_error_on_two(runs, i, why):
    """train_batch_size = micro * accumulation * world, with the real world: each triple holds for
    a world of one (8 = 4 * 2 * 1, 8 = 8 * 1 * 1, 8 = 1 * 8 * 1), none for two."""
    given = [(8, 4, 2), (8, 8, None), (8, None, 8)][i]
    for rank in runs:
        message = rank["batch"][i]
        assert f"batch sizes: {why}" in message, message
        assert (f"train_batch_size={given[0]}, train_micro_batch_size_per_gpu={given[1]}, "
                f"gradient_accumulation_steps={given[2]}, world size 2") in message, message

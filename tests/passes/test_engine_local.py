"""The rewritten programs executed in a world of one, against eager torch.optim.AdamW.

A quick sanity check that the compiled forward, backward and step compute what eager PyTorch
does; the multi-rank parity tests live in tests/dist.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxzero
from tests.passes.toys import STAGES, TOYS, build, real_input

STEPS = 3
OPTIM = fxzero.AdamW(lr=1e-2, weight_decay=1e-2)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.pow(2).mean()


def _reference(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TOYS[name].build()
    with torch.no_grad():
        for p in model.parameters():  # move away from the default init so every slot matters
            p.add_(0.1 * torch.randn_like(p))
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_both(name: str, stage: int):
    ref, state = _reference(name)
    engine = fxzero.compile(build(name), fxzero.Config(stage=stage, optimizer=OPTIM), state_dict=state)
    opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad],
        lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=OPTIM.weight_decay,
    )
    losses = []
    for step in range(STEPS):
        x = real_input(name, seed=100 + step)
        ref_loss = _loss(ref(x))
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        loss = _loss(engine(x))
        engine.backward(loss)
        engine.step()
        losses.append((loss.item(), ref_loss.item()))
    return engine, ref, state, losses


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", ("mlp", "tied", "bn", "frozen", "unused"))
def test_three_steps_match_eager_adamw(name, stage):
    engine, ref, initial, losses = _train_both(name, stage)
    for got, want in losses:
        assert got == pytest.approx(want, abs=1e-6)
    full = engine.full_state_dict()
    expected = ref.state_dict()
    assert list(full) == list(expected)
    for key, want in expected.items():
        torch.testing.assert_close(full[key], want, atol=1e-6, rtol=0, msg=key)
    # The parameters did move (the comparison above is not between two untouched models).
    moved = [
        k for k, p in ref.named_parameters() if p.requires_grad and not torch.equal(initial[k], p.detach())
    ]
    assert moved


def test_frozen_and_unused_parameters_are_left_untouched():
    cases = {"frozen": ("layers.1.weight", "layers.1.bias", "layers.2.weight"), "unused": ("unused",)}
    for name, untouched in cases.items():
        engine, _, initial, _ = _train_both(name, 3)
        full = engine.full_state_dict()
        for key in untouched:
            assert torch.equal(full[key], initial[key]), key


def test_batchnorm_running_stats_are_updated():
    engine, ref, initial, _ = _train_both("bn", 3)
    full = engine.full_state_dict()
    assert int(full["2.num_batches_tracked"]) == STEPS
    assert not torch.equal(full["2.running_mean"], initial["2.running_mean"])


@pytest.mark.parametrize("stage", STAGES)
def test_executor_issues_exactly_the_scheduled_collectives(stage):
    engine, _, _, _ = _train_both("tied", stage)
    schedule = engine.schedule
    kinds = [i.kind for _, i in schedule.collectives()]
    per_step = {k: kinds.count(k) for k in ("all_gather", "reduce_scatter")}
    report = engine.comm_report()
    assert report["all_gather"]["calls"] == STEPS * per_step["all_gather"]
    # One per trained unit: root, blocks.0, blocks.1 and the tail (the final norm).
    assert report["reduce_scatter"]["calls"] == STEPS * per_step["reduce_scatter"] == STEPS * 4


def test_weight_dropout_gradient_uses_the_forward_mask():
    weight = torch.rand(4, 4) + 0.5
    config = fxzero.Config(stage=3, optimizer=fxzero.AdamW(lr=1e-2, weight_decay=0.0))
    engine = fxzero.compile(build("weight_dropout"), config, state_dict={"lin.weight": weight})
    torch.manual_seed(1)
    y = engine(torch.eye(4))  # y.T is the dropped-out weight itself
    engine.backward(y.sum())  # d/dw = the mask / (1 - p): zero exactly where the forward dropped
    engine.step()  # Adam without decay moves exactly the entries with a nonzero gradient
    moved = engine.full_state_dict()["lin.weight"] != weight
    kept = y.detach().T != 0
    assert torch.equal(moved, kept)


def test_buffers_kept_for_the_backward_are_released():
    """Gathered buffers the forward keeps for the backward live until the backward frees them,
    or are released at once by a forward under no_grad (no backward can follow)."""
    engine, _, _, _ = _train_both("mlp", 3)
    assert engine.schedule.kept_for_backward, "the default prefetch keeps the units the backward needs first"
    x = real_input("mlp", seed=7)
    assert engine.memory_report()["gathered"] == 0
    loss = _loss(engine(x))
    kept = {u.name: u.padded_numel * u.itemsize for u in engine.layouts}
    assert engine.memory_report()["gathered"] == sum(kept[u] for u in engine.schedule.kept_for_backward)
    engine.backward(loss)
    assert engine.memory_report()["gathered"] == 0
    engine.zero_grad()
    with torch.no_grad():
        engine(x)
    assert engine.memory_report()["gathered"] == 0
    # Without keeping, nothing is gathered between the forward and the backward.
    plain = fxzero.compile(build("mlp"), fxzero.Config(stage=3, prefetch=fxzero.Prefetch(keep_for_backward=False)))
    loss = _loss(plain(x))
    assert plain.schedule.kept_for_backward == () and plain.memory_report()["gathered"] == 0


@pytest.mark.parametrize("stage", STAGES)
def test_a_gradient_dropped_by_zero_grad_never_reaches_the_step(stage):
    """The backward leaves its last reduce-scatters in flight for the step to wait for; a
    zero_grad in between waits for them and drops them: the next step uses only the next
    backward's gradients."""
    _, state = _reference("mlp")
    engines = [fxzero.compile(build("mlp"), fxzero.Config(stage=stage, optimizer=OPTIM), state_dict=state)
               for _ in range(2)]
    for n, engine in enumerate(engines):
        if n == 0:
            engine.backward(_loss(engine(real_input("mlp", seed=1))))
            engine.zero_grad()  # discarded
        engine.backward(_loss(engine(real_input("mlp", seed=2))))
        assert engine.memory_report()["grad_shards"] > 0  # reports settle the gradients in flight
        engine.step()
    step = engines[0].schedule.program("step")
    assert any(i.kind == "wait" for i in step.instructions), "the step waits for a gradient in flight"
    a, b = engines[0].full_state_dict(), engines[1].full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(60)
def test_calls_out_of_order_are_errors_naming_the_call_to_make():
    engine = fxzero.compile(build("mlp"), fxzero.Config(cost_model=None))
    x = real_input("mlp", seed=0)
    with pytest.raises(RuntimeError, match=r"^\[rank 0\] step\(\) before any forward/backward"):
        engine.step()
    loss = _loss(engine(x))
    with pytest.raises(RuntimeError, match=r"^\[rank 0\] step\(\) found no gradient for units .*: call "
                                           r"engine.backward\(loss\) after the forward and before step\(\)"):
        engine.step()
    with pytest.raises(TypeError, match=r"^\[rank 0\] engine.backward expects a loss tensor .*under no_grad"):
        engine.backward(loss.detach())
    engine.backward(loss)
    engine.step()  # in order, the same engine trains


def test_memory_report_counts_device_and_host_bytes_apart():
    """On a CPU rank host memory is the device's: every state the rank holds counts as device
    bytes (the cpu tier, where used, is in `offloaded`)."""
    engine, _, _, _ = _train_both("mlp", 3)
    report = engine.memory_report()
    assert report["host_bytes"] == 0
    assert report["device_bytes"] == report["model_states"] + report["buffers"] > 0


@pytest.mark.parametrize("stage", (2, 3))
def test_a_unit_with_no_gradient_trains_with_bf16_gradients_on_a_tier(stage):
    """A unit none of whose parameters gets a gradient (UnusedNet's root) still has a flat
    gradient of zeros; with bf16 gradients reduced in bf16 and the optimizer on the cpu tier, it is
    written to the tier in fp32 like every unit's. It was written in bf16, untyped, and the step's
    fp32 read of it failed (DeepSpeed's test_ignore_unused_parameters: ZeRO-2, cpu_offload, bf16).
    The run equals the same one with everything on the device, bit for bit."""
    full = {}
    for tier in (fxzero.Device(), fxzero.Cpu()):
        mp = fxzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        config = fxzero.Config(stage=stage, optimizer=OPTIM, mixed_precision=mp, offload=fxzero.Offload(optimizer=tier))
        _, state = _reference("unused")
        engine = fxzero.compile(build("unused"), config, state_dict=state)
        for step in range(STEPS):
            engine.backward(_loss(engine(real_input("unused", seed=100 + step))))
            engine.step()
        full[type(tier).__name__] = engine.full_state_dict()
    on_device, on_cpu = full["Device"], full["Cpu"]
    assert list(on_device) == list(on_cpu)
    for key in on_device:
        assert torch.equal(on_device[key], on_cpu[key]), key
    assert torch.equal(on_cpu["unused"], _reference("unused")[1]["unused"])


@pytest.mark.parametrize("stage", STAGES)
def test_batch_norm_trains_under_bf16_mixed_precision_in_fp32_as_a_whole(stage):
    """bf16 parameters beside BatchNorm's fp32 running statistics: the norm runs in fp32 as a
    whole ([Note: batch norm under mixed precision] in fxzero/target_device.py); it was "expected
    scalar type BFloat16 but found Float" in the backward. The reference is eager, written here:
    the Linears in bf16, the norm in fp32 on the upcast input and weights, its output rounded to
    bf16, fp32 gradients into AdamW on fp32 masters."""
    import torch.nn.functional as F

    ref, state = _reference("bn")
    mp = fxzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    engine = fxzero.compile(build("bn"), fxzero.Config(stage=stage, optimizer=OPTIM, mixed_precision=mp),
                            state_dict=state)
    masters = {k: p.detach().clone().requires_grad_() for k, p in ref.named_parameters()}
    stats = {k: b.clone() for k, b in ref.named_buffers()}
    opt = torch.optim.AdamW(masters.values(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                            weight_decay=OPTIM.weight_decay)
    for step in range(STEPS):
        x = real_input("bn", seed=100 + step).to(torch.bfloat16)
        p = {k: m.detach().to(torch.bfloat16).requires_grad_() for k, m in masters.items()}
        h = F.linear(x, p["0.weight"], p["0.bias"]).relu()
        h = F.batch_norm(h.float(), stats["2.running_mean"], stats["2.running_var"], p["2.weight"].float(),
                         p["2.bias"].float(), training=True, momentum=0.1, eps=1e-5).to(torch.bfloat16)
        want = _loss(F.linear(h, p["3.weight"], p["3.bias"]))
        want.backward()
        for k, m in masters.items():
            m.grad = p[k].grad.float()
        opt.step()
        opt.zero_grad()
        loss = _loss(engine(x))
        engine.backward(loss)
        engine.step()
        assert loss.dtype == torch.bfloat16 and loss.item() == want.item(), (step, loss.item(), want.item())
    full = engine.full_state_dict()
    assert full["2.running_mean"].dtype == torch.float32
    torch.testing.assert_close(full["2.running_mean"], stats["2.running_mean"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(full["2.running_var"], stats["2.running_var"], rtol=1e-6, atol=1e-7)
    for k, m in masters.items():
        torch.testing.assert_close(full[k], m.detach(), rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(full["2.weight"], state["2.weight"])


@pytest.mark.parametrize("name", ("unused", "frozen", "mlp"))
@pytest.mark.parametrize("bf16", (False, True))
def test_updating_in_the_backward_equals_updating_in_step(name, bf16):
    """`Offload(step_in_backward=True)` at stage 3, bit for bit against the same placement updating
    in step(). UnusedNet's first layer is not gathered by the backward (its input needs no
    gradient), so its shard is read for the update alone; that read was inserted before its
    reduce-scatter's wait, which then moved earlier: the update read a shard not yet read, and
    the program was refused at compile ("used before it has been defined")."""
    mp = fxzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    full = []
    for in_backward in (False, True):
        offload = fxzero.Offload(params=fxzero.Cpu(), optimizer=fxzero.Cpu(), step_in_backward=in_backward)
        _, state = _reference(name)
        engine = fxzero.compile(build(name), fxzero.Config(stage=3, optimizer=OPTIM, mixed_precision=mp, offload=offload),
                                state_dict=state)
        for step in range(STEPS):
            x = real_input(name, seed=100 + step)
            engine.backward(_loss(engine(x.to(torch.bfloat16) if bf16 else x)))
            engine.step()
        full.append(engine.full_state_dict())
    assert list(full[0]) == list(full[1])
    for key in full[0]:
        assert torch.equal(full[0][key], full[1][key]), key

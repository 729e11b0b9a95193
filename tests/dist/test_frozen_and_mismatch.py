"""Frozen parameters and mismatched ranks, on 2 gloo ranks.

Frozen parameters (requires_grad=False) are gathered like any other but never reduced and take
no optimizer state; a unit that mixes both is split into `<unit>` and `<unit>:frozen`. Trainable
parameters in no param group of `model_parameters` are treated as DeepSpeed's ZeRO optimizers
treat them (they hold only their optimizer's groups): used, never updated, nothing reduced; the
reference is torch.optim given the other parameters alone.
Ranks that compiled different programs fail at start-up with a clear error instead of hanging
in a collective whose partner never comes.

Every engine pins `cost_model=None` (native reduce-scatters), so no timing measurement decides
how gradients are reduced.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fxzero
from fxzero import zoo
from tests.dist.harness import ADAMW, run_ranks, train
from tests.dist.reference import eager_gpt_reference, lm_loss, make_gpt_batches

FROZEN = ("wpe.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias")


def _frozen_gpt():
    model = zoo.build("gpt-tiny")
    for name, p in model.named_parameters():
        if name in FROZEN:
            p.requires_grad_(False)
    return model


@functools.cache
def _initial():
    torch.manual_seed(0)
    return zoo.build("gpt-tiny").state_dict()


@functools.cache
def _batches():
    return make_gpt_batches(zoo.GPT_SIZES["tiny"], steps=4, global_batch=8, seed=5)


def _train_frozen(rank: int, world_size: int, stage: int, batches, initial):
    with torch.device("meta"):
        model = _frozen_gpt()
    config = fxzero.Config(stage=stage, optimizer=fxzero.AdamW(**ADAMW), cost_model=None)
    engine = fxzero.compile(model, config, state_dict=initial)
    comm = {}

    def last_step_comm(i: int) -> None:
        comm.clear()
        comm.update(engine.comm_report(reset=True))

    losses = train(engine, batches, lm_loss, rank, world_size, mean_over_ranks=True, after_step=last_step_comm)
    units = {u.name: (u.padded_numel, u.trainable) for u in engine.layouts}
    return {
        "losses": losses,
        "state": engine.full_state_dict(),
        "comm": comm,
        "units": units,
        "kept": engine.schedule.kept_for_backward,
        "optim_bytes": engine.memory_report()["optimizer_states"],
    }


@pytest.fixture(scope="module", params=[2, 3], ids=lambda s: f"stage{s}")
def frozen_run(request):
    return request.param, run_ranks(_train_frozen, 2, request.param, _batches(), _initial(), timeout_s=300)


@functools.cache
def _frozen_reference():
    return eager_gpt_reference(_frozen_gpt, _initial(), _batches(), ADAMW)


def test_frozen_parity(frozen_run):
    _, ranks = frozen_run
    ref = _frozen_reference()
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for key, want in ref["state_dict"].items():
        torch.testing.assert_close(ranks[0]["state"][key], want, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    for name in FROZEN:
        assert torch.equal(ranks[0]["state"][name], _initial()[name]), f"frozen {name} changed"


def test_frozen_units_are_split_gathered_never_reduced(frozen_run):
    stage, ranks = frozen_run
    units = ranks[0]["units"]
    assert units["root:frozen"][1] is False and units["blocks.0:frozen"][1] is False
    assert units["blocks.0"][1] is True
    trainable = sum(n for n, t in units.values() if t)
    everything = sum(n for n, _ in units.values())
    comm = ranks[0]["comm"]
    assert comm["reduce_scatter"]["elements"] == trainable
    if stage == 3:
        # Gathered in forward and again in backward, except a unit the backward does not read:
        # the frozen position embedding (no gradient flows into it and no other gradient needs
        # its value), which is gathered once, and the units the backward keeps from the forward.
        assert ranks[0]["kept"], "the default prefetch keeps the units the backward needs first"
        gathers = 2 * everything - units["root:frozen"][0] - sum(units[u][0] for u in ranks[0]["kept"])
    else:
        gathers = trainable  # stage 2 re-gathers the updated parameters only
    assert comm["all_gather"]["elements"] == gathers
    assert ranks[0]["optim_bytes"] == 8 * trainable // 2


def _train_ungrouped(rank: int, world_size: int, batches, initial):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny")
    named = dict(model.named_parameters())
    decay = [p for f, p in named.items() if f not in FROZEN and p.ndim >= 2]
    rest = [p for f, p in named.items() if f not in FROZEN and p.ndim < 2]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    config = fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None)
    engine = fxzero.compile(model, config, state_dict=initial, model_parameters=groups)
    comm = {}

    def last_step_comm(i: int) -> None:
        comm.clear()
        comm.update(engine.comm_report(reset=True))

    losses = train(engine, batches, lm_loss, rank, world_size, mean_over_ranks=True, after_step=last_step_comm)
    return {"losses": losses, "state": engine.full_state_dict(), "comm": comm,
            "units": {u.name: (u.padded_numel, u.trainable) for u in engine.layouts},
            "requires_grad": {f: p.requires_grad for f, p in model.named_parameters()}}


def test_parameters_in_no_group_are_used_never_updated_nothing_reduced():
    ranks = run_ranks(_train_ungrouped, 2, _batches(), _initial(), timeout_s=300)

    def grouped_only(model):
        named = dict(model.named_parameters())
        return torch.optim.AdamW([{"params": [p for f, p in named.items() if f not in FROZEN and p.ndim >= 2]},
                                  {"params": [p for f, p in named.items() if f not in FROZEN and p.ndim < 2],
                                   "weight_decay": 0.0}], **ADAMW)

    ref = eager_gpt_reference(lambda: zoo.build("gpt-tiny"), _initial(), _batches(), make_optimizer=grouped_only)
    got = ranks[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for key, want in ref["state_dict"].items():
        torch.testing.assert_close(got["state"][key], want, rtol=0, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    for name in FROZEN:
        assert torch.equal(got["state"][name], _initial()[name]), f"{name} (in no group) changed"
        assert got["requires_grad"][name]  # (as the user left it)
    units = got["units"]
    assert units["root:frozen"][1] is False and units["blocks.0:frozen"][1] is False
    assert got["comm"]["reduce_scatter"]["elements"] == sum(n for n, t in units.values() if t)


def _mismatched(rank: int, world_size: int):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny", n_blocks=4 + rank)  # rank 1 has one block more
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    engine(model.example_inputs(batch=2)[0])


def test_mismatched_ranks_fail_fast_with_a_clear_error():
    with pytest.raises(AssertionError) as info:
        run_ranks(_mismatched, 2, timeout_s=120)
    message = str(info.value)
    # (the harness stops the run at the first failed rank: one of the two tracebacks comes back)
    assert any(f"[rank {rank}] the ranks' programs would issue different collectives" in message
               for rank in (0, 1)), message
    assert "hang" in message

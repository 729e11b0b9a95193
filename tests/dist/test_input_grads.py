"""Inputs that require grad get their gradients, as when the model is called eagerly, on 2 ranks
([Note: inputs that require grad] in `fxzero/ir/signature.py`).

Before, an input that required grad was refused at the trace ("fxzero computes gradients for
parameters only"): DeepSpeed's own leaf-module tests (`batch[0].requires_grad = True` in
tests/unit/runtime/zero/test_zero_leaf_module.py), adversarial training (a perturbation's
gradient) and embeddings computed by modules outside the engine did not run. The references are
eager PyTorch computed here: each rank's model copy run on its own batch, DDP's averaged gradient,
torch.optim.SGD's update.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxzero
from fxzero.leaf_modules import set_z3_leaf_modules
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

STEPS, LR, WORLD = 3, 0.1, 2


class Net(nn.Module):
    """Two inputs that may require grad (x, and a `noise` it adds), a label, and one input that
    requires grad but that the loss does not read (`unused`)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, noise, y, unused=None):
        return F.cross_entropy(self.b(torch.tanh(self.a(x + noise))), y)


class ChooseModuleByRank(nn.Module):
    """DeepSpeed's `ChooseModuleByRankModel` (test_zero_leaf_module.py), written here its way:
    each rank runs one of two layers, its input requiring grad as that test sets it."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)])

    def forward(self, x, y, rank: int):
        return F.cross_entropy(torch.relu(self.linears[rank % 2](x)), y)


def _batches(rank: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(20 + rank)
    return [(torch.randn(4, 8, generator=g), 0.1 * torch.randn(4, 8, generator=g),
             torch.randint(0, 8, (4,), generator=g)) for _ in range(STEPS)]


def _train(rank: int, world_size: int, stage: int, settings: dict) -> dict:
    torch.manual_seed(0)
    model = Net()
    mp = settings.get("bf16")
    config = fxzero.Config(stage=stage, optimizer=fxzero.SGD(lr=LR), cost_model=None,
                           gradient_reduction=settings.get("reduction", "mean"),
                           gradient_accumulation_steps=settings.get("accumulation", 1),
                           mixed_precision=fxzero.MixedPrecision(param_dtype=torch.bfloat16) if mp else None)
    engine = fxzero.compile(model, config)
    outside = nn.Linear(8, 8)  # (the caller's own module, computing the noise: not the engine's)
    torch.manual_seed(1)
    outside.reset_parameters()
    losses, x_grads, noise_grads, outside_grads, unused = [], [], [], [], []
    for x, noise, y in _batches(rank):
        x = x.clone().requires_grad_(True)
        u = torch.zeros(3, requires_grad=True)
        if settings.get("outside"):
            noise = outside(noise)  # (a tensor autograd computed: its gradient carries on to `outside`)
        loss = engine(x, noise, y, u)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
        x_grads.append(x.grad)
        unused.append(u.grad)
        if settings.get("outside"):
            outside_grads.append(outside.weight.grad.clone())
            outside.weight.grad = None
            outside.bias.grad = None
    return {"losses": torch.stack(losses), "x_grads": x_grads, "outside_grads": outside_grads,
            "unused": unused, "state": engine.full_state_dict()}


def _eager(settings: dict) -> tuple[list[dict], dict]:
    """Each rank's x.grad (and the outside module's gradient) from its model copy, as
    `engine.backward(loss)` leaves them: of the loss divided by the accumulation steps, as
    DeepSpeed divides it; DDP's averaged (or summed) gradients; SGD."""
    torch.manual_seed(0)
    model = Net()
    mp = settings.get("bf16")
    masters = [p.detach().clone() for p in model.parameters()]  # (fp32, as the engine's master shards)
    outside = nn.Linear(8, 8)
    torch.manual_seed(1)
    outside.reset_parameters()
    accumulation = settings.get("accumulation", 1)
    per_rank = [{"losses": [], "x_grads": [], "outside_grads": []} for _ in range(WORLD)]
    held = [None] * len(list(model.parameters()))
    for step in range(STEPS):
        grads = []
        for r in range(WORLD):
            m = copy.deepcopy(model)
            with torch.no_grad():
                for p, master in zip(m.parameters(), masters):
                    p.copy_(master)
            m = m.to(torch.bfloat16) if mp else m
            x, noise, y = _batches(r)[step]
            x = x.clone().requires_grad_(True)
            o = copy.deepcopy(outside)
            if settings.get("outside"):
                noise = o(noise)
            loss = m(x.to(torch.bfloat16) if mp else x, noise.to(torch.bfloat16) if mp else noise, y)
            params = list(m.parameters())
            (loss / accumulation).backward()
            grads.append([p.grad.float() for p in params])
            for p in params:
                p.grad = None
            per_rank[r]["losses"].append(loss.detach().float())
            per_rank[r]["x_grads"].append(x.grad)
            if settings.get("outside"):
                per_rank[r]["outside_grads"].append(o.weight.grad)
        combined = [sum(g[i] for g in grads) / (1 if settings.get("reduction") == "sum" else WORLD)
                    for i in range(len(held))]
        held = [c if h is None else h + c for h, c in zip(held, combined)]
        if (step + 1) % accumulation == 0:
            masters = [master.add(h, alpha=-LR) for master, h in zip(masters, held)]  # (torch.optim.SGD's update)
            held = [None] * len(held)
    return per_rank, {name: master for (name, _), master in zip(model.named_parameters(), masters)}


def _check(ranks: list[dict], settings: dict) -> None:
    want, want_state = _eager(settings)
    for rank, got in enumerate(ranks):
        assert torch.equal(got["losses"], torch.stack(want[rank]["losses"])), (rank, got["losses"], want[rank])
        for step, (g, w) in enumerate(zip(got["x_grads"], want[rank]["x_grads"])):
            assert g is not None and g.dtype == torch.float32, (rank, step)
            assert torch.equal(g, w), (rank, step, (g - w).abs().max())
        assert all(u is None for u in got["unused"])  # (as autograd leaves an input the loss does not read)
        for step, (g, w) in enumerate(zip(got["outside_grads"], want[rank]["outside_grads"])):
            assert torch.equal(g, w), (rank, step)
    for name, value in want_state.items():
        got = ranks[0]["state"][name]
        assert torch.equal(got, value.to(got.dtype)), name


@pytest.mark.parametrize("stage", [2, 3])
def test_an_input_that_requires_grad_gets_eagers_gradient(stage):
    settings = {"outside": True}
    _check(run_ranks(_train, WORLD, stage, settings, timeout_s=240), settings)


def test_input_gradients_with_bf16_summed_reduction_and_accumulation():
    """The gradient is of the loss `engine.backward` backpropagates (divided by the accumulation
    steps, as DeepSpeed's), in the input's own dtype through the program's cast to bf16; not
    multiplied by the world size that "sum" reduction runs the backward with."""
    settings = {"bf16": True, "reduction": "sum", "accumulation": 2}
    _check(run_ranks(_train, WORLD, 3, settings, timeout_s=240), settings)


def _by_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = ChooseModuleByRank()
    set_z3_leaf_modules(model, [ChooseModuleByRank])  # (as DeepSpeed's test: one unit, whichever layer runs)
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.SGD(lr=LR), cost_model=None))
    g = torch.Generator().manual_seed(30 + rank)
    x, y = torch.randn(4, 8, generator=g).requires_grad_(True), torch.randint(0, 8, (4,), generator=g)
    engine.backward(engine(x, y, rank))
    engine.step()
    return {"x_grad": x.grad, "state": engine.full_state_dict()}


def test_deepspeeds_choose_module_by_rank_model_trains_as_ddp():
    """Each rank's loss reaches one layer: the other rank's layer gets half this rank's gradient
    (DDP averages a zero in), and each rank's x.grad is its own."""
    ranks = run_ranks(_by_rank, WORLD, timeout_s=240)
    torch.manual_seed(0)
    model = ChooseModuleByRank()
    new = {k: v.clone() for k, v in model.state_dict().items()}
    for rank in range(WORLD):
        g = torch.Generator().manual_seed(30 + rank)
        x, y = torch.randn(4, 8, generator=g).requires_grad_(True), torch.randint(0, 8, (4,), generator=g)
        m = copy.deepcopy(model)
        m(x, y, rank).backward()
        assert torch.equal(ranks[rank]["x_grad"], x.grad), rank
        weight = m.linears[rank].weight
        new[f"linears.{rank}.weight"] = weight.detach().add(weight.grad / WORLD, alpha=-LR)
    for name, value in new.items():
        assert torch.equal(ranks[0]["state"][name], value), name
        assert torch.equal(ranks[1]["state"][name], value), name


class Embedded(nn.Module):
    """A model that takes `inputs_embeds` in place of ids, as Hugging Face's models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, ids=None, y=None, inputs_embeds=None):
        h = self.embed(ids) if inputs_embeds is None else inputs_embeds
        return F.cross_entropy(self.head(torch.tanh(self.body(h))).flatten(0, 1), y.flatten())


def _embedded_batches(rank: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(5 + rank)
    return [(torch.randint(0, 16, (2, 4), generator=g), torch.randint(0, 16, (2, 4), generator=g),
             0.01 * torch.randn(2, 4, 8, generator=g)) for _ in range(STEPS)]


def _adversarial(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    engine = fxzero.compile(Embedded(), fxzero.Config(stage=stage, optimizer=fxzero.SGD(lr=LR), cost_model=None))
    losses, deltas = [], []
    for ids, y, delta in _embedded_batches(rank):
        delta = delta.clone().requires_grad_(True)
        loss = engine(inputs_embeds=engine.module.embed(ids) + delta, y=y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        deltas.append(delta.grad)
    return {"losses": torch.stack(losses), "deltas": deltas, "state": engine.full_state_dict(),
            "placeholder_after": engine.module.embed.weight.is_meta}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_perturbed_embedding_trains_the_models_own_embedding_as_ddp(stage):
    """FreeLB-style adversarial training: the embeddings computed by the model's own module called
    directly, plus a perturbation whose gradient the caller reads. The gradient flows through the
    program into both; the embedding's is reduced as any other ([Note: gradients from outside the
    program]). At ZeRO-3 the direct call gathers the embedding's unit and holds it until the
    backward ([Note: calling a ZeRO-3 model directly]), a placeholder again after."""
    ranks = run_ranks(_adversarial, WORLD, stage, timeout_s=240)
    assert all(r["placeholder_after"] == (stage == 3) for r in ranks)
    torch.manual_seed(0)
    copies = [Embedded() for _ in range(WORLD)]
    for c in copies[1:]:
        c.load_state_dict(copies[0].state_dict())
    for step in range(STEPS):
        grads = []
        for rank, m in enumerate(copies):
            ids, y, delta = _embedded_batches(rank)[step]
            delta = delta.clone().requires_grad_(True)
            loss = m(inputs_embeds=m.embed(ids) + delta, y=y)
            loss.backward()
            assert torch.equal(ranks[rank]["losses"][step], loss.detach()), (rank, step)
            assert torch.equal(ranks[rank]["deltas"][step], delta.grad), (rank, step)
            grads.append([p.grad for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        with torch.no_grad():
            for i, params in enumerate(zip(*(m.parameters() for m in copies))):
                mean = sum(g[i] for g in grads) / WORLD
                for p in params:
                    p.add_(mean, alpha=-LR)
    for name, value in copies[0].state_dict().items():
        assert torch.equal(ranks[0]["state"][name], value), name


def _two_lengths(rank: int, world_size: int) -> dict:
    """Two sequence lengths: the second call compiles a program with symbolic sizes, from aliases
    of the inputs ([Note: what a program is compiled for]); the input that requires grad must stay
    one there."""
    torch.manual_seed(0)
    engine = fxzero.compile(Embedded(), fxzero.Config(stage=3, optimizer=fxzero.SGD(lr=LR), cost_model=None))
    grads = []
    for length in (4, 6, 5):
        g = torch.Generator().manual_seed(40 + rank + length)
        y = torch.randint(0, 16, (2, length), generator=g)
        embeds = torch.randn(2, length, 8, generator=g).requires_grad_(True)
        engine.backward(engine(inputs_embeds=embeds, y=y))
        grads.append(embeds.grad)
    return {"grads": grads}


def test_an_input_that_requires_grad_keeps_its_gradient_in_a_program_of_any_size():
    ranks = run_ranks(_two_lengths, WORLD, timeout_s=240)
    torch.manual_seed(0)
    model = Embedded()
    for rank, got in enumerate(ranks):
        for i, length in enumerate((4, 6, 5)):
            g = torch.Generator().manual_seed(40 + rank + length)
            y = torch.randint(0, 16, (2, length), generator=g)
            embeds = torch.randn(2, length, 8, generator=g).requires_grad_(True)
            model(inputs_embeds=embeds, y=y).backward()
            assert got["grads"][i] is not None, (rank, length)
            assert torch.equal(got["grads"][i], embeds.grad), (rank, length)

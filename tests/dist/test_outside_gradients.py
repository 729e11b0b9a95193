"""Gradients from outside the programs ([Note: gradients from outside the program] in
`fxzero/runtime/outside_grads.py`), on 2 ranks against eager PyTorch computed here.

- A forward the trace cannot follow, run eagerly at ZeRO-1/2 (and ZeRO-3 with every unit held
  whole): a reward model written as DeepSpeed-Chat's is (a loop over the batch's rows, each
  row's padding found with `nonzero().item()`), with a branch only rank 0's data takes, AdamW
  with weight decay, two micro-steps per update.
- A loss term through a submodule called directly, beside the engine's output (on one rank only
  in one step), and under a reentrant checkpoint, which hides it until its backward (an error).
- DeepSpeedExamples' GAN loop: both networks called directly, two backwards into one step for the
  discriminator, the generator's loss through the discriminator's module.
- At ZeRO-3 with sharded parameters, such a forward holds every unit gathered until its backward
  ends ([Note: a forward run eagerly at ZeRO-3]); ranks that would run one eagerly and one as a
  program raise instead of hanging.

The reference averages each backward's gradients over the ranks and adds them over the
backwards of a step, as the engine reduces them, so fp32 runs are compared bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import fxzero
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

HP = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS, MICRO = 2, 2
PAD = 0


class RewardModel(nn.Module):
    """A sequence scorer that reads its rows' padding in Python, as DeepSpeed-Chat's reward model."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.body = nn.Linear(8, 8)
        self.rare = nn.Linear(8, 8)  # used only for rows with token 11 (rank 0's data alone)
        self.head = nn.Linear(8, 1, bias=False)
        self.never = nn.Linear(8, 8)  # no gradient on any rank: the update skips it, as torch's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(ids)))
        scores = self.head(h).squeeze(-1)
        loss = scores.new_zeros(())
        for i in range(ids.shape[0]):
            pads = (ids[i] == PAD).nonzero()
            end = pads[0].item() if len(pads) > 0 else ids.shape[1]
            row = scores[i, :end]
            if (ids[i] == 11).any():
                row = row + self.rare(h[i, :end]).sum(-1)
            loss = loss - F.logsigmoid(row).mean()
        return loss / ids.shape[0]


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS * MICRO):
        ids = torch.randint(1, 11, (3, 6), generator=g)
        ids[0, 4:] = PAD
        ids[1, 2 + rank:] = PAD
        if rank == 0:
            ids[2, 1] = 11
        out.append(ids)
    return out


def _reward_model() -> RewardModel:
    torch.manual_seed(0)
    return RewardModel()


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 6), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1)


class Decides(nn.Module):
    """Reads a value in Python (`eager`), or not: the same arithmetic either way."""

    def __init__(self, eager: bool) -> None:
        super().__init__()
        self.eager = eager
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if not self.eager or x.sum().item() > -1e9 else 2.0
        return (self.b(torch.tanh(self.a(x))) * scale).square().mean()


def _gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(1)
    return Generator(), Discriminator()


def _gan_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(200 + rank)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)) for _ in range(STEPS)]


def _gan_iteration(netG, netD, backward_d, step_d, backward_g, step_g, real, noise) -> None:
    """DeepSpeedExamples' GAN loop body (training/gan/gan_deepspeed_train.py), in our words."""
    criterion = nn.BCELoss()
    netD.zero_grad()
    ones, zeros = torch.ones(real.shape[0]), torch.zeros(real.shape[0])
    backward_d(criterion(netD(real), ones))
    fake = netG(noise)
    backward_d(criterion(netD(fake.detach()), zeros))
    step_d()
    netG.zero_grad()
    backward_g(criterion(netD(fake), ones))
    step_g()


# -- the ranks -------------------------------------------------------------------------------


def _ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    for key, stage, threshold in ((1, 1, 0), (2, 2, 0), (3, 3, 10**6), ("3-sharded", 3, 0)):  # (3: every unit
        model = _reward_model()                                                         # held whole)
        engine = fxzero.compile(model, fxzero.Config(stage=stage, optimizer=fxzero.AdamW(**HP), cost_model=None,
                                                     persist_threshold=threshold, gradient_accumulation_steps=MICRO))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses, placeholders = [], []
            for ids in _batches(rank):
                loss = engine(ids)
                placeholders.append(sum(p.is_meta for p in model.parameters()))  # (held for the backward)
                engine.backward(loss)
                placeholders.append(sum(p.is_meta for p in model.parameters()))  # (released after it)
                engine.step()
                losses.append(loss.item())
        out["reward", key] = {"params": {k: v.clone() for k, v in model.state_dict().items()},
                              "losses": losses, "steps": engine.global_steps, "placeholders": placeholders,
                              "warnings": [str(w.message) for w in caught if "eagerly" in str(w.message)]}
        if key == "3-sharded":  # under no_grad (an evaluation): gathered for the call, placeholders after it
            with torch.no_grad():
                evaluated = engine(_batches(rank)[0])
            out["reward", "3-sharded", "eval"] = (evaluated.item(), sum(p.is_meta for p in model.parameters()))

    # The same model run eagerly and as a program (its Python decision made a constant) under
    # features that act on the gradients: clipping with local accumulation, gradients and
    # optimizer states in host memory, gradients summed over the ranks
    for name, extra in (("clip-local", dict(gradient_clipping=0.05, gradient_accumulation="local")),
                        ("offloaded", dict(offload=fxzero.Offload(optimizer=fxzero.Cpu(), grads=fxzero.Cpu()))),
                        ("summed", dict(gradient_reduction="sum"))):
        for mode in ("eager", "program"):
            torch.manual_seed(0)
            net = Decides(eager=mode == "eager")
            engine = fxzero.compile(net, fxzero.Config(stage=2, optimizer=fxzero.AdamW(**HP), cost_model=None,
                                                       **extra, gradient_accumulation_steps=MICRO))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for i in range(STEPS * MICRO):
                    engine.backward(engine(torch.full((2, 4), 0.1 * (i + 1) + rank)))
                    engine.step()
            out["alike", name, mode] = {k: v.clone() for k, v in net.state_dict().items()}

    # bf16 mixed precision, ZeRO-2: the inputs cast as the programs cast them, gradients reduced in fp32
    model = _reward_model()
    engine = fxzero.compile(model, fxzero.Config(stage=2, optimizer=fxzero.AdamW(**HP), cost_model=None,
                                                 mixed_precision=fxzero.MixedPrecision(param_dtype=torch.bfloat16),
                                                 gradient_accumulation_steps=MICRO))
    for ids in _batches(rank):
        engine.backward(engine(ids))
        engine.step()
    out["reward", "bf16"] = {k: v.clone() for k, v in engine.full_state_dict().items()}

    # float16 with a dynamic loss scale and accumulation: the first update's gradients overflow (the
    # loss made huge), so it is skipped on every rank; the second trains
    model = _reward_model()
    scale = fxzero.LossScale(initial_scale_power=8, hysteresis=1)
    fp16 = fxzero.MixedPrecision(param_dtype=torch.float16, loss_scale=scale)
    engine = fxzero.compile(model, fxzero.Config(stage=2, optimizer=fxzero.AdamW(**HP), cost_model=None,
                                                 mixed_precision=fp16, gradient_accumulation_steps=MICRO))
    for i, ids in enumerate(_batches(rank)):
        loss = engine(ids)
        engine.backward(loss * 1e6 if i < MICRO else loss)
        engine.step()
    out["reward", "fp16"] = {"params": {k: v.clone() for k, v in engine.full_state_dict().items()},
                             "skipped": engine.skipped_steps, "scale": engine.loss_scale}

    # a term through a submodule called directly, beside the engine's output
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    engine = fxzero.compile(net, fxzero.Config(stage=2, optimizer=fxzero.SGD(lr=0.1), cost_model=None))
    x = torch.arange(8.0).view(2, 4) / 8 + rank
    for step in range(STEPS):  # (the second step's term on rank 0 alone: rank 1 adds zeros)
        direct = net[0](x).square().sum() if step == 0 or rank == 0 else 0
        engine.backward(engine(x).sum() + direct)
        engine.step()
    out["aux"] = {k: v.clone() for k, v in net.state_dict().items()}
    try:  # (a reentrant checkpoint hides the parameters it reaches from the graph walked before the backward)
        region = torch.utils.checkpoint.checkpoint(net[0], x.clone().requires_grad_(), use_reentrant=True)
        engine.backward(engine(x).sum() + region.sum())
    except RuntimeError as e:
        out["reentrant"] = str(e)

    # DeepSpeedExamples' GAN, both networks under ZeRO-2 engines, called directly
    netG, netD = _gan_models()
    adam = fxzero.Adam(lr=2e-3, betas=(0.5, 0.999))
    engine_d = fxzero.compile(netD, fxzero.Config(stage=2, optimizer=adam, cost_model=None))
    engine_g = fxzero.compile(netG, fxzero.Config(stage=2, optimizer=adam, cost_model=None))
    for real, noise in _gan_data(rank):
        _gan_iteration(netG, netD, engine_d.backward, engine_d.step, engine_g.backward, engine_g.step, real, noise)
    out["gan"] = ({k: v.clone() for k, v in netG.state_dict().items() if "running" not in k},
                  {k: v.clone() for k, v in netD.state_dict().items()})

    # one rank's forward traces (a static length), the other's cannot: both raise, none hangs
    class Lengthwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 2 and x.sum().item() > 0:
                return self.lin(x).sum()
            return self.lin(x).mean()

    engine = fxzero.compile(Lengthwise(), fxzero.Config(stage=2, optimizer=fxzero.SGD(lr=0.1), cost_model=None,
                                                        collective_timeout=60))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine(torch.ones(4 if rank == 0 else 2, 3))
    except RuntimeError as e:
        out["split"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_ranks, 2, timeout_s=280)


@pytest.fixture(autouse=True)
def one_thread():
    """The references on one thread, as each rank computes: kernels then sum in the ranks' order
    (a gradient that is zero but for rounding, Adam turns into a whole step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the reference ---------------------------------------------------------------------------


def _averaged(grads_by_rank: list[list]) -> list:
    """Each parameter's gradient averaged over the ranks as the reduce-scatter does; zeros where a
    rank has none, None where no rank has one."""
    out = []
    for per_rank in zip(*grads_by_rank):
        if all(g is None for g in per_rank):
            out.append(None)
            continue
        like = next(g for g in per_rank if g is not None)
        total = None
        for g in per_rank:
            g = torch.zeros_like(like) if g is None else g
            total = g.clone() if total is None else total + g
        out.append(total / len(per_rank))
    return out


def _add(held: list, new: list) -> list:
    return [n if h is None else (h if n is None else h + n) for h, n in zip(held, new)]


def _reference_reward(applied: tuple[int, ...] = tuple(range(STEPS))) -> tuple[dict, list]:
    """The reward model trained on each rank's batches; only the updates in `applied` (the others
    skipped, their gradients dropped)."""
    model = _reward_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, **HP)
    data = [_batches(r) for r in range(2)]
    losses: list = [[], []]
    for step in range(STEPS):
        held = [None] * len(params)
        for micro in range(MICRO):
            per_rank = []
            for r in range(2):
                loss = model(data[r][step * MICRO + micro])
                losses[r].append(loss.item())
                per_rank.append(list(torch.autograd.grad(loss / MICRO, params, allow_unused=True)))
            held = _add(held, _averaged(per_rank))
        if step not in applied:
            continue
        for p, g in zip(params, held):
            p.grad = g
        opt.step()
    return model.state_dict(), losses


def test_a_forward_the_trace_cannot_follow_trains_eagerly_as_eager_pytorch(ranks):
    """Bit for bit at ZeRO-1, 2, 3 held whole and 3 sharded: the losses, and the weights after
    two updates (the branch only rank 0 takes trains from rank 0's gradient and rank 1's zeros;
    the layer no rank uses is left as it was, weight decay included)."""
    expected, losses = _reference_reward()
    initial = _reward_model().state_dict()
    for rank, result in enumerate(ranks):
        for key in (1, 2, 3, "3-sharded"):
            stage = 3 if key == "3-sharded" else key
            got = result["reward", key]
            assert got["steps"] == STEPS
            assert got["losses"] == losses[rank], (stage, rank)
            for name, value in expected.items():
                torch.testing.assert_close(got["params"][name], value, rtol=0, atol=0, msg=f"{stage} {name}")
            assert torch.equal(got["params"]["never.weight"], initial["never.weight"])
            assert not torch.equal(got["params"]["rare.weight"], initial["rare.weight"])
            (message,) = got["warnings"]  # (once per engine)
            assert message.startswith(f"[rank {rank}] the forward decides in Python on a size that depends on the "
                                      "data") and "test_outside_gradients.py" in message
            assert f"so fxzero runs this forward eagerly (ZeRO-{stage})" in message
        sharded = result["reward", "3-sharded"]
        n = len(list(_reward_model().parameters()))
        # held whole from the forward to the end of its backward, then placeholders again
        assert sharded["placeholders"] == [0, n] * (STEPS * MICRO)
        assert "every unit is gathered for it and held whole until its backward ends" in sharded["warnings"][0]
        loss, after = result["reward", "3-sharded", "eval"]
        assert after == n and loss == loss  # (under no_grad: released at the call's end)


@pytest.mark.parametrize("name", ["clip-local", "offloaded", "summed"])
def test_an_eager_forward_trains_as_the_same_model_as_a_program(ranks, name):
    """Clipping over local accumulation, gradients and optimizer states in host memory, and
    gradients summed over the ranks act on the gradients from outside the program as on a
    program's: the same weights bit for bit."""
    for result in ranks:
        eager, program = result["alike", name, "eager"], result["alike", name, "program"]
        for key, value in program.items():
            torch.testing.assert_close(eager[key], value, rtol=0, atol=0, msg=key)


def test_bf16_eager_forward_trains_with_fp32_masters(ranks):
    """Mixed precision: bf16 compute from bf16 inputs, fp32 masters; within bf16's resolution of
    the fp32 reference after two AdamW updates."""
    expected, _ = _reference_reward()
    for result in ranks:
        for name, value in expected.items():
            got = result["reward", "bf16"][name]
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, value, rtol=2e-2, atol=2e-2, msg=name)


def test_fp16_eager_forward_skips_an_overflowing_step_on_every_rank(ranks):
    """float16 with accumulation and a skipped step: the overflow is found in the gradients the
    eager backward left (checked as the programs check theirs), the scale backs off, and the
    weights are the reference's that skipped the first update, within float16's resolution."""
    expected, _ = _reference_reward(applied=(1,))
    for result in ranks:
        got = result["reward", "fp16"]
        assert got["skipped"] == 1 and got["scale"] == 2.0 ** 7
        for name, value in expected.items():
            torch.testing.assert_close(got["params"][name], value, rtol=2e-2, atol=2e-2, msg=name)


def test_a_term_through_a_submodule_called_directly_is_added_to_the_engines(ranks):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    xs = [torch.arange(8.0).view(2, 4) / 8 + r for r in range(2)]
    for step in range(STEPS):
        engine_terms = _averaged([list(torch.autograd.grad(net(x).sum(), params)) for x in xs])
        direct_terms = _averaged([list(torch.autograd.grad(net[0](x).square().sum(), params[:2])) + [None, None]
                                  if step == 0 or r == 0 else [None] * 4 for r, x in enumerate(xs)])
        for p, a, b in zip(params, engine_terms, direct_terms):
            p.grad = a if b is None else a + b  # (the engine's gradient shard, then the direct term's added)
        opt.step()
    for result in ranks:
        for name, value in net.state_dict().items():
            torch.testing.assert_close(result["aux"][name], value, rtol=0, atol=0, msg=name)


def test_a_term_under_a_reentrant_checkpoint_outside_the_engine_is_an_error_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        message = result["reentrant"]
        assert message.startswith(f"[rank {rank}] engine.backward(loss): the loss reached the model's parameters "
                                  "(0.weight, 0.bias) through a reentrant torch.utils.checkpoint region"), message
        assert "use_reentrant=False" in message


def test_deepspeed_examples_gan_loop_trains_both_networks(ranks):
    netG, netD = _gan_models()
    replicas = [copy.deepcopy(netG) for _ in range(2)]  # (the generator's BatchNorm statistics are per rank)
    opt_d = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    criterion = nn.BCELoss()
    data = [_gan_data(r) for r in range(2)]
    d_params, g_params = list(netD.parameters()), list(netG.parameters())
    for step in range(STEPS):
        for replica in replicas:  # (the shared weights into each rank's generator)
            with torch.no_grad():
                for p, q in zip(replica.parameters(), g_params):
                    p.copy_(q)
        real_terms, fake_terms, fakes = [], [], []
        for r, replica in enumerate(replicas):
            real, noise = data[r][step]
            n = real.shape[0]
            real_terms.append(list(torch.autograd.grad(criterion(netD(real), torch.ones(n)), d_params)))
            fakes.append(replica(noise))
            fake_terms.append(list(torch.autograd.grad(criterion(netD(fakes[-1].detach()), torch.zeros(n)),
                                                       d_params)))
        for p, g in zip(d_params, _add(_averaged(real_terms), _averaged(fake_terms))):  # (two backwards, one step)
            p.grad = g
        opt_d.step()
        g_terms = [list(torch.autograd.grad(criterion(netD(fake), torch.ones(fake.shape[0])),
                                            list(replica.parameters())))
                   for fake, replica in zip(fakes, replicas)]  # (through the updated discriminator)
        for p, g in zip(g_params, _averaged(g_terms)):
            p.grad = g
        opt_g.step()
    for result in ranks:
        got_g, got_d = result["gan"]
        for name, value in netD.state_dict().items():
            torch.testing.assert_close(got_d[name], value, rtol=0, atol=0, msg=name)
        for name, value in netG.state_dict().items():
            if "running" not in name and "num_batches" not in name:
                torch.testing.assert_close(got_g[name], value, rtol=0, atol=0, msg=name)


def test_ranks_running_one_eagerly_and_one_as_a_program_raise(ranks):
    for rank, result in enumerate(ranks):
        message = result["split"]
        assert message.startswith(f"[rank {rank}]") and "would issue different collectives" in message, message
        assert "run eagerly" in message

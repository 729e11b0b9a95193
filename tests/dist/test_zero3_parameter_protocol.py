"""What DeepSpeed programs do with ZeRO-3 parameters, on 2 ranks ([Note: the DeepSpeed attributes of
a parameter] in fxzero/runtime/user_module.py, [Note: a state_dict() on some ranks only] in
fxzero/runtime/agreement.py, [Note: parameters made beside a held model] in fxzero/zero.py):

- `hasattr(p, "ds_id")`, `ds_status`, `ds_shape`, `ds_numel`: which parameters to gather, and
  their whole size, alike on every rank; none at ZeRO-2;
- DeepSpeed-Chat's save: rank 0 alone takes the module's state dict (placeholders, said so),
  then every rank gathers each NOT_AVAILABLE parameter in turn for rank 0 to save: the values
  are the trained ones;
- a new embedding built on a zero.Init model's device before initialize and swapped in inside
  GatheredParameters (transformers' resize_token_embeddings at ZeRO-3): initialize shards the
  holder's values, and every rank's RNG ends where eager construction leaves it;
- the engine's throughput timer counts micro-steps, optimizer steps and epochs.

References are eager torch: the same model built eagerly after the same seed.
"""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.zero import ZeroParamStatus, param_status
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 60},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


class Net(nn.Module):
    """Units (items of a ModuleList, the root): the embedding at the root (96 values) and the
    hidden layer (144) sharded; the norm (32) and the head (51) under the persistence threshold
    of 60, held whole."""

    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, norm, out = self.layers
        return out(norm(torch.tanh(hidden(self.embed(ids))))).mean(dim=1)


def _rng() -> str:
    return hashlib.md5(torch.random.get_rng_state().numpy().tobytes()).hexdigest()


def _train(engine, rank: int, steps: int = 4) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        ids = torch.randint(0, 12, (2, 5), generator=g)
        engine.backward(engine(ids).square().mean())
        engine.step()


def _to_fetch(params) -> list:
    return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def _attributes_and_save(rank: int, world_size: int) -> dict:
    out: dict = {}
    torch.manual_seed(0)
    engine, *_ = fxzero.initialize(model=Net(), config=DS)
    model = engine.module
    _train(engine, rank, steps=8)
    out["attrs"] = {n: (p.ds_id, tuple(p.ds_shape), p.ds_numel, p.ds_status, p.ds_persist, param_status(p))
                    for n, p in model.named_parameters()}
    with fxzero.zero.GatheredParameters(_to_fetch(model.parameters())):
        out["inside"] = {n: p.ds_status for n, p in model.named_parameters()}
    out["after"] = {n: p.ds_status for n, p in model.named_parameters()}
    # DeepSpeed-Chat's save at ZeRO-3: rank 0 alone saves the module's state dict first
    if rank == 0:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            lone = model.state_dict()
        out["lone_meta"] = sorted(k for k, v in lone.items() if v.is_meta)
        out["lone_warning"] = [str(w.message) for w in seen if "on some ranks only" in str(w.message)]
    saved, storage = {}, {}
    for name, p in model.named_parameters():
        with fxzero.zero.GatheredParameters(_to_fetch([p]), enabled=hasattr(p, "ds_id")):
            value = p.data.cpu()  # (DeepSpeed-Chat's: on a CPU rank the tensor itself, kept past the block)
        saved[name] = value.clone()
        storage[name] = value.untyped_storage().nbytes() == value.numel() * value.element_size()
    out["saved"], out["own_storage"] = saved, storage
    out["full"] = engine.full_state_dict()
    out["everyone"] = {k: v.clone() for k, v in model.state_dict().items()}  # (every rank: gathered)
    timer = engine.tput_timer
    timer.update_epoch_count()
    out["timer"] = (timer.global_step_count, timer.micro_step_count, timer.epoch_count, timer.avg_samples_per_sec(),
                    timer.batch_size)
    torch.manual_seed(0)
    stage2, *_ = fxzero.initialize(model=Net(), config={**DS, "zero_optimization": {"stage": 2}})
    out["stage2_ds_id"] = [hasattr(p, "ds_id") for p in stage2.module.parameters()]
    return out


@pytest.fixture(scope="module")
def saved_runs():
    return run_ranks(_attributes_and_save, 2, timeout_s=240)


def test_zero3_parameters_carry_deepspeeds_attributes_alike_on_every_rank(saved_runs):
    eager = Net()
    shapes = {n: tuple(p.shape) for n, p in eager.named_parameters()}
    persistent = {"layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias"}
    ranks = saved_runs
    assert ranks[0]["attrs"] == ranks[1]["attrs"]
    attrs = ranks[0]["attrs"]
    assert sorted(a[0] for a in attrs.values()) == list(range(len(shapes)))
    for name, (_, shape, numel, status, persist, status_fn) in attrs.items():
        assert shape == shapes[name] and numel == torch.Size(shape).numel()
        assert persist == (name in persistent) and status is status_fn
        assert status is (ZeroParamStatus.AVAILABLE if persist else ZeroParamStatus.NOT_AVAILABLE), name
    for r in ranks:
        assert set(r["inside"].values()) == {ZeroParamStatus.AVAILABLE}
        assert r["after"] == {n: a[3] for n, a in attrs.items()}
        assert r["stage2_ds_id"] == [False] * len(shapes)  # (DeepSpeed's ZeRO-1/2 parameters have none)


def test_deepspeed_chats_save_rank0_state_dict_then_the_gather_loop(saved_runs):
    r0 = saved_runs[0]
    sharded = ["embed.weight", "layers.0.bias", "layers.0.weight"]
    assert r0["lone_meta"] == sharded  # (placeholders, as DeepSpeed's empty ones)
    assert len(r0["lone_warning"]) == 1 and r0["lone_warning"][0].startswith("[rank 0]")
    for r in saved_runs:
        # (each gathered parameter its own tensor: a view of its unit's gathered buffer kept the whole
        # unit alive, and torch.save wrote the whole unit for each parameter, 12x DeepSpeed-Chat's file)
        assert all(r["own_storage"][n] for n in sharded), r["own_storage"]
        assert set(r["saved"]) == set(r["full"])
        for name, value in r["saved"].items():
            assert torch.equal(value, r["full"][name]), name  # the trained fp32 values
            assert torch.equal(r["everyone"][name], value), name  # (and state_dict() on every rank gathers)


def test_the_throughput_timer_counts_as_deepspeeds(saved_runs):
    for r in saved_runs:
        steps, micro, epochs, rate, batch = r["timer"]
        assert (steps, micro, epochs, batch) == (4, 0, 1, 2 * 2 * 2)  # (8 micro-steps, 2 per update; epoch reset)
        assert 0 < rate < float("inf")  # (DeepSpeed's: the samples of the steps after its first 2, over their time)


def _resized(rank: int, world_size: int) -> dict:
    """transformers' resize_token_embeddings at ZeRO-3, before initialize: the model loaded on
    rank 0 through GatheredParameters, a bigger embedding built on the old one's device (the CPU
    on the holder, the meta device elsewhere), filled and swapped in inside GatheredParameters."""
    torch.manual_seed(5)
    with fxzero.zero.Init(config_dict_or_path=DS):
        model = Net()
    with torch.no_grad(), fxzero.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            for p in model.parameters():
                p.fill_(0.5)  # (a checkpoint's values)
    old = model.embed
    new = nn.Embedding(15, 8, device=old.weight.device)  # (draws normal_ where it is real)
    out = {"rng_built": _rng(), "new_meta": new.weight.is_meta}
    with torch.no_grad(), fxzero.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
        new.weight[:12] = old.weight
        out["inside"] = new.weight.clone()
    with fxzero.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
        old.weight = new.weight
        old.num_embeddings = 15
    out["rng_gathered"] = _rng()
    engine, *_ = fxzero.initialize(model=model, config=DS)
    out["rng_initialized"] = _rng()
    out["full"] = engine.full_state_dict()
    return out


def test_a_new_embedding_beside_a_held_model_comes_from_the_holder():
    torch.manual_seed(5)
    eager = Net()
    eager_new = nn.Embedding(15, 8)
    eager_rng = _rng()
    want = eager_new.weight.detach().clone()
    want[:12] = 0.5
    ranks = run_ranks(_resized, 2, timeout_s=240)
    assert [r["new_meta"] for r in ranks] == [False, True]  # (rank 1 built it on the meta device: drew nothing)
    assert ranks[0]["rng_built"] == eager_rng != ranks[1]["rng_built"]
    for r in ranks:
        assert torch.equal(r["inside"], want)
        assert r["rng_gathered"] == eager_rng and r["rng_initialized"] == eager_rng
        assert torch.equal(r["full"]["embed.weight"], want)
        assert all(torch.equal(v, torch.full_like(v, 0.5)) for k, v in r["full"].items() if k != "embed.weight")


class _RewardLike(nn.Module):
    """A head built around a model from zero.Init after its loading (DeepSpeed-Chat's reward model)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(ids))


def _wrapped(rank: int, world_size: int) -> dict:
    torch.manual_seed(5)
    with fxzero.zero.Init(config_dict_or_path=DS):
        body = Net()
    with torch.no_grad(), fxzero.zero.GatheredParameters(list(body.parameters()), modifier_rank=0):
        if rank == 0:
            for p in body.parameters():
                p.fill_(0.5)
    model = _RewardLike(body)  # (its head real on every rank, drawn alike)
    engine, *_ = fxzero.initialize(model=model, config=DS)
    out = {"full": engine.full_state_dict()}
    torch.manual_seed(0)
    with torch.device("meta") if rank == 1 else torch.device("cpu"):
        lopsided = Net()  # (values on rank 0, none on rank 1)
    try:
        fxzero.initialize(model=lopsided, config=DS)
    except RuntimeError as e:
        out["lopsided"] = str(e)
    return out


def test_a_wrapper_around_a_held_model_takes_the_holders_values_and_lopsided_models_are_refused():
    """Before: rank 0 (holding the body) broadcast its values while rank 1 (meta) replayed an init,
    each waiting in its own collective until the 300 s timeout."""
    torch.manual_seed(5)
    Net()
    head = nn.Linear(3, 1)  # (drawn where the wrapper drew it: after the body's construction)
    ranks = run_ranks(_wrapped, 2, timeout_s=240)
    for rank, r in enumerate(ranks):
        full = r["full"]
        assert torch.equal(full["head.weight"], head.weight.detach()) and torch.equal(full["head.bias"], head.bias.detach())
        assert all(torch.equal(v, torch.full_like(v, 0.5)) for k, v in full.items() if k.startswith("body."))
        message = r["lopsided"]
        assert message.startswith(f"[rank {rank}] the ranks' models would take their values from different places")
        assert "ranks [0]: rank 0's model, broadcast" in message and "ranks [1]: the model's own init, replayed" in message


class TiedNet(Net):
    """Net with a head tied to the embedding (a language model's)."""

    def __init__(self, vocab: int = 12) -> None:
        super().__init__(vocab)
        self.head = nn.Linear(8, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).mean(dim=1)[:, :3] + super().forward(ids)


def _loaded_tied_on_holder(rank: int) -> nn.Module:
    """from_pretrained of a checkpoint holding both the embedding and its tied head (a .bin writes
    both names) at ZeRO-3: transformers ties the pair where it can compare their values (the
    holder) and skips it where both are on the meta device (the other ranks)."""
    torch.manual_seed(5)
    with fxzero.zero.Init(config_dict_or_path=DS):
        model = TiedNet()
    with torch.no_grad(), fxzero.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            for p in model.parameters():
                p.fill_(0.5)
    if rank == 0:
        model.head.weight = model.embed.weight
    return model


def _tied(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = _loaded_tied_on_holder(rank)
    out["tied_before"] = model.head.weight is model.embed.weight
    engine, *_ = fxzero.initialize(model=model, config=DS)
    out["tied_after"] = model.head.weight is model.embed.weight
    _train(engine, rank)
    out["full"] = engine.full_state_dict()
    torch.manual_seed(5)
    eager = TiedNet()  # (the same model built with values on every rank, tied by its own code)
    with torch.no_grad():
        for p in eager.parameters():
            p.fill_(0.5)
    eager.head.weight = eager.embed.weight
    engine, *_ = fxzero.initialize(model=eager, config=DS)
    _train(engine, rank)
    out["eager_full"] = engine.full_state_dict()
    # transformers' resize_token_embeddings: the embedding's weight replaced (the head still holds
    # the old one, tied), then the head's weight gathered: every rank must gather the same thing
    model = _loaded_tied_on_holder(rank)
    old = model.embed
    new = nn.Embedding(16, 8, device=old.weight.device)
    with torch.no_grad(), fxzero.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
        new.weight[:12] = old.weight
    with fxzero.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
        old.weight = new.weight
    with fxzero.zero.GatheredParameters([model.head.weight], modifier_rank=None):
        out["old_head"] = model.head.weight.clone()
    return out


def test_weights_tied_on_the_holder_alone_are_tied_on_every_rank():
    """Before: rank 1's model had one parameter more than rank 0's, and initialize waited in
    mismatched collectives until the timeout; the head gathered after the embedding was replaced
    was the held model's on rank 1 and a loose parameter on rank 0 (the same wait)."""
    ranks = run_ranks(_tied, 2, timeout_s=240)
    assert [r["tied_before"] for r in ranks] == [True, False]
    for r in ranks:
        assert r["tied_after"]
        assert set(r["full"]) == set(r["eager_full"])
        assert torch.equal(r["full"]["head.weight"], r["full"]["embed.weight"])  # (one parameter, trained once)
        for name, value in r["eager_full"].items():
            assert torch.equal(r["full"][name], value), name
        assert torch.equal(r["old_head"], torch.full((12, 8), 0.5))

"""Random layer-token drop in one process: the scheduler against DeepSpeed's fixed_linear formula
written out, the routed layer against DeepSpeed's Python semantics (its CUDA kernels' gather,
scatter and their backward, written here as loops), the mask for each model type and hidden
state order, the refusals, and a checkpoint resumed mid-schedule. DeepSpeed itself cannot run
random-LTD on this CPU machine (its ops/random_ltd are CUDA kernels), so its semantics are the
reference: `runtime/data_pipeline/data_routing/{basic_layer,scheduler}.py`, `ops/random_ltd/
dropping_utils.py` and its `utils.py`'s bsh_decoder_gather / bsh_decoder_scatter loops."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.runtime.random_ltd.helper import convert_to_random_ltd, remove_random_ltd_state_dict, save_without_random_ltd
from fxzero.runtime.random_ltd.layer import RandomLayerTokenDrop, route_in_place
from fxzero.runtime.random_ltd.scheduler import RandomLTDScheduler

transformers = pytest.importorskip("transformers")


def ltd_config(min_value=4, max_value=12, require=6, step=2, ids=(0, 1), total=3, mask="attention_mask",
               kind="decoder", order="batch_seq_dim", batch=2) -> dict:
    return {"enabled": True, "total_layer_num": total, "random_ltd_layer_num": len(ids),
            "random_ltd_layer_id": list(ids), "model_mask_name": mask, "model_type": kind,
            "hidden_state_order": order, "global_batch_size": batch, "micro_batch_size": batch,
            "random_ltd_schedule": {"min_value": min_value, "max_value": max_value, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": require, "seq_per_step": step}},
            "layer_token_lr_schedule": {"enabled": False}}


# -- the scheduler ------------------------------------------------------------------------------

def test_the_kept_count_follows_fixed_linear_and_counts_layer_tokens_once_per_step():
    scheduler = RandomLTDScheduler(ltd_config(min_value=128, max_value=1024, require=400, step=8, ids=(1, 2, 3),
                                              total=12, batch=4))
    consumed = 0
    for step in range(450):
        for _ in range(2):  # two micro-steps of one optimizer step: counted once
            scheduler.update_seq(step)
        value = int(128 + step / 400 * (1024 - 128))
        want = min(1024, value - value % 8)
        assert scheduler.get_current_seq() == want, step
        consumed += 4 * (want * 3 + 1024 * 9)
        assert scheduler.state["consumed_layer_tokens"] == consumed
    assert scheduler.get_current_seq() == 1024
    saved = scheduler.state_dict()
    assert saved == {"consumed_layer_tokens": consumed, "current_steps": 449, "current_value": 1024,
                     "min_value": 128, "max_value": 1024}
    fresh = RandomLTDScheduler(ltd_config(min_value=128, max_value=1024, require=400, step=8, ids=(1, 2, 3),
                                          total=12, batch=4))
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved and fresh.get_random_ltd_layer_num() == 3 and fresh.model_layer_num == 12


def test_layer_token_lr_schedule_is_refused_as_deepspeed_refuses_it():
    config = ltd_config()
    config["layer_token_lr_schedule"] = {"enabled": True}
    with pytest.raises(ValueError, match="layer_token_lr_schedule is not implemented"):
        RandomLTDScheduler(config)


# -- the routed layer against DeepSpeed's semantics ----------------------------------------------

class Toy(nn.Module):
    """A layer of the routed kind: hidden states first, an optional mask, a tuple out."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.masks: list = []

    def forward(self, x, cache=None, attention_mask=None):
        self.masks.append(attention_mask)
        return torch.tanh(self.lin(x)), "extra"


def deepspeed_draw(kept: int, seq: int, batch: int, layers: int) -> torch.Tensor:
    """gpt_sample_tokens: multinomial over ones, [layers, batch, kept], each row sorted (token_sort_)."""
    drawn = torch.multinomial(torch.ones(layers * batch, seq), kept)
    return drawn.reshape(layers, batch, kept).sort(dim=-1).values


def deepspeed_layer(layer: nn.Module, hidden: torch.Tensor, idx: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """GatherTokens, the layer, ScatterTokens, as bsh_decoder_gather / bsh_decoder_scatter's loops."""
    h = hidden if batch_first else hidden.transpose(0, 1)
    part = torch.cat([h[k:k + 1, idx[k], :] for k in range(h.shape[0])])
    out = layer(part if batch_first else part.transpose(0, 1))[0]
    out = out if batch_first else out.transpose(0, 1)
    merged = h.clone()
    for k in range(h.shape[0]):
        merged[k, idx[k], :] = out[k]
    return merged if batch_first else merged.transpose(0, 1)


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_a_routed_layer_is_deepspeeds_gather_layer_scatter_forward_and_backward(order):
    torch.manual_seed(0)
    layers = nn.ModuleList(RandomLayerTokenDrop(Toy()) for _ in range(2))
    reference = nn.ModuleList(Toy() for _ in range(2))
    reference.load_state_dict(remove_random_ltd_state_dict(layers.state_dict()))
    scheduler = RandomLTDScheduler(ltd_config(min_value=6, max_value=12, order=order, mask=None))
    scheduler.update_seq(0)
    for number, layer in enumerate(layers):
        layer.init_config(ltd_config(min_value=6, max_value=12, order=order, mask=None), scheduler, number)
    batch_first = order == "batch_seq_dim"
    x = torch.randn((3, 10, 8) if batch_first else (10, 3, 8), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    torch.manual_seed(5)
    h = x
    for layer in layers:
        out = layer(h)
        assert out[1] == "extra"  # (a tuple's other items pass through)
        h = out[0]
    torch.manual_seed(5)
    idx = deepspeed_draw(6, 10, 3, 2)
    assert torch.equal(scheduler.state["sample_idx"], idx)  # (DeepSpeed's place for the draw, on an eager call)
    h_ref = x_ref
    for number, layer in enumerate(reference):
        h_ref = deepspeed_layer(layer, h_ref, idx[number], batch_first)
    assert torch.equal(h, h_ref)
    weights = torch.randn_like(h)
    (h * weights).sum().backward()
    (h_ref * weights).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for got, want in zip(layers, reference):
        assert torch.equal(got.random_ltd_layer.lin.weight.grad, want.lin.weight.grad)
    layers.eval()  # (eval: every token through every layer)
    assert torch.equal(layers[0](x)[0], reference[0](x)[0])


def test_a_decoder_mask_is_sliced_and_an_encoder_mask_gathered_at_each_layers_tokens():
    torch.manual_seed(0)
    for kind in ("decoder", "encoder"):
        config = ltd_config(min_value=5, max_value=9, step=1, kind=kind)
        scheduler = RandomLTDScheduler(config)
        scheduler.update_seq(0)
        layers = [route_in_place(Toy()) for _ in range(2)]
        for number, layer in enumerate(layers):
            layer.init_config(config, scheduler, number)
        mask = torch.randn(2, 1, 9, 9)
        h = torch.randn(2, 9, 8)
        torch.manual_seed(3)
        for layer in layers:
            h = layer(h, None, mask)[0]  # (the mask positional, as Hugging Face's GPT-2 passes it)
        torch.manual_seed(3)
        idx = deepspeed_draw(5, 9, 2, 2)
        for number, layer in enumerate(layers):
            got = layer.masks[-1]
            if kind == "decoder":
                assert torch.equal(got, mask[:, :, :5, :5])
            else:  # bert_sample_tokens: rows then columns at each sample's kept tokens
                want = torch.cat([mask[i:i + 1, :, idx[number][i], :][:, :, :, idx[number][i]] for i in range(2)])
                assert torch.equal(got, want)


def test_what_a_routed_layer_cannot_route_is_an_error_naming_it():
    config = ltd_config(min_value=4, max_value=8, mask="mask_please")
    scheduler = RandomLTDScheduler(config)
    layer = route_in_place(Toy())
    layer.init_config(config, scheduler, 0)
    with pytest.raises(ValueError, match="model_mask_name 'mask_please'.*parameters: \\['x', 'cache', 'attention_mask'\\]"):
        layer(torch.randn(2, 8, 8))
    encoder = ltd_config(min_value=4, max_value=8, kind="encoder")
    layer.init_config(encoder, RandomLTDScheduler(encoder), 0)
    with pytest.raises(ValueError, match="\"encoder\" needs the layer's attention mask"):
        layer(torch.randn(2, 8, 8))
    with pytest.raises(ValueError, match="hidden states of 3 dims"):
        layer(torch.randn(8, 8))
    with pytest.raises(ValueError, match="hidden_state_order 'seq_first'"):
        layer.init_config(ltd_config(order="seq_first"), scheduler, 0)
    with pytest.raises(ValueError, match="model_type 'encoder-decoder'"):
        layer.init_config(ltd_config(kind="encoder-decoder"), scheduler, 0)


# -- through the engine -------------------------------------------------------------------------

def _gpt2(attention: str = "sdpa"):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0, use_cache=False)
    config._attn_implementation = attention
    return transformers.GPT2LMHeadModel(config)


def _deepspeed(ids=(1,), layers=1, **ltd) -> dict:
    section = {"enabled": True, "total_layer_num": 3, "random_ltd_layer_num": layers, "random_ltd_layer_id": list(ids),
               "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
               "random_ltd_schedule": {"min_value": 4, "max_value": 10, "schedule_type": "fixed_linear",
                                       "schedule_config": {"require_steps": 4, "seq_per_step": 2}}, **ltd}
    return {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"},
            "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": section}}}


def _engine(config, attention="sdpa"):
    model = _gpt2(attention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


BLOCK = "GPT2Block"


def test_convert_to_random_ltd_takes_the_engine_of_a_config_that_enables_it():
    gpt2 = transformers.models.gpt2.modeling_gpt2
    with pytest.raises(TypeError, match="takes the engine deepspeed.initialize returned"):
        convert_to_random_ltd(_gpt2(), gpt2.GPT2Block)
    plain = _deepspeed()
    del plain["data_efficiency"]
    with pytest.raises(ValueError, match="does not enable random-LTD; set data_efficiency.data_routing.random_ltd"):
        convert_to_random_ltd(_engine(plain), gpt2.GPT2Block)
    with pytest.raises(ValueError, match=r"random_ltd_layer_num is 2, and random_ltd_layer_id \[1, 7\] matched 1"):
        convert_to_random_ltd(_engine(_deepspeed(ids=(1, 7), layers=2)), gpt2.GPT2Block)


def test_converted_in_place_the_model_keeps_its_names_and_a_materialized_mask_is_sliced():
    """Eager attention materializes GPT-2's causal mask, which the routed block receives
    positionally: the program slices it to the kept tokens (as DeepSpeed's decoder path), and
    the routed step equals the unconverted model's where the schedule keeps every token."""
    gpt2 = transformers.models.gpt2.modeling_gpt2
    engine = _engine(_deepspeed(), attention="eager")
    names = [n for n, _ in engine.module.named_parameters()]
    engine = convert_to_random_ltd(engine, gpt2.GPT2Block)
    assert [n for n, _ in engine.module.named_parameters()] == names
    assert all(isinstance(b, RandomLayerTokenDrop) and isinstance(b, gpt2.GPT2Block) for b in engine.module.transformer.h)
    assert list(save_without_random_ltd(engine)) == list(_gpt2().state_dict())
    seen = []
    hook = engine.module.transformer.h[1].attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((str(args[0].shape), str(kwargs["attention_mask"].shape))),
        with_kwargs=True)
    ids = torch.randint(0, 32, (2, 10))
    engine.backward(engine(input_ids=ids, labels=ids).loss)  # (traced: the hook sees the trace's sizes)
    hook.remove()
    kept = engine.program.shapes.shapes[-1]  # (the kept count's carrier, the call's last input: one symbolic dim)
    assert len(kept) == 1 and isinstance(kept[0], str), engine.program.shapes.describe()
    assert seen and set(seen) == {(f"torch.Size([2, {kept[0]}, 16])", f"torch.Size([2, 1, {kept[0]}, {kept[0]}])")}
    assert engine.random_ltd_scheduler.get_current_seq() == 4
    engine.step()
    engine.eval()  # (eval routes nothing: the trained model's own evaluation)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    plain = _gpt2("eager")
    plain.load_state_dict(save_without_random_ltd(engine))
    with torch.no_grad():
        torch.testing.assert_close(logits, plain.eval()(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    assert engine.random_ltd_scheduler.get_current_seq() == 4  # (the schedule steps in training forwards only)


def test_a_checkpoint_resumes_the_schedule_and_the_draws(tmp_path):
    """Six steps straight, or three, a checkpoint, a new engine loading it and three more: the same
    kept counts, layer-tokens and losses (the RNG states restored, so the same tokens)."""
    gpt2 = transformers.models.gpt2.modeling_gpt2
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 32, (2, 10), generator=g) for _ in range(6)]

    def run(engine, batches):
        out = []
        for ids in batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            out.append((engine.random_ltd_scheduler.get_current_seq(),
                        engine.random_ltd_scheduler.state["consumed_layer_tokens"], loss.item()))
        return out

    torch.manual_seed(11)
    straight = run(convert_to_random_ltd(_engine(_deepspeed()), gpt2.GPT2Block), data)
    assert [k for k, _, _ in straight] == [4, 4, 6, 8, 10, 10]
    torch.manual_seed(11)
    first = convert_to_random_ltd(_engine(_deepspeed()), gpt2.GPT2Block)
    resumed = run(first, data[:3])
    first.save_checkpoint(str(tmp_path))
    torch.manual_seed(12345)  # (the checkpoint's RNG state, not this one, draws the next tokens)
    second = convert_to_random_ltd(_engine(_deepspeed()), gpt2.GPT2Block)
    assert second.random_ltd_scheduler.get_current_seq() == 4
    second.load_checkpoint(str(tmp_path))
    assert second.random_ltd_scheduler.state_dict() == first.random_ltd_scheduler.state_dict()
    resumed += run(second, data[3:])
    assert resumed == straight


class SeqFirst(nn.Module):
    """A ViT-like stack whose layers take [seq, batch, hidden] (torch's TransformerEncoderLayer
    unbatched-first) and no mask: the cifar config's model_mask_name null, order seq_batch_dim."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).transpose(0, 1)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h.transpose(0, 1)).flatten(0, 1), labels.flatten())


def test_seq_batch_hidden_states_without_a_mask_train_as_eager_on_the_same_tokens():
    config = _deepspeed(model_mask_name=None, hidden_state_order="seq_batch_dim")
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    config["gradient_clipping"] = 0  # (DeepSpeed's default clips at 1.0)
    model = SeqFirst()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = fxzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine = convert_to_random_ltd(engine, nn.TransformerEncoderLayer)
    reference = SeqFirst()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    routed = reference.layers[1]
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(21)
    for step in range(6):
        ids = torch.randint(0, 32, (3, 10), generator=g)
        rng = torch.get_rng_state()
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        kept = engine.random_ltd_scheduler.get_current_seq()
        draws = None
        if kept < 10:
            torch.set_rng_state(rng)
            draws = deepspeed_draw(kept, 10, 3, 1)[0]
        h = reference.embed(ids).transpose(0, 1)
        for layer in reference.layers:
            if layer is routed and draws is not None:  # (seq first: the kept tokens of column b are rows idx[b])
                cols = torch.arange(3)[None, :]
                part = layer(h[draws.t(), cols])
                h = h.clone()
                h[draws.t(), cols] = part
            else:
                h = layer(h)
        want = nn.functional.cross_entropy(reference.head(h.transpose(0, 1)).flatten(0, 1), ids.flatten())
        want.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-6, atol=0)
    state = engine.full_state_dict()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=1e-6, msg=name)
    assert [len(engine._cache)] == [2]  # (routed steps and the full-length ones)


def test_a_config_enabling_random_ltd_without_converting_trains_every_token_and_says_so():
    engine = _engine(_deepspeed())
    ids = torch.randint(0, 32, (2, 10))
    with pytest.warns(fxzero.config.notices.IneffectiveSetting, match="no layer routes.*convert_to_random_ltd"):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    assert engine.random_ltd_scheduler.get_current_seq() == 4 and engine.random_ltd_enabled()


def test_a_layer_routed_in_place_deep_copies_and_pickles_routed():
    import copy
    import pickle

    config = ltd_config(min_value=4, max_value=8, mask=None)
    layer = route_in_place(Toy())
    layer.init_config(config, RandomLTDScheduler(config), 0)
    for again in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(again) is type(layer) and isinstance(again, Toy) and again.random_ltd_layer_id == 0
        torch.testing.assert_close(again.lin.weight, layer.lin.weight)
        torch.manual_seed(0)
        want = layer(torch.ones(2, 8, 8))[0]
        torch.manual_seed(0)
        torch.testing.assert_close(again(torch.ones(2, 8, 8))[0], want, rtol=0, atol=0)

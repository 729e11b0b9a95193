"""Hugging Face models called the HF way, on 2 ranks at ZeRO-3: `input_ids=`, `attention_mask=`
with padding and `labels=` with -100 at the padded positions (GPT-2, Llama, Mixtral's mixture of
experts, BERT; `pixel_values=`, `labels=` for ResNet), trained through `out.loss`, against eager AdamW doing what DDP does (each step the mean
of the ranks' micro-batch losses; for ResNet that also keeps BatchNorm's statistics per rank);
then an evaluation under no_grad (a forward-only program) against eager evaluation of the same
parameters. Small configs, random init, no downloads; units found automatically (the decoder or
encoder layer lists, ResNet's stages). GPT-2, Llama and Mixtral return a KV cache by default (use_cache
is left on): it is dropped with one warning naming it, and the training is the eager one.

[Note: evaluation is exact on one thread count]
Eval logits are compared bit for bit, which holds for the same kernels run on the same number of
threads: a convolution's reduction is split over the intra-op threads, so ResNet's logits move by
an ulp between 1 and 2 threads (eager against eager). The ranks run on 1 thread each (the
harness), the pytest process on the machine's count; so each rank reports its thread count and
the eager evaluation runs on that many, whatever the machine has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

import fxzero
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.reference import assert_losses_close, eager_hf_losses, hf_rows

pytestmark = pytest.mark.timeout(400)
transformers = pytest.importorskip("transformers")

STEPS, ROWS, SEQ = 5, 4, 16


def _build(name: str):
    t = transformers
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                              resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                num_attention_heads=2, num_key_value_heads=2, vocab_size=256))
    if name == "mixtral":  # (a mixture of experts; its batched experts: see tests/passes/test_hf_moe.py)
        model = t.MixtralForCausalLM(t.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                                     num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
                                                     num_local_experts=4, num_experts_per_tok=2))
        model.set_experts_implementation("batched_mm")
        return model
    if name == "bert":
        return t.BertForMaskedLM(t.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                              num_attention_heads=2, vocab_size=256, hidden_dropout_prob=0,
                                              attention_probs_dropout_prob=0))
    return t.ResNetForImageClassification(t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                         num_labels=10))


MODELS = ("gpt2", "llama", "mixtral", "bert", "resnet")


def _batches(name: str, seed: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Global batches of ROWS rows; rows 1 and 3 padded on the right."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if name == "resnet":
            out.append({"pixel_values": torch.randn(ROWS, 3, 32, 32, generator=g),
                        "labels": torch.randint(0, 10, (ROWS,), generator=g)})
            continue
        ids = torch.randint(0, 256, (ROWS, SEQ), generator=g)
        mask = torch.ones(ROWS, SEQ, dtype=torch.long)
        mask[1, 11:] = 0
        mask[3, 6:] = 0
        if name == "bert":  # masked LM: predict 4 positions per row, the rest -100
            labels = torch.full_like(ids, -100)
            labels[:, [1, 3, 4, 5]] = ids[:, [1, 3, 4, 5]]
            ids = ids.clone()
            ids[:, [1, 3, 4, 5]] = 0
        else:
            labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


DROPPED = "which a training step cannot use"
"""What fxzero's warning about a dropped output says (`fxzero/trace.py`)."""


def _train(rank: int, world_size: int):
    out = {}
    for name in MODELS:
        torch.manual_seed(0)
        # Every warning is kept ("always": Python's own once-per-place filter would hide a repeat),
        # so the count is fxzero's: one per model over the training and the evaluation programs.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = fxzero.compile(_build(name), fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW),
                                                                cost_model=None))
            losses, fields = [], set()
            for batch in _batches(name, 1, STEPS):
                result = engine(**hf_rows(batch, rank, world_size))
                fields.add(tuple((f.name, type(getattr(result, f.name)).__name__) for f in dataclasses.fields(result)))
                engine.backward(result.loss)
                engine.step()
                losses.append(result.loss.detach())
            stacked = torch.stack(losses)
            torch.distributed.all_reduce(stacked)
            engine.eval()
            evaluation = hf_rows(_batches(name, 2, 1)[0], rank, world_size)
            with torch.no_grad():
                logits = engine(**evaluation).logits
        kinds = {ins.kind for p in ("forward", "backward") for ins in engine.schedule.program(p).instructions}
        out[name] = {"losses": (stacked / world_size).tolist(), "logits": logits, "eval_kinds": kinds,
                     "state": {k: v.clone() for k, v in engine.full_state_dict().items()},
                     "units": [layout.name for layout in engine.layouts], "fields": fields,
                     "dropped": [str(w.message) for w in caught if DROPPED in str(w.message)],
                     "threads": torch.get_num_threads()}
    return out


@contextlib.contextmanager
def _threads(n: int):
    """Run the block on `n` intra-op threads ([Note: evaluation is exact on one thread count])."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _eager_losses(name: str, world: int) -> list[float]:
    torch.manual_seed(0)
    return eager_hf_losses(_build(name), _batches(name, 1, STEPS), world, ADAMW)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_train, 2, timeout_s=380)


@pytest.mark.parametrize("name", MODELS)
def test_trains_like_eager_when_called_the_hf_way(ranks, name):
    assert_losses_close(ranks[0][name]["losses"], _eager_losses(name, 2), f"{name} on 2 ranks, stage 3")
    units = ranks[0][name]["units"]
    layer = {"gpt2": "transformer.h.1", "llama": "model.layers.1", "mixtral": "model.layers.1",
             "bert": "bert.encoder.layer.1",
             "resnet": "resnet.encoder.stages.1"}[name]
    assert layer in units, units


@pytest.mark.parametrize("name", MODELS)
def test_evaluation_under_no_grad_is_eager_evaluation(ranks, name):
    """Each rank's eval logits equal eager eval of that rank's parameters and buffers, exactly,
    on the rank's thread count ([Note: evaluation is exact on one thread count]); the program
    that ran has no reduce-scatter and no backward."""
    warnings.simplefilter("ignore")
    for rank, result in enumerate(ranks):
        r = result[name]
        assert "reduce_scatter" not in r["eval_kinds"]
        model = _build(name)
        model.load_state_dict(r["state"])
        model.eval()
        with torch.no_grad(), _threads(r["threads"]):
            want = model(**hf_rows(_batches(name, 2, 1)[0], rank, 2)).logits
        assert torch.equal(r["logits"], want), (name, rank, r["threads"], (r["logits"] - want).abs().max())


@pytest.mark.parametrize("name", MODELS)
def test_a_kv_cache_in_the_outputs_is_dropped_with_one_warning_naming_it(ranks, name):
    """GPT-2, Llama and Mixtral return a KV cache (use_cache defaults to on): one warning per model on each
    rank, over the training program and the evaluation program both, naming the output as the
    eager model returns it (its field and type) and the way to not build it; the engine returns
    None in its place, every other field as eager has it. BERT and ResNet return no cache and
    get no warning. That the training is unaffected is `test_trains_like_eager_when_called_the_hf_way`,
    run with the caches on."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _build(name).train()(**hf_rows(_batches(name, 1, 1)[0], 0, 2))
    cached = [f.name for f in dataclasses.fields(eager) if isinstance(getattr(eager, f.name), transformers.Cache)]
    assert len(cached) == (1 if name in ("gpt2", "llama", "mixtral") else 0), cached
    want = tuple((f.name, "NoneType" if f.name in cached else type(getattr(eager, f.name)).__name__)
                 for f in dataclasses.fields(eager))
    for rank in ranks:
        r = rank[name]
        assert r["fields"] == {want}, (r["fields"], want)
        if not cached:
            assert r["dropped"] == [], r["dropped"]
            continue
        assert len(r["dropped"]) == 1, r["dropped"]
        message = r["dropped"][0]
        kind = type(getattr(eager, cached[0])).__name__
        assert f"returns output[{cached[0]!r}] (a {kind})" in message, message
        assert "use_cache=False" in message, message

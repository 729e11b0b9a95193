"""Random layer-token drop on 2 ranks, as DeepSpeedExamples' GPT-2 finetuning runs it: a Hugging
Face GPT-2 (tiny config) built, `deepspeed.initialize`d with a "data_efficiency" section, then
converted with `convert_to_random_ltd(engine, GPT2Block)`, trained at ZeRO stages 0 (run as 1)
and 3 against an eager reference.

[Note: the reference's draws]
DeepSpeed's random-LTD runs only with its CUDA kernels (ops/random_ltd), so DeepSpeed cannot run
it on this CPU machine; the reference is its Python semantics, written here independently of
fxzero's code: at each training forward the first routed layer draws
`multinomial(ones(layers * batch, seq), kept)`, reshaped to [layers, batch, kept] and sorted
(`gpt_sample_tokens`), each routed layer runs on its row's tokens (advanced indexing here, where
fxzero gathers) and writes its output back over them (`index_put` here, where fxzero scatters),
the other tokens skip it. Each rank records its RNG state before each forward; the reference
replays it to draw the same tokens, so "the same token selection" is checked as DeepSpeed's
own draw from the same RNG state, not read back from fxzero. Dropout is 0, so nothing else in
the forward draws.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import fxzero
from tests.dist.harness import run_ranks
from tests.dist.reference import assert_losses_close, assert_state_close

pytestmark = pytest.mark.timeout(400)
transformers = pytest.importorskip("transformers")

ROWS, SEQ, VOCAB, LAYERS = 4, 12, 64, 4
ROUTED = (1, 2)
MIN, STEP_SIZE, REQUIRE = 4, 2, 6
STEPS = 8  # the kept count reaches SEQ at step 6: the last two steps route nothing
LR = 1e-2


def build() -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False)
    return transformers.GPT2LMHeadModel(config)


def deepspeed_config(stage: int, world: int) -> dict:
    """DeepSpeedExamples' ds_config_gpt_base_random_ltd.json, scaled to the tiny model."""
    return {
        "train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // world,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage}, "gradient_clipping": 0, "prescale_gradients": True,
        "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": LAYERS, "random_ltd_layer_num": len(ROUTED),
            "random_ltd_layer_id": list(ROUTED), "model_mask_name": "attention_mask", "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": MIN, "max_value": SEQ, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": REQUIRE, "seq_per_step": STEP_SIZE}}}}},
    }


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _train(rank: int, world: int) -> dict:
    from fxzero.deepspeed_alias import install

    install()  # (`import deepspeed` is fxzero from here, as under `fxzero run`)
    from deepspeed.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

    out = {}
    for stage in (0, 3):
        model = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, _, _, _ = fxzero.initialize(model=model, model_parameters=model.parameters(),
                                                config=deepspeed_config(stage, world))
        engine = convert_to_random_ltd(engine, transformers.models.gpt2.modeling_gpt2.GPT2Block)
        torch.manual_seed(100 + rank)  # (each rank draws its own tokens, as DeepSpeed's ranks do)
        rows = ROWS // world
        record = {"rng": [], "kept": [], "losses": [], "consumed": []}
        for ids in batches():
            ids = ids[rank * rows:(rank + 1) * rows]
            record["rng"].append(torch.get_rng_state())
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            record["kept"].append(engine.random_ltd_scheduler.get_current_seq())
            record["losses"].append(loss.item())
            record["consumed"].append(engine.random_ltd_scheduler.state["consumed_layer_tokens"])
        record["state"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
        record["programs"] = len(engine._cache)
        record["stage"] = engine.zero_optimization_stage()
        out[stage] = record
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_train, 2, timeout_s=380)


def expected_kept(step: int) -> int:
    """DeepSpeed's fixed_linear schedule, written out: min + step/require * (max - min), floored,
    rounded down to a multiple of seq_per_step, at most max."""
    value = int(MIN + step / REQUIRE * (SEQ - MIN))
    return min(SEQ, value - value % STEP_SIZE)


def _route_reference(model, draws: dict) -> None:
    """Each routed block of the plain model runs on `draws[layer]`'s tokens ([Note: the reference's draws])."""
    for number, index in enumerate(ROUTED):
        block = model.transformer.h[index]
        layer_forward = block.forward

        def forward(self, hidden, *args, _layer=layer_forward, _number=number, **kwargs):
            idx = draws.get(_number)
            if idx is None:
                return _layer(hidden, *args, **kwargs)
            rows = torch.arange(hidden.shape[0])[:, None]
            args = list(args)
            if len(args) > 1 and args[1] is not None:  # (a materialized causal mask: its first kept rows and columns)
                args[1] = args[1][:, :, : idx.shape[1], : idx.shape[1]]
            out = hidden.clone()
            out[rows, idx] = _layer(hidden[rows, idx], *args, **kwargs)
            return out

        block.forward = types.MethodType(forward, block)


def eager_reference(records: list[dict]) -> tuple[list[list[float]], dict]:
    """Each rank's micro-batch losses and the final parameters of eager Adam (DeepSpeed's "Adam" is
    AdamW) over the mean of the ranks' losses, each rank's routed blocks on its own draws."""
    model = build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.8, 0.999), eps=1e-8, weight_decay=0.0)
    draws: dict = {}
    _route_reference(model, draws)
    world, rows = len(records), ROWS // len(records)
    losses = [[] for _ in records]
    for step, ids in enumerate(batches()):
        total = 0
        for rank, record in enumerate(records):
            kept = record["kept"][step]
            draws.clear()
            if kept < SEQ:
                torch.set_rng_state(record["rng"][step])
                drawn = torch.multinomial(torch.ones(len(ROUTED) * rows, SEQ), kept)
                drawn = drawn.reshape(len(ROUTED), rows, kept).sort(dim=-1).values
                draws.update(enumerate(drawn))
            part = ids[rank * rows:(rank + 1) * rows]
            loss = model(input_ids=part, labels=part).loss
            losses[rank].append(loss.item())
            total = total + loss / world
        total.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_the_schedule_is_deepspeeds_fixed_linear(ranks):
    want = [expected_kept(step) for step in range(STEPS)]
    assert want == [4, 4, 6, 8, 8, 10, 12, 12]  # (the formula above, by hand)
    # consumed layer-tokens: per step, the global batch times routed layers at the kept count plus the others at max
    consumed, total = [], 0
    for kept in want:
        total += ROWS * (kept * len(ROUTED) + SEQ * (LAYERS - len(ROUTED)))
        consumed.append(total)
    for rank in ranks:
        for stage in (0, 3):
            assert rank[stage]["kept"] == want
            assert rank[stage]["consumed"] == consumed


@pytest.mark.parametrize("stage", [0, 3])
def test_trains_as_eager_on_the_same_tokens(ranks, stage):
    """Every rank's losses and the final parameters equal the eager reference's, which routes the
    same tokens ([Note: the reference's draws]), to fp32 rounding; one program for the routed
    steps (the kept count a symbolic size) and one for the steps at full length."""
    records = [rank[stage] for rank in ranks]
    losses, state = eager_reference(records)
    for rank, record in enumerate(records):
        assert_losses_close(record["losses"], losses[rank], f"rank {rank}, DeepSpeed stage {stage}", rtol=1e-6)
        assert record["programs"] == 2
        assert record["stage"] == stage
    got = {k: _without_key_bias(k, records[0]["state"][k]) for k in state if k in records[0]["state"]}
    want = {k: _without_key_bias(k, state[k]) for k in got}
    assert_state_close(got, want, f"stage {stage}", atol=1e-6)
    assert_state_close(records[0]["state"], records[1]["state"], "the ranks' parameters", atol=0)


def _without_key_bias(name: str, value: torch.Tensor) -> torch.Tensor:
    """The parameter, without the attention's key bias: attention is invariant to it (q.(k + b) adds
    the same q.b to every key of a query), so its exact gradient is 0 and the computed one is
    rounding noise, which Adam divides by its own size into steps of up to lr: two correct
    implementations differ there by up to lr per step. Everything else is held to fp32 rounding."""
    if not name.endswith("attn.c_attn.bias"):
        return value
    hidden = value.numel() // 3
    return torch.cat([value[:hidden], value[2 * hidden:]])

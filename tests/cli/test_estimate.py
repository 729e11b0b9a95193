"""`fxzero estimate`: the ZeRO paper's arithmetic, and the runtime's own accounting."""

from __future__ import annotations

import json

import pytest
import torch

from fxzero import estimate
from fxzero.config import UnitsPolicy
from fxzero.modelspec import build_model
from fxzero.units import plan_units
from tests.cli.conftest import invoke


def _json(runner, *args):
    return json.loads(invoke(runner, "estimate", *args, "--json").stdout)


@pytest.mark.parametrize("phi, n", [(7.5e9, 64), (1.5e9, 16), (124_000_000, 8), (1e6, 1)])
def test_params_reproduce_the_zero_paper(runner, phi, n):
    rows = {r["stage"]: r for r in _json(runner, "--params", f"{phi:.0f}", "--world", str(n))["per_rank"]}
    mixed = {s: rows[s]["mixed"]["total"] for s in rows}
    assert mixed[0] == pytest.approx(16 * phi)
    assert mixed[1] == pytest.approx(4 * phi + 12 * phi / n)
    assert mixed[2] == pytest.approx(2 * phi + 14 * phi / n)
    assert mixed[3] == pytest.approx(16 * phi / n)
    fp32 = {s: rows[s]["fp32"]["total"] for s in rows}
    assert fp32[1] == pytest.approx(8 * phi + 8 * phi / n)
    assert fp32[2] == pytest.approx(4 * phi + 12 * phi / n)
    assert fp32[3] == pytest.approx(16 * phi / n)


def test_paper_example_7_5b_on_64_ranks(runner):
    out = invoke(runner, "estimate", "--params", "7.5B", "--world", "64").output
    # The paper's Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB (decimal GB).
    for gib in ("112 GiB", "29.2 GiB", "15.5 GiB", "1.75 GiB"):
        assert gib in out


def test_model_uses_the_runtime_layouts_with_padding(runner):
    layouts = plan_units(build_model("gpt-tiny"), UnitsPolicy(), 3)
    rows = {r["stage"]: r for r in _json(runner, "gpt-tiny", "--world", "3")["per_rank"]}
    padded = sum(u.padded_numel for u in layouts)
    shard = sum(u.shard_numel for u in layouts)
    assert padded > sum(u.numel for u in layouts)  # world 3 pads
    assert rows[3]["fp32"]["total"] == 16 * shard
    assert rows[2]["fp32"]["total"] == 4 * padded + 12 * shard
    assert rows[1]["fp32"]["total"] == 8 * padded + 8 * shard
    assert rows[3]["mixed"]["total"] == 16 * shard


def test_offload_moves_optimizer_states_sharded_gradients_and_stage3_params(runner):
    # As the runtime places them (Offload(params=..., optimizer=...), gradients with the
    # optimizer states): mixed precision, 2 + 2 + 12 bytes per parameter, 1B on 8 ranks.
    result = _json(runner, "--params", "1B", "--world", "8", "--nodes", "2", "--offload", "nvme")
    rows = {r["stage"]: r["mixed"] for r in result["per_rank"]}
    assert result["ranks_per_node"] == 4
    assert rows[0]["placement"]["nvme"] == 0
    assert rows[1]["placement"]["nvme"] == pytest.approx(12e9 / 8)  # the full gradient stays
    assert rows[1]["placement"]["device"] == pytest.approx(2e9 + 2e9)
    assert rows[2]["placement"]["nvme"] == pytest.approx(14e9 / 8)
    assert rows[2]["placement"]["device"] == pytest.approx(2e9)
    assert rows[3]["placement"]["nvme"] == pytest.approx(16e9 / 8)
    assert rows[3]["placement"]["device"] == 0
    assert rows[3]["placement"]["cpu"] == 0
    text = invoke(runner, "estimate", "--params", "1B", "--world", "8", "--nodes", "2", "--offload", "cpu").output
    assert "cpu per node" in text


def test_model_offload_splits_its_own_layouts_over_the_tiers(runner):
    layouts = plan_units(build_model("gpt-tiny"), UnitsPolicy(), 3)
    shard = sum(u.shard_numel for u in layouts)
    padded = sum(u.padded_numel for u in layouts)
    rows = {r["stage"]: r["fp32"]["placement"] for r in _json(runner, "gpt-tiny", "--world", "3", "--offload", "cpu")["per_rank"]}
    assert rows[3] == {"device": 0, "cpu": 16 * shard, "nvme": 0, "total": 16 * shard}
    assert rows[2] == {"device": 4 * padded, "cpu": 12 * shard, "nvme": 0, "total": 4 * padded + 12 * shard}
    assert rows[1]["device"] == 8 * padded and rows[1]["cpu"] == 8 * shard


@pytest.mark.parametrize("args, message", [
    ((), "either MODEL or --params"),
    (("gpt-tiny", "--params", "1B"), "either MODEL or --params"),
    (("--params", "lots"), "expected a count"),
    (("--params", "1B", "--world", "6", "--nodes", "4"), "cannot be split evenly"),
    (("gpt-enormous",), "does not resolve"),
])
def test_estimate_errors(runner, args, message):
    result = invoke(runner, "estimate", *args, ok=False)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_runtime_accounting_matches_a_world_of_one_engine():
    import fxzero

    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model("cnn")
    engine = fxzero.compile(model, fxzero.Config(stage=3, cost_model=None))
    (x,) = model.example_inputs()
    engine.backward(engine(x).square().mean())
    engine.step()
    states = estimate.runtime_model_states(engine.layouts, 3)
    engine.backward(engine(x).square().mean())  # gradients held again, optimizer states exist
    assert engine.memory_report()["model_states"] == states.total


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32], ids=["bf16-reduce", "fp32-reduce"])
@pytest.mark.parametrize("stage", [1, 3])
def test_mixed_accounting_is_what_a_bf16_engine_holds(stage, reduce_dtype):
    import fxzero

    mp = fxzero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model("gpt-tiny")
    engine = fxzero.compile(model, fxzero.Config(stage=stage, cost_model=None, mixed_precision=mp))
    (x,) = model.example_inputs()
    engine.backward(engine(x).float().square().mean())
    engine.step()
    engine.backward(engine(x).float().square().mean())  # gradients held again, optimizer states exist
    states = estimate.runtime_model_states(engine.layouts, stage, "mixed", mixed_precision=mp)
    assert engine.memory_report()["model_states"] == states.total
    phi = sum(u.numel for u in engine.layouts)  # a world of one: no padding
    grad_bytes = 2 if reduce_dtype is None else 4
    assert states.total == (2 + grad_bytes + 12) * phi


def test_accumulation_shows_both_policies(runner):
    """Gradient bytes held and reduce-scatter bytes per optimizer step, from the layouts: the
    sharded policy reduces the full flat gradient every micro-step, the local one once."""
    layouts = plan_units(build_model("gpt-tiny"), UnitsPolicy(), 2)
    full = sum(u.padded_numel for u in layouts if u.trainable) * 4
    got = _json(runner, "gpt-tiny", "--world", "2", "--accumulation", "4")["accumulation"]
    assert got["steps"] == 4
    for stage, costs in got["per_stage"].items():
        held = full if int(stage) == 1 else full // 2
        assert costs["sharded"] == {"grads_held": held, "reduce_scatter_bytes": 4 * full}
        assert costs["local"] == {"grads_held": full, "reduce_scatter_bytes": full}
    text = invoke(runner, "estimate", "gpt-tiny", "--world", "2", "--accumulation", "4").output
    assert 'ZeRO-3: "sharded" holds' in text and '"local" holds' in text
    assert "needs a MODEL" in invoke(runner, "estimate", "--params", "1B", "--accumulation", "4", ok=False).output


def test_activations_per_policy_from_the_program_and_megatron(runner):
    """`--seq 8 --micro-batch 3` on gpt-tiny (4 blocks, d 32, 2 heads, fp32): with recompute each
    block keeps its input (3 x 8 x 32 fp32), and the JSON carries Megatron's formula beside it."""
    from fxzero.activation_estimate import estimate_activations

    got = _json(runner, "gpt-tiny", "--world", "2", "--seq", "8", "--micro-batch", "3")["activations"]
    assert (got["seq"], got["micro_batch"]) == (8, 3)
    per = got["per_policy"]
    assert set(per) == {"none", "unit", "unit-attention", "selective"}
    assert per["unit"]["by_kind"]["input"] == 4 * 3 * 8 * 32 * 4
    # (so small that "unit" keeps each attention's outputs already: fewer bytes than the
    # generator state that would replay it)
    assert per["unit"]["by_kind"]["attention"] == 4 * (3 * 8 * 32 + 3 * 2 * 8) * 4
    assert per["unit-attention"] == {**per["unit"], "policy": "unit-attention"}
    assert per["none"]["by_kind"]["input"] == 0 and per["none"]["total"] == per["none"]["by_kind"]["resident"]
    assert 0 < per["unit"]["total"] < per["selective"]["total"] < per["none"]["total"]
    # the library's figure for the same call (int64 ids of shape (3, 8), 2 ranks)
    model = build_model("gpt-tiny")
    direct = estimate_activations(model, (torch.zeros(3, 8, dtype=torch.int64),), __import__("fxzero").Config(
        cost_model=None), world_size=2, policies=("none", "unit", "unit-attention", "selective"))
    assert {p: c.total for p, c in direct.items()} == {p: c["total"] for p, c in per.items()}
    m = got["megatron"]
    assert (m["hidden"], m["heads"], m["layers"]) == (32, 2, 4)
    sbh, as2b = 8 * 3 * 32, 2 * 8 * 8 * 3
    assert m["published_per_layer"] == {"none": 34 * sbh + 5 * as2b, "none_fused_attention": 34 * sbh,
                                        "unit": 2 * sbh, "selective": 34 * sbh}
    assert m["this_model"]["per_layer"] == {"none": 64 * sbh, "unit": 4 * sbh, "selective": 64 * sbh}  # fp32, fused
    only_unit = _json(runner, "gpt-tiny", "--world", "2", "--seq", "8", "--activations", "unit")["activations"]
    assert set(only_unit["per_policy"]) == {"unit"} and only_unit["micro_batch"] == 2  # the example's batch


def test_activations_text(runner):
    out = invoke(runner, "estimate", "gpt-tiny", "--world", "2", "--seq", "8", "--micro-batch", "3").output
    assert 'recompute="none"' in out and 'recompute="unit"' in out and "unit inputs 12 KiB (4 units)" in out
    # per block: its input (3 x 8 x 32 fp32) and attention's output and log-sum-exp (+ 3 x 2 x 8 fp32)
    assert "4 units, blocks.0 .. blocks.3, each: attention 3.19 KiB, input 3 KiB" in out
    assert "Megatron's formula" in out and "34sbh + 5as^2b" in out
    assert "not included: temporary buffers" in out
    plain = invoke(runner, "estimate", "gpt-tiny", "--world", "2").output
    assert "not included: activations (--activations)" in plain and "Megatron" not in plain


@pytest.mark.parametrize("args, message", [
    (("gpt-tiny", "--seq", "1024"), "covers sequences up to 16 (seq_len); build it longer: 'gpt-tiny(seq_len=1024)'"),
    (("--params", "1B", "--activations", "unit"), "need a MODEL"),
    (("cnn", "--seq", "8"), "leave --seq out"),
])
def test_activations_errors(runner, args, message):
    result = invoke(runner, "estimate", *args, ok=False)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output

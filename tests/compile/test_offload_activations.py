"""`Activations(offload=...)` at compile time ([Note: activations on a tier] in
`fxzero/passes/offload_activations.py`): the offload and fetch instructions exist on the io
stream, each offload after its tensor's last forward use and each fetch waited for before the
backward's first use, the validator holds them to that, the simulator prices them, and the rule
and a planner's placement choose which tensors. A Hugging Face GPT-2 with its dropouts, compiled
for 2 ranks at ZeRO-3 (no rank runs: `tests/dist/test_offload_activations.py` trains it).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import fxzero
from fxzero.compiler import compile_program
from fxzero.config.effects import ineffective_settings
from fxzero.cost import DEFAULT_IO, Link, preset, simulate
from fxzero.ir.alias import alias_closure, alias_root
from fxzero.passes import build_pipeline
from fxzero.passes.offload_activations import PLACEMENT, saved_tensors
from fxzero.passes.runner import Pass, PassContext, PassResult, run_pipeline
from fxzero.schedule import build_schedule
from fxzero.schedule.types import ScheduleError
from fxzero.schedule.validate import validate
from fxzero.trace import trace_joint

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")

CONFIG = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64)  # dropouts at GPT-2's 0.1
IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
KWARGS = dict(input_ids=IDS, labels=IDS, use_cache=False)


def _model():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def _config(recompute="none", min_bytes=0, tier=None):
    tier = tier if tier is not None else fxzero.Nvme(path="/tmp")
    return fxzero.Config(stage=3, cost_model=None,
                         activations=fxzero.Activations(recompute=recompute, offload=tier, offload_min_bytes=min_bytes))


def _compile(config, cost_model=None):
    return compile_program(_model(), (), config, world_size=2, kwargs=KWARGS, cost_model=cost_model)


def _io(program, kind):
    return [i for i in program.instructions if i.kind == kind and i.state == "activation"]


@pytest.fixture(scope="module")
def compiled():
    return {rec: _compile(_config(rec)) for rec in ("none", "unit")}


@pytest.mark.parametrize("recompute", ["none", "unit"])
def test_offloads_and_fetches_are_io_instructions_paired_across_the_boundary(compiled, recompute):
    schedule = compiled[recompute].schedule
    forward, backward = schedule.program("forward"), schedule.program("backward")
    offloads, fetches = _io(forward, "offload"), _io(backward, "fetch")
    assert offloads and len(offloads) == len(fetches)
    assert {(i.stream, i.tier) for i in offloads + fetches} == {("io", "nvme")}
    receipts = {w.name: w.reads[0] for w in forward.instructions if w.kind == "wait" and w.reads[0] in
                {o.name for o in offloads}}
    assert set(receipts.values()) == {o.name for o in offloads}  # every write waited for in the forward
    assert set(receipts) <= set(forward.outputs)  # ... and its receipt saved for the backward
    assert sorted(f.reads[0] for f in fetches) == sorted(receipts)  # each fetch reads one receipt
    assert _io(schedule.program("step"), "fetch") == []
    # Each moves its tensor's bytes: the offloaded source's size, read back whole.
    size = {i.name: i.bytes for i in forward.instructions}
    by_receipt = {r: o for r, o in receipts.items()}
    written = {o.name: o.bytes for o in offloads}
    for o in offloads:
        assert o.bytes == size[o.reads[0]] > 0
    for f in fetches:
        assert f.bytes == written[by_receipt[f.reads[0]]]


@pytest.mark.parametrize("recompute", ["none", "unit"])
def test_each_offload_follows_the_last_forward_use_and_each_fetch_precedes_the_first_backward_use(
        compiled, recompute):
    programs = compiled[recompute].programs
    used = 0
    for name, check in (("forward", "offload"), ("backward", "fetch")):
        nodes = list(programs[name].gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        for n in nodes:
            if n.meta.get("fxzero", {}).get("state") != "activation" or n.meta["fxzero"]["kind"] != check:
                continue
            if check == "offload":  # nothing of the forward reads the tensor (or a view of it) after the write starts
                src = n.args[0]
                views = alias_closure(src)
                readers = [u for v in views for u in v.users if u is not n and u not in views and u.op != "output"]
                assert all(pos[u] < pos[n] for u in readers), n.name
                used += bool(readers)
            else:  # the fetched value is read only after its wait, and freed after its last reader
                (wait,) = n.users
                views = alias_closure(wait)
                readers = [u for v in views for u in v.users if u not in views]
                frees = [u for u in readers if u.meta["fxzero"].get("kind") == "free"]
                uses = [u for u in readers if u not in frees]
                assert len(frees) == 1 and uses and pos[wait] < min(pos[u] for u in uses), n.name
                assert pos[frees[0]] > max(pos[u] for u in uses), n.name
    assert used  # (some offloaded tensors have forward readers: the order is tested, not vacuous)


def _edited(schedule, drop: str, rename: dict[str, str]):
    """`schedule` with the backward's instruction `drop` removed and reads renamed by `rename`."""
    backward = schedule.program("backward")
    old = {n: i.name for n, i in enumerate(backward.instructions)}
    kept = [i for i in backward.instructions if i.name != drop]
    index = {i.name: n for n, i in enumerate(kept)}
    kept = tuple(dataclasses.replace(i, reads=tuple(rename.get(r, r) for r in i.reads),
                                     deps=tuple(index[old[d]] for d in i.deps if old[d] in index)) for i in kept)
    program = dataclasses.replace(backward, instructions=kept, gathered_bytes=backward.gathered_bytes[: len(kept)])
    return dataclasses.replace(schedule, programs=tuple(program if p.name == "backward" else p for p in schedule.programs))


def test_the_validator_refuses_a_fetch_used_before_its_wait_or_never_freed(compiled):
    schedule = compiled["none"].schedule
    backward = schedule.program("backward")
    fetch = _io(backward, "fetch")[0]
    wait = next(i for i in backward.instructions if i.kind == "wait" and i.reads == (fetch.name,))
    free = next(i for i in backward.instructions if i.kind == "free" and i.reads == (wait.name,))
    validate(schedule)
    with pytest.raises(ScheduleError, match="never freed"):
        validate(_edited(schedule, free.name, {}))
    with pytest.raises(ScheduleError, match=f"reads {fetch.name}, the result of a fetch .* before its wait"):
        validate(_edited(schedule, wait.name, {wait.name: fetch.name}))


def test_the_simulator_prices_every_write_and_read_on_the_io_stream(compiled):
    cost = preset("cpu-loopback")
    schedule = compiled["none"].schedule
    moved = [i for p in schedule.programs for i in p.instructions if i.state == "activation"]
    result = simulate(schedule, cost)
    assert result.io_seconds == pytest.approx(sum(cost.io_seconds(i) for i in moved))
    assert result.io_seconds > 0
    resident = simulate(_compile(fxzero.Config(stage=3, cost_model=None)).schedule, cost)
    assert resident.io_seconds == 0


def _offloaded(cp) -> list[str]:
    return [i.reads[0] for i in _io(cp.schedule.program("forward"), "offload")]


def test_the_rule_keeps_small_tensors_and_the_last_units(compiled):
    # The model's tensors are under 64 KiB: the default threshold (1 MiB) keeps them all.
    assert _offloaded(_compile(_config(min_bytes=1 << 20))) == []
    assert all(i.bytes >= 16384 for i in _io(_compile(_config(min_bytes=16384)).schedule.program("forward"), "offload"))
    # The head's log-softmax (the last unit's, read at once by the backward) stays; the first
    # block's output of its attention softmax goes.
    offloaded = _offloaded(compiled["none"])
    saved = [k for kind, k in compiled["none"].programs["forward"].outputs if kind == "saved"]
    assert any(k.startswith("_log_softmax") for k in saved) and not any(k.startswith("_log_softmax") for k in offloaded)
    assert "_safe_softmax" in offloaded and "_safe_softmax" not in saved


def test_with_recompute_unit_offload_moves_what_the_units_keep(compiled):
    forward = _compile(fxzero.Config(stage=3, cost_model=None, activations=fxzero.Activations(
        recompute="unit"))).programs["forward"]
    output = next(n for n in forward.gm.graph.nodes if n.op == "output")
    saved = {n.name: n for n in output.args[0] if isinstance(n, torch.fx.Node)}
    kept = {alias_root(saved[k]).name for kind, k in forward.outputs if kind == "saved"}  # (by the storage's owner)
    offloaded = set(_offloaded(compiled["unit"]))
    assert offloaded and offloaded <= kept


def test_priced_gaps_decide_with_a_cost_model():
    def disk(bandwidth):
        io = {k: Link(bandwidth=bandwidth) for k in ("nvme_read", "nvme_write")}
        return dataclasses.replace(preset("cpu-loopback"), io=io)

    fast, slow = _compile(_config(), disk(1e15)), _compile(_config(), disk(1.0))
    assert set(_offloaded(fast)) == set(_offloaded(_compile(_config())))  # every gap covers an instant write
    assert _offloaded(slow) == []  # no compute covers a second per byte
    assert simulate(fast.schedule, disk(1e15)).exposed_io_seconds == 0


def _joint_with(placement):
    """The pipeline for _config(), with a planner pass before offload_activations setting `placement`
    (a function of the saved-tensor rows)."""
    model, config = _model(), _config()
    from fxzero.compiler import plan_layouts

    layouts = plan_layouts(model, config, 2)
    traced = trace_joint(model, (), kwargs=KWARGS)
    ctx = PassContext(layouts=layouts, signature=traced.signature, world_size=2)
    rows = {}

    def planner(gm, ctx):
        rows["rows"] = saved_tensors(gm, ctx, tier="nvme", cost_model=preset("cpu-loopback"))
        ctx.outputs[PLACEMENT] = placement(rows["rows"])
        return PassResult(gm, changed=False)

    passes = build_pipeline(config, layouts)
    at = next(i for i, p in enumerate(passes) if p.name == "offload_activations")
    passes.insert(at, Pass("planner", planner, requires=frozenset({"phases"})))
    run_pipeline(traced.gm, ctx, passes)
    schedule = build_schedule(ctx.programs, layouts, stage=3, world_size=2, persistent=frozenset())
    return rows["rows"], [i.reads[0] for i in _io(schedule.program("forward"), "offload")]


def test_a_planner_sets_the_choice_per_tensor_from_the_costs_it_is_given():
    rows, offloaded = _joint_with(lambda rows: {r.name: "keep" for r in rows[1:]} | {rows[0].name: "nvme"})
    assert offloaded == [rows[0].name]
    row, disk = rows[0], DEFAULT_IO  # (the preset lists no disk: the default NVMe figures price it)
    assert row.write_s == pytest.approx(disk["nvme_write"].latency + row.bytes / disk["nvme_write"].bandwidth)
    assert row.read_s == pytest.approx(disk["nvme_read"].latency + row.bytes / disk["nvme_read"].bandwidth)
    assert row.forward_gap_s > 0 and row.forward_gap_units > 0 and row.bytes > 0
    with pytest.raises(ValueError, match="not a saved tensor"):
        _joint_with(lambda rows: {"no_such_node": "nvme"})
    with pytest.raises(ValueError, match="use 'keep' or 'nvme'"):
        _joint_with(lambda rows: {rows[0].name: "cpu"})


def test_the_cpu_tier_on_a_cpu_program_changes_nothing_and_says_so():
    cp = _compile(_config(tier=fxzero.Cpu()))
    assert not any(i.state == "activation" for p in cp.schedule.programs for i in p.instructions)
    (message,) = [m for m in ineffective_settings(_config(tier=fxzero.Cpu()), world_size=2, cuda=False,
                                                  initialized_from_seed=False) if "Activations" in m]
    assert "no effect on a CPU rank" in message and "stay resident" in message
    assert not [m for m in ineffective_settings(_config(tier=fxzero.Cpu()), world_size=2, cuda=True,
                                                initialized_from_seed=False) if "Activations" in m]


def test_the_policy_refuses_what_is_not_a_tier():
    with pytest.raises(TypeError, match="fxzero.Cpu"):
        fxzero.Activations(offload="nvme")
    with pytest.raises(ValueError, match="offload_min_bytes"):
        fxzero.Activations(offload=fxzero.Cpu(), offload_min_bytes=-1)
    assert fxzero.Activations().offload is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxzero.Activations(offload=fxzero.Nvme(path="/tmp"))

"""The offload pass and the step program with offloaded states, on compiled schedules (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxzero
from fxzero import zoo
from fxzero.cost import PRESETS, Link, simulate

NVME = fxzero.Nvme(path="/tmp")


def _compile(offload: fxzero.Offload, world_size: int = 2, cost_model=None, **config):
    with torch.device("meta"):
        model = zoo.build("gpt-tiny", n_blocks=6)
    cfg = fxzero.Config(offload=offload, cost_model=cost_model, **config)
    return fxzero.compile_program(model, model.example_inputs(batch=2), cfg, world_size=world_size, cost_model=cost_model)


def _ins(schedule, program):
    return schedule.program(program).instructions


def _alive_max(instructions, start_kind: str, end_of) -> int:
    """Most values alive at once: +1 at each `start_kind`, -1 where `end_of(ins)` names one."""
    alive, most = set(), 0
    for ins in instructions:
        if ins.kind == start_kind:
            alive.add(ins.name)
        ended = end_of(ins)
        if ended is not None:
            alive.discard(ended)
        most = max(most, len(alive))
    return most


@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("prefetch", [None, fxzero.Prefetch()], ids=["noprefetch", "prefetch"])
def test_every_gather_reads_a_fetched_shard_freed_after_the_gather(lookahead, prefetch):
    schedule = _compile(fxzero.Offload(params=NVME, lookahead=lookahead), prefetch=prefetch).schedule
    # The shards the backward reads first are kept from the forward (lookahead + 1 of them).
    kept = schedule.shards_kept_for_backward
    assert len(kept) == lookahead + 1
    for program in ("forward", "backward"):
        instructions = _ins(schedule, program)
        index = {i.name: n for n, i in enumerate(instructions)}
        by_name = {i.name: i for i in instructions}
        gathers = [i for i in instructions if i.kind == "all_gather"]
        assert gathers
        for g in gathers:
            (shard,) = g.reads
            if g.unit in kept and program == "forward":
                assert shard in schedule.program("forward").kept_names, "kept: a forward output, not freed"
                assert not [i for i in instructions if i.kind == "free" and i.reads == (shard,)]
                continue
            if g.unit in kept:  # the backward reads the forward's shard (an input) and frees it
                assert shard in schedule.program("backward").kept_names and shard in schedule.program("backward").inputs
                (free,) = [i for i in instructions if i.kind == "free" and i.reads == (shard,)]
                continue
            fetch = by_name[by_name[shard].reads[0]]
            assert fetch.kind == "fetch" and fetch.unit == g.unit and fetch.state == "param"
            assert fetch.stream == "io" and fetch.tier == "nvme"
            gather_wait = next(i for i in instructions if i.kind == "wait" and i.reads == (g.name,))
            (free,) = [i for i in instructions if i.kind == "free" and i.reads == (shard,)]
            assert index[gather_wait.name] < index[free.name]
            assert index[gather_wait.name] in by_name[free.name].deps
        # At most lookahead + 1 fetched shards in memory at once (fetch to free), plus one per
        # gather that prefetch keeps in flight (a shard is released when its gather is done).
        waits = {i.name: i.reads[0] for i in instructions if i.kind == "wait"}
        fetch_of_free = lambda i: waits.get(i.reads[0]) if i.kind == "free" else None  # noqa: E731
        gathers_in_flight = _alive_max(instructions, "all_gather", lambda i: waits.get(i.name))
        assert _alive_max(instructions, "fetch", fetch_of_free) <= lookahead + gathers_in_flight


def test_fetch_leads_its_gather_by_lookahead_gathers():
    schedule = _compile(fxzero.Offload(params=NVME, lookahead=2)).schedule
    instructions = _ins(schedule, "forward")
    order = [(i.kind, i.unit) for i in instructions if i.kind in ("fetch", "all_gather")]
    gathers = [u for k, u in order if k == "all_gather"]
    for n, unit in enumerate(gathers):
        position = order.index(("fetch", unit))
        gathers_before = sum(1 for k, _ in order[:position] if k == "all_gather")
        assert gathers_before == max(0, n - 2), (unit, order)


def test_cost_model_shortens_the_lead_when_reads_are_fast():
    fast = dataclasses.replace(PRESETS["cpu-loopback"], io={"nvme_read": Link(bandwidth=1e15)})
    slow = dataclasses.replace(PRESETS["cpu-loopback"], io={"nvme_read": Link(bandwidth=1e3)})

    def leads(cost_model):
        order = [(i.kind, i.unit) for i in _ins(_compile(fxzero.Offload(params=NVME, lookahead=3), cost_model=cost_model).schedule, "forward")
                 if i.kind in ("fetch", "all_gather")]
        gathers = [u for k, u in order if k == "all_gather"]
        out = []
        for n, unit in enumerate(gathers):
            position = order.index(("fetch", unit))
            out.append(n - sum(1 for k, _ in order[:position] if k == "all_gather"))
        return out

    assert max(leads(fast)) == 1  # one gather back always suffices
    assert leads(slow)[3:] == [3] * (len(leads(slow)) - 3)  # as far as lookahead allows


def test_gradients_are_written_out_and_bounded_in_flight():
    schedule = _compile(fxzero.Offload(optimizer=NVME, lookahead=1)).schedule
    backward = schedule.program("backward")
    by_name = {i.name: i for i in backward.instructions}
    offloads = [i for i in backward.instructions if i.kind == "offload"]
    trainable = [u.name for u in schedule.units if u.trainable]
    assert sorted(i.unit for i in offloads) == sorted(trainable)
    assert all(i.state == "grad" and by_name[i.reads[0]].kind == "wait" for i in offloads)
    # The program returns a token per unit: the waits of the writes.
    assert [by_name[o].kind for o in backward.outputs] == ["wait"] * len(trainable)
    assert all(by_name[by_name[o].reads[0]].kind == "offload" for o in backward.outputs)
    waits = {i.name: i.reads[0] for i in backward.instructions if i.kind == "wait"}
    assert _alive_max(backward.instructions, "offload", lambda i: waits.get(i.name)) <= 2
    # No parameter fetches when only the optimizer (and so the gradients) are offloaded.
    assert not [i for p in ("forward", "backward") for i in _ins(schedule, p) if i.kind == "fetch"]


def test_step_program_streams_units_through_memory():
    lookahead = 1
    schedule = _compile(fxzero.Offload(params=NVME, optimizer=NVME, lookahead=lookahead)).schedule
    step = _ins(schedule, "step")
    by_name = {i.name: i for i in step}
    for ins in [i for i in step if i.kind == "optim_step"]:
        fetched = sorted(by_name[by_name[r].reads[0]].state for r in ins.reads)
        assert fetched == ["exp_avg", "exp_avg_sq", "grad", "param"], ins
        # adamw updates its operands in place; the offloads write those buffers back.
        written = sorted(i.state for i in step if i.kind == "offload" and i.reads[0] in ins.reads)
        assert written == ["exp_avg", "exp_avg_sq", "param"]
    # Units whose states are in memory at once (first fetch to last write waited for).
    alive, most = set(), 0
    waits = {i.name: i.reads[0] for i in step if i.kind == "wait"}
    pending_writes: dict[str, int] = {}
    for ins in step:
        if ins.kind == "fetch":
            alive.add(ins.unit)
        if ins.kind == "offload":
            pending_writes[ins.unit] = pending_writes.get(ins.unit, 0) + 1
        if ins.kind == "wait" and by_name[waits[ins.name]].kind == "offload":
            pending_writes[ins.unit] -= 1
            if pending_writes[ins.unit] == 0:
                alive.discard(ins.unit)
        most = max(most, len(alive))
    assert most <= 2 * lookahead + 1, most


def test_persistent_units_keep_their_parameters_resident():
    schedule = _compile(fxzero.Offload(params=NVME, optimizer=NVME), persist_threshold=5000).schedule
    assert schedule.persistent == ("root", "root:tail")
    step_fetches = {(i.unit, i.state) for i in _ins(schedule, "step") if i.kind == "fetch"}
    assert ("root", "exp_avg") in step_fetches and ("root", "param") not in step_fetches
    assert ("blocks.0", "param") in step_fetches
    for program in schedule.programs:
        for ins in program.instructions:
            if ins.kind in ("fetch", "offload") and ins.state == "param":
                assert ins.unit not in schedule.persistent


def test_io_is_rank_local_and_not_in_the_fingerprint():
    # Offloaded parameters are gathered in the backward again (their fetch there is what a step
    # in the backward updates), so compare with a device-resident schedule that does the same.
    device = _compile(fxzero.Offload(), prefetch=fxzero.Prefetch(keep_for_backward=False)).schedule
    offloaded = _compile(fxzero.Offload(params=NVME, optimizer=NVME)).schedule
    # The collective sequence is the same; only local transfers were added.
    assert [(p, i.kind, i.unit) for p, i in device.collectives()] == [(p, i.kind, i.unit) for p, i in offloaded.collectives()]


def test_simulator_prices_io_and_lead_hides_it():
    slow_disk = dataclasses.replace(PRESETS["cpu-loopback"], io={"nvme_read": Link(bandwidth=2e7), "nvme_write": Link(bandwidth=2e7)})
    none = simulate(_compile(fxzero.Offload(params=NVME, lookahead=0)).schedule, slow_disk)
    ahead = simulate(_compile(fxzero.Offload(params=NVME, lookahead=2)).schedule, slow_disk)
    # (A longer lookahead also keeps more shards from the forward for the backward: fewer reads.)
    assert none.io_seconds > 0 and ahead.io_seconds <= none.io_seconds
    assert ahead.exposed_io_seconds < none.exposed_io_seconds
    device = simulate(_compile(fxzero.Offload()).schedule, slow_disk)
    assert device.io_seconds == 0 and device.exposed_io_seconds == 0


def test_schedule_json_round_trip_keeps_io():
    from fxzero.schedule import Schedule

    schedule = _compile(fxzero.Offload(params=NVME, optimizer=NVME)).schedule
    again = Schedule.loads(schedule.dumps())
    assert again == schedule


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_step_in_backward_updates_each_sharded_unit_once_in_the_backward(lookahead):
    offload = fxzero.Offload(params=NVME, optimizer=NVME, step_in_backward=True, lookahead=lookahead)
    schedule = _compile(offload, persist_threshold=5000).schedule  # root and tail persistent
    backward, step = _ins(schedule, "backward"), _ins(schedule, "step")
    by_name = {i.name: i for i in backward}
    index = {i.name: n for n, i in enumerate(backward)}
    sharded = [u.name for u in schedule.units if u.trainable and u.name not in schedule.persistent]
    updates = [i for i in backward if i.kind == "optim_step"]
    assert sorted(i.unit for i in updates) == sorted(sharded)
    # The persistent root is still updated by the step program, from its stored gradient.
    assert [i.unit for i in step if i.kind == "optim_step"] == ["root", "root:tail"]
    assert ("grad", "root") in {(i.state, i.unit) for i in backward if i.kind == "offload"}
    kept = schedule.program("backward").kept_names  # shards kept from the forward: inputs, not fetched here
    assert schedule.shards_kept_for_backward
    for u in updates:
        param_name = u.reads[0]
        grad, m, v = (by_name[r] for r in u.reads[1:])
        if param_name in kept:
            assert u.unit in schedule.shards_kept_for_backward
        else:
            param = by_name[param_name]
            assert by_name[param.reads[0]].state == "param"
        assert by_name[m.reads[0]].state == "exp_avg"
        assert by_name[grad.reads[0]].kind == "reduce_scatter"
        written = [i for i in backward if i.kind == "offload" and i.unit == u.unit]
        assert sorted(i.state for i in written) == ["exp_avg", "exp_avg_sq", "param"]
        assert all(index[w.name] > index[u.name] for w in written)
        # Each fetched buffer is freed once, after the writes of the new values are waited for.
        for buffer in (param_name, m.name, v.name):
            (free,) = [i for i in backward if i.kind == "free" and i.reads == (buffer,)]
            write_waits = [i for i in backward if i.kind == "wait" and by_name[i.reads[0]] in written]
            assert all(index[w.name] < index[free.name] for w in write_waits)
    # No gradient of a sharded unit is written: it is consumed where it is reduced.
    assert not [i for i in backward if i.kind == "offload" and i.state == "grad" and i.unit in sharded]
    # Each update runs before the next unit's reduce-scatter is issued (interleaved with the
    # backward, not in a burst at its end).
    scatters = [i for i in backward if i.kind == "reduce_scatter"]
    for u in updates:
        (rs,) = [i for i in scatters if i.unit == u.unit]
        later = scatters[scatters.index(rs) + 1 :]
        assert not later or index[u.name] < index[later[0].name], u.unit


def test_step_in_backward_needs_params_and_optimizer_offloaded():
    with pytest.raises(ValueError, match="offload both params= and optimizer="):
        fxzero.Offload(optimizer=NVME, step_in_backward=True)


def test_step_in_backward_reads_a_shard_the_backward_does_not_gather_for_its_update():
    # Untied head: the root is the embedding alone, whose weight no backward op reads, so the
    # backward does not gather it; its shard is fetched for the update, ahead like its moments.
    with torch.device("meta"):
        model = zoo.build("gpt-tiny", n_blocks=6, tie_head=False)
    cfg = fxzero.Config(offload=fxzero.Offload(params=NVME, optimizer=NVME, step_in_backward=True), cost_model=None)
    schedule = fxzero.compile_program(model, model.example_inputs(batch=2), cfg, world_size=2).schedule
    backward = _ins(schedule, "backward")
    assert "root" not in {i.unit for i in backward if i.kind == "all_gather"}
    sharded = [u.name for u in schedule.units if u.trainable and u.name not in schedule.persistent]
    assert sorted(i.unit for i in backward if i.kind == "optim_step") == sorted(sharded)
    assert not [i for i in _ins(schedule, "step") if i.kind == "optim_step"]  # nothing left for the step
    index = {i.name: n for n, i in enumerate(backward)}
    (read,) = [i for i in backward if i.kind == "fetch" and i.unit == "root" and i.state == "param"]
    (scatter,) = [i for i in backward if i.kind == "reduce_scatter" and i.unit == "root"]
    (update,) = [i for i in backward if i.kind == "optim_step" and i.unit == "root"]
    assert index[read.name] < index[scatter.name] < index[update.name]  # read before the gradient is
    assert not [i for i in backward if i.kind == "offload" and i.state == "grad"]  # no gradient round trip

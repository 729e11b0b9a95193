"""The benchmark's parts on their own: run spec, system table, traffic counter, summary."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks
from tools.bench import report, systems
from tools.bench.commcount import CommCounter, install
from tools.bench.spec import RunSpec


def test_run_spec_round_trips_through_json():
    spec = RunSpec(model="tiny", batch=3, warmup=0, steps=2, betas=(0.8, 0.9))
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="steps"):
        RunSpec(model="tiny", batch=1, steps=0)


def test_unknown_config_knob_makes_a_system_unavailable(monkeypatch):
    monkeypatch.setitem(
        systems.SYSTEMS, "fxzero-bogus", systems.System("fxzero_engine", {"config": {"no_such_knob": 1}})
    )
    reason = systems.unavailable("fxzero-bogus", RunSpec(model="tiny", batch=1))
    assert reason is not None and "no_such_knob" in reason
    assert systems.unavailable("fxzero-stage3", RunSpec(model="tiny", batch=1)) is None


def _count_collectives(rank: int, world: int) -> dict:
    counter = CommCounter()
    install(counter)
    dist.all_reduce(torch.ones(5))  # not counted: the counter is off
    counter.enabled = True
    out = torch.empty(4 * world)
    dist.all_gather_into_tensor(out, torch.ones(4))
    dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * world))
    dist.all_reduce(torch.ones(7))
    dist.barrier()
    counter.enabled = False
    return counter.report(steps=1)


def test_counter_counts_full_buffers_once():
    world = 2
    for rep in run_ranks(_count_collectives, world):
        kinds = rep["by_kind"]
        assert kinds["all_gather"] == {"calls": 1, "elements": 4 * world, "bytes": 16 * world}
        assert kinds["reduce_scatter"] == {"calls": 1, "elements": 3 * world, "bytes": 12 * world}
        assert kinds["all_reduce"] == {"calls": 1, "elements": 7, "bytes": 28}
        assert kinds["barrier"]["calls"] == 1
        assert rep["elements"] == 4 * world + 3 * world + 7
        assert rep["volume_elements"] == 4 * world + 3 * world + 2 * 7


def _system(median: float, rss: float, elements: float, volume: float) -> dict:
    return {
        "median_step_s": median, "peak_rss_mb": rss, "comm_elements_per_step": elements,
        "comm_volume_elements_per_step": volume, "loss_max_abs_dev_vs_ddp": 0.0,
        "loss_max_rel_dev_vs_ddp": 0.0,
    }


def test_summary_ratios():
    phi = 100
    line = report.summary_line(
        {
            "ddp": {"median_step_s": 1.0, "peak_rss_mb": 900.0, "comm_elements_per_step": phi},
            "fsdp2": _system(2.0, 1000.0, 300, 300),
            "ds-zero3": _system(4.0, 1200.0, 300, 300),
            "fxzero-stage3": _system(1.0, 1100.0, 302, 402),
        },
        phi, "tiny", {"ds-zero3-offload-nvme": "no libaio"},
    )
    fx = line["fxzero"]["fxzero-stage3"]
    assert fx["step_vs_fsdp2"] == pytest.approx(0.5)
    assert fx["step_vs_ds_zero3"] == pytest.approx(0.25)
    assert fx["peak_rss_vs_fsdp2"] == pytest.approx(1.1)
    assert fx["comm_vs_3phi"] == pytest.approx(302 / 300)
    assert fx["met"] == {"step_vs_fsdp2": True, "step_vs_ds_zero3": True, "peak_rss_vs_fsdp2": False, "comm_vs_3phi": True}
    assert line["unavailable"] == {"ds-zero3-offload-nvme": "no libaio"}
    assert line["losses_agree"] is True

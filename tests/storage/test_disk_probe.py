"""The disk under an `Nvme` placement measured for `cost_model="measure"`
(fxzero/runtime/storage/disk_probe.py): the probe writes and reads through the run's own tier
and leaves nothing behind; the cost model's NVMe links become the measured ones, rank 0's on
every rank; a config without NVMe, a pinned cost model, or a directory that does not exist
changes nothing. (Rates are never asserted beyond being positive and finite: tests never
assert a speed.)"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.cost.model import DEFAULT_IO, Link
from fxzero.cost.presets import preset
from fxzero.runtime.storage import disk_probe
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_the_probe_measures_both_directions_and_leaves_no_file(tmp_path):
    nvme = fxzero.Nvme(path=str(tmp_path))
    links = disk_probe.measure_disk(nvme, nbytes=4 << 20)
    assert set(links) == {"nvme_write", "nvme_read"}
    for link in links.values():
        assert link.bandwidth > 0 and math.isfinite(link.bandwidth) and link.latency == disk_probe.LATENCY_S
    assert 0.0 <= disk_probe.measure_interference(nvme, links["nvme_write"], seconds=0.05) <= 2.0
    assert os.listdir(tmp_path) == []


def test_the_cost_model_takes_the_measured_disk_once_per_process(tmp_path, monkeypatch):
    calls = []

    def fake(nvme, nbytes=disk_probe.PROBE_BYTES):  # (pinned figures: the rates, not the disk, are under test)
        calls.append(nvme.path)
        rate = 1e8 if nvme.path.endswith("slow") else 4e8
        return {"nvme_write": Link(bandwidth=rate, latency=1e-4),
                "nvme_read": Link(bandwidth=2 * rate, latency=1e-4)}

    monkeypatch.setattr(disk_probe, "measure_disk", fake)
    slowed = []
    monkeypatch.setattr(disk_probe, "measure_interference",
                        lambda nvme, write: slowed.append((nvme.path, write)) or 0.7)
    monkeypatch.setattr(disk_probe, "_MEASURED", {})
    (tmp_path / "slow").mkdir()
    (tmp_path / "fast").mkdir()
    base = preset("cpu-loopback")
    config = fxzero.Config(offload=fxzero.Offload(params=fxzero.Nvme(path=str(tmp_path / "fast")),
                                                  optimizer=fxzero.Nvme(path=str(tmp_path / "fast"))),
                           activations=fxzero.Activations(offload=fxzero.Nvme(path=str(tmp_path / "slow"))))
    measured = disk_probe.with_measured_disks(base, disk_probe.nvme_placements(config))
    # The slowest disk prices the tier; every other figure is the cost model's own.
    assert measured.io["nvme_write"].bandwidth == 1e8 and measured.io["nvme_read"].bandwidth == 2e8
    assert measured.io_interference == 0.7 and slowed == [(str(tmp_path / "slow"), measured.io["nvme_write"])]
    assert dataclasses.replace(measured, io=base.io, io_interference=base.io_interference) == base
    assert sorted(calls) == sorted([str(tmp_path / "fast"), str(tmp_path / "slow")])
    disk_probe.with_measured_disks(base, disk_probe.nvme_placements(config))
    assert len(calls) == 2, "measured once a process"


def test_no_nvme_or_a_missing_directory_changes_nothing(tmp_path):
    base = preset("cpu-loopback")
    assert disk_probe.with_measured_disks(base, disk_probe.nvme_placements(fxzero.Config())) is base
    missing = fxzero.Config(activations=fxzero.Activations(offload=fxzero.Nvme(path=str(tmp_path / "absent"))))
    assert disk_probe.with_measured_disks(base, disk_probe.nvme_placements(missing)) is base
    assert base.io.get("nvme_write", DEFAULT_IO["nvme_write"]) == DEFAULT_IO["nvme_write"]


def _compiled_io(rank: int, world_size: int, path: str, spec):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    config = fxzero.Config(cost_model=spec, activations=fxzero.Activations(offload=fxzero.Nvme(path=path)))
    engine = fxzero.compile(model, config)
    io = {k: v.bandwidth for k, v in engine.cost_model.io.items()}
    io["interference"] = engine.cost_model.io_interference
    engine.close()
    return io


def test_every_rank_compiles_with_rank_0s_measured_disk(tmp_path):
    """Two ranks on one disk, cost_model="measure": the NVMe links and the I/O interference are
    measured (not the defaults) and the same on both ranks; a pinned preset keeps its own."""
    measured = run_ranks(_compiled_io, 2, str(tmp_path), "measure")
    assert measured[0] == measured[1]
    assert set(measured[0]) >= {"nvme_write", "nvme_read"}
    assert measured[0]["nvme_write"] != DEFAULT_IO["nvme_write"].bandwidth
    pinned = run_ranks(_compiled_io, 2, str(tmp_path), "cpu-loopback")
    loopback = preset("cpu-loopback")
    assert pinned[0] == pinned[1] == {**{k: v.bandwidth for k, v in loopback.io.items()},
                                      "interference": loopback.io_interference}

"""tools/check_published.py and its table: the published rows as transcribed, the calibration
holding on its named rows, a held-out row predicted, and the presets stating what it fits."""

from __future__ import annotations

import csv
import importlib.util
import os

import pytest

from fxzero.cost import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "tests", "data", "published", "llm_foundry.csv")


def _tool():
    spec = importlib.util.spec_from_file_location("check_published", os.path.join(ROOT, "tools", "check_published.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_table_is_the_published_one():
    with open(TABLE, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 216  # every row of the README's five tables
    for r in rows:
        # The published columns agree with each other: tokens/s is per-GPU tokens/s x GPUs
        # (each rounded as published), and the global batch is micro-batch x GA x GPUs.
        per_gpu, gpus = int(r["tokens_per_s_per_gpu"]), int(r["gpus"])
        assert abs(int(r["tokens_per_s"]) / gpus - per_gpu) <= 1, r["source_line"]
        assert int(r["global_batch"]) == int(r["micro_batch"]) * int(r["grad_accum"]) * gpus, r["source_line"]
    checked = _tool().load_rows()
    assert len(checked) == 131
    assert {g: sum(r["gpu"] == g for r in checked) for g in ("a100_40gb", "a100_80gb", "h100_80gb")} == {
        "a100_40gb": 51, "a100_80gb": 39, "h100_80gb": 41}
    assert all(r["activation_checkpointing"] == "False" and r["precision"] != "amp_fp8" for r in checked)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tool = _tool()
    rows = [r for r in tool.load_rows() if int(r["source_line"]) in (138, 132, 136)]
    return tool.check(rows, cache=str(tmp_path_factory.mktemp("schedules")), log=lambda *a, **k: None)


def test_the_named_rows_are_fitted_and_a_held_out_row_is_predicted(result):
    by_line = {r["source_line"]: r for r in result["rows"]}
    # H100: matmul efficiency fitted on row 138 (MPT-1B, 8 GPUs, seq 2048), attention on 132
    # (seq 16384): both predicted as published.
    assert by_line[138]["ratio"] == pytest.approx(1.0, abs=2e-3)
    assert by_line[132]["ratio"] == pytest.approx(1.0, abs=2e-3)
    # Row 136: the same model on 32 GPUs (4 nodes) at micro-batch 20, published 45130 tokens/s
    # per GPU; not fitted on. Within the 10% median bar.
    assert by_line[136]["published"] == 45130
    assert by_line[136]["ratio"] == pytest.approx(1.0, abs=0.10)
    assert result["count"] == 3 and result["within_20pct"] == 3


def test_the_presets_state_what_the_tool_fits(result):
    fitted = result["calibration"]["h100_80gb"]
    assert fitted["rows"] == [138, 132] and fitted["preset"] == "h100-80gb"
    rates = PRESETS["h100-80gb"].rates
    assert rates.matmul_efficiency == pytest.approx(fitted["matmul_efficiency"], abs=0.01)
    assert rates.attention_efficiency == pytest.approx(fitted["attention_efficiency"], abs=0.01)
    assert PRESETS["h200-141gb"].rates == rates  # no published H200 rows: H100's


def test_an_unknown_row_is_named(capsys):
    with pytest.raises(SystemExit):
        _tool().main(["--rows", "1"])
    assert "no checkable row at source_line [1]" in capsys.readouterr().err

"""`fxzero schedule --html`: the schedule explorer, checked against the artifacts it draws.

The page is opened in a real headless Chromium (Debian's, driven by playwright, as
tests/cli/test_wall.py does) on a 2-rank `fxzero train` of the tiny GPT; those tests skip with
their reason where no browser is installed. The checks of the file itself (no external
reference, the embedded figures, the vendored library's checksums) need none.

References are independent of the page and of fxzero/viz/explorer.py: schedule.json, graph.json
and timeline.json as written, `fxzero.cost.simulate`, and what `fxzero schedule --simulate P`
prints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest

from fxzero import cost
from fxzero.artifacts import Artifacts
from fxzero.cli.common import describe_hardware
from fxzero.viz.explorer import explorer_data
from fxzero.viz.fmt import human_seconds
from tests.cli.conftest import TINY, invoke, one_line_error

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
VENDOR = os.path.join(os.path.dirname(__file__), "..", "..", "fxzero", "viz", "vendor", "uplot")
UNIT = "blocks.0"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, runner):
    """`fxzero train` of the tiny GPT on 2 ranks for 2 steps (records timeline.json)."""
    out = str(tmp_path_factory.mktemp("explorer") / "run")
    invoke(runner, "train", TINY, "--ranks", "2", "--steps", "2", "--collective-timeout", "120", "-o", out)
    return out


@pytest.fixture(scope="module")
def stage2(tmp_path_factory, runner):
    """`fxzero compile` of the same model at ZeRO-2: a second directory to compare, without a recording."""
    out = str(tmp_path_factory.mktemp("explorer") / "z2")
    invoke(runner, "compile", TINY, "--world", "2", "--stage", "2", "-o", out)
    return out


@pytest.fixture(scope="module")
def page(trained, runner, tmp_path_factory):
    path = tmp_path_factory.mktemp("page") / "explorer.html"
    result = invoke(runner, "schedule", trained, "--html", str(path))
    assert "summary (per rank" in result.output  # the single-DIR form still prints the table
    assert f"wrote {path} (" in result.output and path.as_uri() in result.output
    return path


@pytest.fixture(scope="module")
def two_page(trained, stage2, runner, tmp_path_factory):
    path = tmp_path_factory.mktemp("page") / "two.html"
    result = invoke(runner, "schedule", "--html", str(path), trained, stage2)
    assert result.output.startswith(f"wrote {path} (")
    return path


def _raw(directory: str, name: str):
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def _embedded(html: str) -> dict:
    (payload,) = re.findall(r'<script type="application/json" id="explorer-data">(.*?)</script>', html, re.S)
    return json.loads(payload)


def _instructions(directory: str) -> list[tuple[str, int, dict]]:
    """(program, index, instruction) of schedule.json, in program order."""
    return [(p["name"], i, ins) for p in _raw(directory, "schedule.json")["programs"]
            for i, ins in enumerate(p["instructions"])]


def _flat_index(directory: str, program: str, index: int) -> int:
    return [(p, i) for p, i, _ in _instructions(directory)].index((program, index))


def _unit_members(directory: str, unit: str) -> set[tuple[str, int]]:
    """The instructions of one unit, from the files: its own unit, else (compute) its owner module's."""
    owner = {n["name"]: n.get("owner") for n in _raw(directory, "graph.json")["nodes"]}
    return {(p, i) for p, i, ins in _instructions(directory) if (ins["unit"] or owner.get(ins["name"])) == unit}


def _cli_summary(runner, directory: str, preset: str) -> dict[str, str]:
    text = invoke(runner, "schedule", directory, "--simulate", preset).output
    lines = text[text.index("summary (per rank"):].splitlines()[1:]
    return {m.group(1): m.group(2) for m in (re.match(r"^  (\S.*?)  +(\S.*)$", line) for line in lines) if m}


# -- the file itself ---------------------------------------------------------------------------

BANNER = "/*! https://github.com/leeoniya/uPlot (v{}) */"


def test_page_references_nothing_outside_itself(page, two_page):
    version = open(os.path.join(VENDOR, "VERSION")).read().strip()
    for path in (page, two_page):
        html = path.read_text()
        # uPlot's license banner names its home in a comment: the one address, never requested.
        assert html.count(BANNER.format(version)) == 1
        html = html.replace(BANNER.format(version), "")
        assert not re.search(r"""\b(src|href|action|srcset)\s*=""", html, re.I), "the page must load nothing"
        assert not re.search(r"<(link|iframe|img|object|embed)\b", html, re.I)
        assert not re.search(r"url\(|@import|fetch\(|XMLHttpRequest|import\(|sendBeacon|WebSocket", html)
        assert re.findall(r"(?:https?|ftp|wss?)://\S*", html) == []


def test_vendored_uplot_is_the_pinned_one(page):
    sums = open(os.path.join(VENDOR, "SHA256SUMS")).read().split("\n")
    listed = dict(reversed(line.split("  ")) for line in sums if line)
    assert set(listed) == {"uPlot.iife.min.js", "uPlot.min.css", "LICENSE"}
    for name, digest in listed.items():
        with open(os.path.join(VENDOR, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, name
    version = open(os.path.join(VENDOR, "VERSION")).read().strip()
    js = open(os.path.join(VENDOR, "uPlot.iife.min.js")).read()
    assert js.startswith(BANNER.format(version)) and "The MIT License" in open(os.path.join(VENDOR, "LICENSE")).read()
    assert js in page.read_text()  # inlined byte for byte


def test_embedded_times_are_the_simulator_s_and_the_recording_s(page, trained):
    data = _embedded(page.read_text())
    art = Artifacts.read(trained)
    assert data == json.loads(json.dumps(explorer_data([(trained, art)], cost.PRESETS, default_preset="cpu-loopback",
                                                       describe=describe_hardware)))
    (run,) = data["runs"]
    flat = [(p, i) for p, i, _ in _instructions(trained)]
    assert set(data["presets"]) == set(cost.PRESETS) and data["default_preset"] == "cpu-loopback"
    for name, model in cost.PRESETS.items():
        sim = cost.simulate(art.schedule, model)
        by = {(e.program, e.index): [e.start, e.end, e.stream] for e in sim.events}
        assert run["simulated"][name]["times"] == [by[k] for k in flat]
        assert run["simulated"][name]["figures"]["step_seconds"] == sim.step_seconds
        assert run["simulated"][name]["summary"]["step time"].startswith(human_seconds(sim.step_seconds) + " = forward ")
    recorded = _raw(trained, "timeline.json")
    assert [r["rank"] for r in run["recorded"]["ranks"]] == [0, 1] and run["recorded"]["step"] == 2
    t0 = min(t[2] for r in recorded["ranks"] for t in r["instructions"])
    for r, shown in zip(recorded["ranks"], run["recorded"]["ranks"]):
        for program, index, start, end in r["instructions"]:
            s, e, stream = shown["times"][flat.index((program, index))]
            assert s == pytest.approx(start - t0, abs=1e-12) and e >= end - t0 - 1e-12
        # The memory curve's times never go back and each compute instruction's is its start.
        xs = shown["memory_x"]
        assert all(a <= b for a, b in zip(xs, xs[1:]))
        assert all(x == t[0] for x, t in zip(xs, shown["times"]) if t[2] == "compute")


def test_two_sources_need_the_explorer(runner, trained, stage2, tmp_path):
    one_line_error(invoke(runner, "schedule", trained, stage2, ok=False), "2 sources given",
                   "fxzero schedule --html OUT.html DIR_A DIR_B")
    one_line_error(invoke(runner, "schedule", trained, stage2, "--html", str(tmp_path / "x.html"), "--json", ok=False),
                   "no --json, --trace or --plot")
    one_line_error(invoke(runner, "schedule", trained, stage2, trained, "--html", str(tmp_path / "x.html"), ok=False),
                   "3 sources given")
    one_line_error(invoke(runner, "schedule", trained, "--html", str(tmp_path / "missing" / "x.html"), ok=False),
                   "missing")
    assert not (tmp_path / "x.html").exists()


# -- the page in a real browser -----------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium here: the explorer is not opened in a browser (scripts/setup.sh installs it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements.txt)")
    with sync_api.sync_playwright() as p:
        # Debian's chromium, never a downloaded one; no sandbox: tests may run as root.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Tab:
    """A page opened from file://, with every request and script error it made."""

    def __init__(self, browser, path, fragment=""):
        self.path = path
        self.tab = browser.new_page(viewport={"width": 1300, "height": 900})
        self.requests, self.errors = [], []
        self.tab.on("request", lambda r: self.requests.append(r.url))
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))
        self.tab.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.tab.goto(path.as_uri() + fragment)

    def clean(self):
        """Nothing but the file was requested and no script failed."""
        assert self.errors == []
        assert [r.split("#")[0] for r in self.requests] == [self.path.as_uri()]

    def groups(self):
        return self.tab.evaluate("FxzeroExplorer.groups()")


def test_browser_lists_every_unit_and_instruction(browser, page, trained):
    t = Tab(browser, page)
    units = [u["name"] for u in _raw(trained, "schedule.json")["units"]]
    assert t.tab.eval_on_selector_all("#unit option", "os => os.map(o => o.value)") == ["", *units]
    rows = t.tab.eval_on_selector_all('table.instructions[data-run="0"] tbody tr',
                                      "rs => rs.map(r => [...r.cells].slice(0, 6).map(c => c.textContent))")
    assert rows == [[p, str(i), ins["name"], ins["kind"], ins["stream"], rows[k][5]]
                    for k, (p, i, ins) in enumerate(_instructions(trained))]
    assert all(row[5] for row in rows)  # every instruction of this model belongs to a unit
    every = sorted((p, i) for p, i, _ in _instructions(trained))
    groups = t.groups()
    assert [g["label"] for g in groups] == [f"rank {r}: measured by fxzero train (step 2)" for r in (0, 1)]
    kinds = {(p, i): ins["kind"] for p, i, ins in _instructions(trained)}
    for g in groups:  # one lane group per rank, every instruction drawn once
        assert sorted((p, i) for p, i, _ in g["slices"]) == every
        for p, i, lane in g["slices"]:
            assert lane.startswith("comm") if kinds[(p, i)] in ("all_gather", "reduce_scatter") else lane == "compute"
    t.tab.select_option("#timeline-source", "simulated")
    (g,) = t.groups()
    assert g["label"] == "simulated for cpu-loopback" and sorted((p, i) for p, i, _ in g["slices"]) == every
    t.clean()


def test_browser_step_time_equals_the_cli_summary(browser, page, trained, runner):
    t = Tab(browser, page)
    for preset in ("h100x64-ib400", "h100x8-nvlink", "cpu-loopback"):
        t.tab.select_option("#preset", preset)
        cli = _cli_summary(runner, trained, preset)
        shown = dict(t.tab.eval_on_selector_all("#summary-0 dd", "ds => ds.map(d => [d.dataset.key, d.textContent])"))
        assert shown["preset"] == preset and f"preset={preset}" in t.tab.evaluate("location.hash")
        for key in ("step time", "exposed comm", "peak resident", "peak gathered", "hardware"):
            assert shown[key] == cli[key], (preset, key)
        sim = cost.simulate(Artifacts.read(trained).schedule, cost.PRESETS[preset])
        assert shown["step time"].startswith(human_seconds(sim.step_seconds) + " = ")
    t.clean()


def _hover(t, gi, program, index):
    """Zoom to an instruction, then move the real mouse over it; returns the tooltip's text."""
    span = t.tab.evaluate(
        """([gi, p, i]) => { const d = FxzeroExplorer.data.runs[0]; let k = 0;
             for (const q of d.programs) { if (q.name === p) break; k += q.instructions.length; }
             const g = FxzeroExplorer.groups()[gi]; return g.rank === null
               ? d.simulated[FxzeroExplorer.state.preset].times[k + i]
               : d.recorded.ranks[g.rank].times[k + i]; }""", [gi, program, index])
    pad = (span[1] - span[0]) * 0.5
    t.tab.evaluate(f"FxzeroExplorer.setView({span[0] - pad}, {span[1] + pad})")
    where = t.tab.evaluate(f"FxzeroExplorer.locate({gi}, {json.dumps(program)}, {index})")
    t.tab.mouse.move(where["x"], where["y"])
    assert t.tab.evaluate("FxzeroExplorer.hovered()") == [gi, program, index]
    assert t.tab.is_visible("#tooltip")
    return t.tab.text_content("#tooltip")


def test_browser_hovering_an_all_gather_shows_its_bytes(browser, page, trained):
    t = Tab(browser, page)
    gathers = [(p, i, ins) for p, i, ins in _instructions(trained) if ins["kind"] == "all_gather"]
    p, i, ins = next(g for g in gathers if g[2]["unit"] == UNIT)
    text = _hover(t, 1, p, i)
    assert f"all_gather {ins['name']}" in text and f"unit {UNIT}" in text
    assert f"bytes {ins['bytes']:,} (" in text and ins["bytes"] > 0
    assert "measured on rank 1 (fxzero train, step 2)" in text
    # The memory chart's cursor follows the mouse: the same time, inside the hovered slice.
    cursor = t.tab.evaluate("FxzeroExplorer.cursor()")
    start, end = t.tab.evaluate(f"FxzeroExplorer.data.runs[0].recorded.ranks[1].times[{_flat_index(trained, p, i)}]")[:2]
    assert start <= cursor["lanes"] <= end and cursor["memory"] == pytest.approx(cursor["lanes"], rel=1e-6)
    assert "resident" in t.tab.text_content(".u-legend")
    t.tab.mouse.move(5, 5)
    assert not t.tab.is_visible("#tooltip")
    assert t.tab.evaluate("FxzeroExplorer.cursor()") == {"lanes": None, "memory": None}
    t.tab.select_option("#timeline-source", "simulated")
    text = _hover(t, 0, p, i)
    assert f"bytes {ins['bytes']:,} (" in text and "simulated for cpu-loopback (fxzero.cost)" in text
    # Zoom with the wheel over the lanes: the memory chart's x range follows.
    before = t.tab.evaluate("FxzeroExplorer.view()")
    t.tab.mouse.wheel(0, 400)
    after = t.tab.evaluate("FxzeroExplorer.view()")
    assert after["max"] - after["min"] > 1.5 * (before["max"] - before["min"])
    assert t.tab.evaluate("FxzeroExplorer.plotScale()") == after
    t.clean()


def test_browser_unit_filter_highlights_only_that_unit(browser, page, trained):
    t = Tab(browser, page)
    assert t.tab.evaluate("FxzeroExplorer.highlighted()") == []
    t.tab.select_option("#unit", UNIT)
    members = _unit_members(trained, UNIT)
    kinds = {(p, i): ins["kind"] for p, i, ins in _instructions(trained)}
    assert {"all_gather", "wait", "compute", "free", "reduce_scatter"} <= {kinds[m] for m in members}
    lit = t.tab.evaluate("FxzeroExplorer.highlighted()")
    for gi in (0, 1):
        assert sorted((p, i) for _, g, p, i in lit if g == gi) == sorted(members)
    rows = t.tab.eval_on_selector_all('table.instructions[data-run="0"] tbody tr',
                                      "rs => rs.map(r => [r.dataset.program, +r.dataset.index, r.className])")
    assert {(p, i) for p, i, c in rows if c == "hl"} == members
    assert {(p, i) for p, i, c in rows if c == "dim"} == set(kinds) - members
    assert "unit=blocks.0" in t.tab.evaluate("location.hash")
    t.tab.select_option("#unit", "")
    assert t.tab.evaluate("FxzeroExplorer.highlighted()") == []
    t.clean()


def test_browser_two_directories_on_one_time_axis(browser, two_page, trained, stage2, runner):
    t = Tab(browser, two_page, "#timeline=recorded&preset=h100x8-nvlink")
    groups = t.groups()
    assert [(g["run"], g["label"]) for g in groups] == [
        (0, "rank 0: measured by fxzero train (step 2)"), (0, "rank 1: measured by fxzero train (step 2)"),
        (1, "simulated for h100x8-nvlink (no recorded timeline in this directory)")]
    assert sorted((p, i) for p, i, _ in groups[2]["slices"]) == sorted((p, i) for p, i, _ in _instructions(stage2))
    for run, directory in ((0, trained), (1, stage2)):
        n = len(_instructions(directory))
        assert t.tab.eval_on_selector_all(f'table.instructions[data-run="{run}"] tbody tr', "rs => rs.length") == n
        step = t.tab.text_content(f'#summary-{run} dd[data-key="step time"]')
        assert step == _cli_summary(runner, directory, "h100x8-nvlink")["step time"]
    assert t.tab.text_content("#summary-0 h3") == f"A: {trained}" and t.tab.text_content("#summary-1 h3") == f"B: {stage2}"
    t.tab.select_option("#timeline-source", "simulated")
    data = t.tab.evaluate("FxzeroExplorer.data")
    view = t.tab.evaluate("FxzeroExplorer.view()")
    ends = [max(e for _, _, e in r["simulated"]["h100x8-nvlink"]["programs"]) for r in data["runs"]]
    assert view["min"] == 0 and view["max"] >= max(ends) and ends[0] != ends[1]  # both fit, one axis
    assert t.tab.evaluate("FxzeroExplorer.plotScale()") == view
    assert t.tab.evaluate("FxzeroExplorer.seriesLabels()") == [
        "time", "A resident", "A gathered", "B resident", "B gathered"]
    t.clean()


def test_browser_fragment_problems_are_shown(browser, page):
    t = Tab(browser, page, "#preset=tpu&unit=blocks.9&colour=red")
    problems = t.tab.text_content("#problems")
    assert "preset=tpu is not one of cpu-loopback" in problems or "preset=tpu is not one of h100" in problems
    assert "unit=blocks.9 is not a unit here" in problems and 'unknown key "colour"' in problems
    assert t.tab.input_value("#preset") == "cpu-loopback"
    t.clean()

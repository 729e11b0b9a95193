"""`fxzero wall`: the Memory Wall page against Python's arithmetic.

The page's own script is run twice over: by node (the pure functions, over a grid) and in a real
headless Chromium driven by playwright (the page as a person opens it from file://). Each of
these skips with its reason where its program is missing; the checks of the file itself (no
external reference, the embedded rules, the presets) need neither.

References are independent of the page: `fxzero.estimate.paper_model_states` + `place` (what
`fxzero estimate --params` prints), the ZeRO paper's Table 1, and the published model shapes.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from fxzero import estimate
from fxzero.cli import main
from fxzero.cli.estimate_cmd import offload_policy as cli_offload_policy
from fxzero.viz.wall import OPTIMIZERS, offload_policy, render_wall, wall_data

NODE = shutil.which("node")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SVG_NAMESPACE = "http://www.w3.org/2000/svg"

GRID_PARAMS = [1e9, 1.234567891e9, 7.5e9, 8_030_261_248, 6.7e10, 1.3e11, 175e9, 1e12]
GRID_GPUS = [1, 3, 7, 64, 1000, 4096]
GRID = [dict(params=p, gpus=n, gpu=gpu, precision=prec, optimizer=opt, offload=off)
        for p, n, prec, opt, off, gpu in itertools.product(
            GRID_PARAMS, GRID_GPUS, ("fp32", "mixed"), ("adam", "adagrad"), ("none", "cpu", "nvme"), ("h100-80", "a100-40"))]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = tmp_path_factory.mktemp("wall") / "wall.html"
    result = CliRunner().invoke(main, ["wall", "-o", str(path)])
    assert result.exit_code == 0, result.output
    assert f"wrote {path}" in result.output
    return path


def _embedded(html: str) -> dict:
    (payload,) = re.findall(r'<script type="application/json" id="wall-data">(.*?)</script>', html, re.S)
    return json.loads(payload)


def python_figures(state: dict) -> list[dict]:
    """What `fxzero estimate --params` computes, per stage, for one view of the page."""
    rows = []
    for stage in estimate.STAGES:
        states = estimate.paper_model_states(state["params"], state["gpus"], stage, state["precision"],
                                             optimizer=OPTIMIZERS[state["optimizer"]])
        placed = estimate.place(states, stage, cli_offload_policy(None if state["offload"] == "none" else state["offload"]))
        gpu = wall_data()["gpus"][state["gpu"]]["bytes"]
        rows.append({"bytes": {"params": states.params, "grads": states.grads, "optimizer": states.optimizer},
                     "tiers": {"device": placed.device, "cpu": placed.cpu, "nvme": placed.nvme},
                     "fits": placed.device <= gpu, "left": gpu - placed.device})
    return rows


# -- the file itself ---------------------------------------------------------------------------

def test_page_references_nothing_outside_itself(page):
    html = page.read_text()
    assert not re.search(r"""\b(src|href|action|srcset)\s*=""", html, re.I), "the page must load nothing"
    assert not re.search(r"<(link|iframe|img|object|embed)\b", html, re.I)
    assert not re.search(r"url\(|@import|fetch\(|XMLHttpRequest|import\(", html)
    # The SVG namespace is a name createElementNS needs, never requested; nothing else names a scheme.
    assert re.findall(r"(?:https?|ftp|wss?)://\S*", html.replace(SVG_NAMESPACE, "")) == []
    assert "GB = 10<sup>9</sup> bytes" in html and "activations" in html


def test_embedded_rules_are_python_s(page):
    data = _embedded(page.read_text())
    assert data == json.loads(json.dumps(wall_data()))
    bpp = data["bytes_per_param"]
    # The paper's 2 + 2 + 12 and fp32's 4 + 4 + 8 with Adam; Adagrad keeps one state instead of two.
    assert bpp == {"fp32": {"adam": [4, 4, 8], "adagrad": [4, 4, 4]},
                   "mixed": {"adam": [2, 2, 12], "adagrad": [2, 2, 8]}}
    assert [s["sharded"] for s in data["stages"]] == [
        {"params": False, "grads": False, "optimizer": False},
        {"params": False, "grads": False, "optimizer": True},
        {"params": False, "grads": True, "optimizer": True},
        {"params": True, "grads": True, "optimizer": True}]
    for off in ("cpu", "nvme"):
        assert data["placement"][off] == {
            "0": {"params": "device", "grads": "device", "optimizer": "device"},
            "1": {"params": "device", "grads": "device", "optimizer": off},
            "2": {"params": "device", "grads": off, "optimizer": off},
            "3": {"params": off, "grads": off, "optimizer": off}}
    assert all(t == "device" for s in data["placement"]["none"].values() for t in s.values())
    assert {k: g["bytes"] for k, g in data["gpus"].items()} == {
        "a100-40": 40e9, "a100-80": 80e9, "h100-80": 80e9, "h200-141": 141e9, "b200-192": 192e9}
    assert data["unit"] == {"name": "GB", "bytes": 1e9}
    assert data["limits"] == {"params": [1e9, 1e12], "gpus": [1, 4096]}


def test_offload_choice_is_the_estimate_command_s():
    for off in ("cpu", "nvme"):
        assert offload_policy(off) == cli_offload_policy(off)
    assert offload_policy("none") is None and cli_offload_policy(None) is None


def _llama(hidden, layers, kv_heads, heads, intermediate, vocab=128_256):
    """Parameters of a Llama 3 checkpoint from its config: untied embeddings, GQA, SwiGLU, RMSNorm."""
    head = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head
    layer = attention + 3 * hidden * intermediate + 2 * hidden
    return layers * layer + 2 * vocab * hidden + hidden


def test_presets_are_the_published_sizes(page):
    presets = {k: p["params"] for k, p in _embedded(page.read_text())["presets"].items()}
    assert presets == {
        "gpt3-175b": 175e9,  # Brown et al. 2020, Table 2.1: 175.0B
        "llama3-8b": _llama(4096, 32, 8, 32, 14336),
        "llama3-70b": _llama(8192, 80, 8, 64, 28672),
        "llama3-405b": _llama(16384, 126, 8, 128, 53248),
    }
    assert presets["llama3-8b"] == 8_030_261_248 and presets["llama3-405b"] == 405_853_388_800


def test_command_reports_an_unwritable_output(tmp_path):
    result = CliRunner().invoke(main, ["wall", "-o", str(tmp_path / "missing" / "wall.html")])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "missing" in result.output


def test_open_hands_the_file_to_the_browser(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    result = CliRunner().invoke(main, ["wall", "-o", str(tmp_path / "w.html"), "--open"])
    assert result.exit_code == 0, result.output
    assert opened == [(tmp_path / "w.html").as_uri()]
    monkeypatch.setattr("webbrowser.open", lambda url: False)
    result = CliRunner().invoke(main, ["wall", "-o", str(tmp_path / "w.html"), "--open"])
    assert result.exit_code == 1 and "no browser could be started here; open file://" in result.output


# -- the page's script under node ---------------------------------------------------------------

NODE_HARNESS = r"""
const fs = require("fs"), vm = require("vm");
const html = fs.readFileSync(process.argv[2], "utf8");
const data = JSON.parse(html.match(/<script type="application\/json" id="wall-data">([\s\S]*?)<\/script>/)[1]);
const scripts = [...html.matchAll(/<script>([\s\S]*?)<\/script>/g)].map(m => m[1]);
if (scripts.length !== 1) throw new Error("expected one script, found " + scripts.length);
vm.runInThisContext(scripts[0]);
const W = globalThis.FxzeroWall;
const ask = JSON.parse(fs.readFileSync(0, "utf8"));
const out = {
  figures: ask.states.map(s => W.figures(data, s)),
  table1: W.figures(data, W.parseFragment(data, "#params=7.5e9&gpus=64").state).map(r => W.gb(data, r.tiers.device)),
  formulas: data.stages.map(st => W.closedForm(data, W.parseFragment(data, "").state, st)),
  offloaded: data.stages.map(st => [W.formula(data, W.parseFragment(data, "#offload=cpu").state, st),
                                     W.offloadNote(data, W.parseFragment(data, "#offload=cpu").state, st),
                                     W.offloadNote(data, W.parseFragment(data, "").state, st)]),
  counts: [1e9, 7.5e9, 8030261248, 405853388800, 1e12].map(W.count),
  fragments: ask.states.map(s => { const f = W.formatFragment(s); return [f, W.parseFragment(data, f)]; }),
  bad: ask.bad.map(h => W.parseFragment(data, h)),
};
process.stdout.write(JSON.stringify(out));
"""

BAD_FRAGMENTS = ["#params=5e13", "#gpus=1.5", "#gpus=0", "#colour=red", "#offload=disk", "#params="]


@pytest.fixture(scope="module")
def node_run(page, tmp_path_factory):
    if NODE is None:
        pytest.skip("node is not installed: the page's script is not evaluated here (apt-get install nodejs)")
    harness = tmp_path_factory.mktemp("node") / "harness.js"
    harness.write_text(NODE_HARNESS)
    proc = subprocess.run([NODE, str(harness), str(page)], input=json.dumps({"states": GRID, "bad": BAD_FRAGMENTS}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_node_page_numbers_equal_python_s_over_a_grid(node_run):
    assert len(node_run["figures"]) == len(GRID) == 1152
    for state, rows in zip(GRID, node_run["figures"]):
        for got, want in zip(rows, python_figures(state), strict=True):
            # Exactly: the page evaluates the same products and sums in the same order.
            assert {k: got[k] for k in want} == want, state


def test_node_table1_and_formulas(node_run):
    assert node_run["table1"] == ["120", "31.4", "16.6", "1.88"]  # ZeRO paper, Table 1 (7.5B, N = 64)
    assert node_run["formulas"] == ["16\u03a6", "4\u03a6 + 12\u03a6/N", "2\u03a6 + 14\u03a6/N", "16\u03a6/N"]
    phi = "\u03a6"
    assert node_run["offloaded"] == [
        [f"DDP: params 2{phi} + grads 2{phi} + optimizer 12{phi} = 16{phi}",
         "offload has no effect here: without ZeRO every GPU keeps all of its states", ""],
        [f"ZeRO-1: params 2{phi} + grads 2{phi} + optimizer 12{phi}/N [cpu] = 4{phi} + 12{phi}/N", "", ""],
        [f"ZeRO-2: params 2{phi} + grads 2{phi}/N [cpu] + optimizer 12{phi}/N [cpu] = 2{phi} + 14{phi}/N", "", ""],
        [f"ZeRO-3: params 2{phi}/N [cpu] + grads 2{phi}/N [cpu] + optimizer 12{phi}/N [cpu] = 16{phi}/N", "", ""]]
    assert node_run["counts"] == ["1.00B", "7.50B", "8.03B", "406B", "1.00T"]


def test_node_fragment_round_trips(node_run):
    for state, (fragment, parsed) in zip(GRID, node_run["fragments"]):
        assert parsed == {"state": state, "problems": []}, fragment
    assert node_run["fragments"][GRID.index(dict(GRID[0], params=7.5e9, gpus=64))][0] == \
        "#params=7.5e9&gpus=64&gpu=h100-80&precision=fp32&optimizer=adam&offload=none"


def test_node_bad_fragments_are_reported_not_dropped(node_run):
    problems = [p["problems"] for p in node_run["bad"]]
    assert problems == [
        ["params=5e13 is outside 1e9 to 1e12; using 1e12"],
        ["gpus=1.5 is not a whole number; using 64"],
        ["gpus=0 is outside 1 to 4096; using 1"],
        ['unknown key "colour" ignored; the keys are params, gpus, gpu, precision, optimizer, offload'],
        ["offload=disk is not one of none, cpu, nvme; using none"],
        ["params= is not a number; using 7.5e9"],
    ]


# -- the page in a real browser -----------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium here: the page is not opened in a browser (scripts/setup.sh installs it as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements.txt)")
    with sync_api.sync_playwright() as p:
        # Debian's chromium, never a downloaded one; no sandbox: tests may run as root.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, page_path, fragment):
    tab = browser.new_page()
    requests, errors = [], []
    tab.on("request", lambda r: requests.append(r.url))
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.goto(page_path.as_uri() + fragment)
    return tab, requests, errors


def _device_column(tab):
    return tab.eval_on_selector_all("#figures tbody td.device", "cells => cells.map(c => c.textContent)")


def test_browser_table1_gpus_control_and_no_requests(browser, page):
    tab, requests, errors = _open(browser, page, "#params=7.5e9&gpus=64")
    assert _device_column(tab) == ["120", "31.4", "16.6", "1.88"]
    assert tab.eval_on_selector_all("#figures td.fits, #figures td.nofit", "c => c.map(x => x.textContent)") == [
        "does not fit", "fits", "fits", "fits"]
    for gpus in (128, 1000, 8):
        tab.fill("#gpus", str(gpus))
        tab.dispatch_event("#gpus", "change")
        zero3 = _device_column(tab)[3]
        assert zero3 == f"{16 * 7.5e9 / gpus / 1e9:#.3g}", gpus  # 16 Phi / N, three digits
        assert f"gpus={gpus}&" in tab.evaluate("location.hash")
    tab.select_option("#offload", "cpu")
    assert _device_column(tab)[3] == "0" and "offload=cpu" in tab.evaluate("location.hash")
    assert tab.text_content("#problems") == ""
    assert requests == [page.as_uri() + "#params=7.5e9&gpus=64"] or requests == [page.as_uri()]
    assert errors == []
    tab.close()


def test_browser_numbers_equal_python_s_over_a_grid(browser, page):
    tab, requests, errors = _open(browser, page, "")
    got = tab.evaluate("""states => { const d = JSON.parse(document.getElementById("wall-data").textContent);
                                      return states.map(s => FxzeroWall.figures(d, s)); }""", GRID)
    for state, rows in zip(GRID, got, strict=True):
        for r, want in zip(rows, python_figures(state), strict=True):
            assert {k: r[k] for k in want} == want, state
    assert errors == [] and len(requests) == 1
    tab.close()


def test_browser_fragment_restores_the_view(browser, page):
    fragment = "#params=4.05853388800e11&gpus=4096&gpu=b200-192&precision=fp32&optimizer=adagrad&offload=nvme"
    tab, _, errors = _open(browser, page, fragment)
    assert [tab.input_value(f"#{k}") for k in ("gpus", "gpu", "precision", "optimizer", "offload")] == [
        "4096", "b200-192", "fp32", "adagrad", "nvme"]
    assert float(tab.input_value("#params")) == 405_853_388_800
    tab.select_option("#gpu", "a100-40")  # any change writes the whole, canonical view back
    assert tab.evaluate("location.hash") == (
        "#params=4.058533888e11&gpus=4096&gpu=a100-40&precision=fp32&optimizer=adagrad&offload=nvme")
    tab, _, _ = _open(browser, page, "#gpus=two&colour=red")
    assert "gpus=two is not a whole number" in tab.text_content("#problems")
    assert 'unknown key "colour"' in tab.text_content("#problems")
    assert errors == []


def test_browser_preset_slider_and_pasted_fragment(browser, page):
    tab, requests, errors = _open(browser, page, "#gpus=8")
    tab.select_option("#preset", "llama3-70b")
    assert float(tab.input_value("#params")) == 70_553_706_496
    assert tab.evaluate("location.hash").startswith("#params=7.0553706496e10&gpus=8&")
    assert tab.text_content("#params-text") == "70.6B parameters"
    # 70.55B x 16 / 8 GPUs = 141.1 GB at ZeRO-3: over the H100, under the B200.
    assert _device_column(tab)[3] == "141" and tab.text_content("#figures tr[data-stage='3'] td.nofit") == "does not fit"
    tab.select_option("#gpu", "b200-192")
    assert tab.text_content("#figures tr[data-stage='3'] td.fits") == "fits"
    tab.fill("#params-range", "11")  # log10 of the parameters
    tab.dispatch_event("#params-range", "input")
    assert float(tab.input_value("#params")) == 1e11 and _device_column(tab)[0] == "1,600"
    tab.evaluate("location.hash = '#params=2e9&gpus=2&precision=fp32'")  # a link pasted into the address bar
    tab.wait_for_function("document.querySelector('#gpus').value === '2'")
    assert _device_column(tab) == ["32.0", "24.0", "20.0", "16.0"]  # fp32: 16, 8 + 8/N, 4 + 12/N, 16/N bytes x 2e9
    assert errors == [] and len(requests) == 1

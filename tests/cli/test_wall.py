"""`fxzero wall`: the Memory Wall page against Python's arithmetic.

The page's own script is run twice over: by node (the pure functions, over a grid) and in a real
headless Chromium driven by playwright (the page as a person opens it from file://). Each of
these skips with its reason where its program is missing; the checks of the file itself (no
external reference, the embedded rules, the presets) need neither.

References are independent of the page: `fxzero.estimate.paper_model_states` + `place` (what
`fxzero estimate --params` prints), `fxzero.activation_estimate.megatron_per_layer` times the
layers (activations), the ZeRO paper's Table 1, Korthikanti et al.'s 34sbh + 5as^2b, and the
published model shapes.
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
from fxzero.activation_estimate import megatron_per_layer
from fxzero.cli import main
from fxzero.cli.estimate_cmd import offload_policy as cli_offload_policy
from fxzero.viz.wall import OPTIMIZERS, offload_policy, render_wall, wall_data

NODE = shutil.which("node")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SVG_NAMESPACE = "http://www.w3.org/2000/svg"

GRID_PARAMS = [1e9, 1.234567891e9, 7.5e9, 8_030_261_248, 6.7e10, 1.3e11, 175e9, 1e12]
GRID_GPUS = [1, 3, 7, 64, 1000, 4096]
# Activations off (seq 0): the page as it was before activations, shape keys at their defaults.
NO_ACTIVATIONS = dict(seq=0, mb=1, layers=32, hidden=4096, heads=32, recompute="none", fused=1, dropout=1)
GRID = [dict(NO_ACTIVATIONS, params=p, gpus=n, gpu=gpu, precision=prec, optimizer=opt, offload=off)
        for p, n, prec, opt, off, gpu in itertools.product(
            GRID_PARAMS, GRID_GPUS, ("fp32", "mixed"), ("adam", "adagrad"), ("none", "cpu", "nvme"), ("h100-80", "a100-40"))]

# (params, layers, hidden, heads): the presets' published shapes and an uneven one.
SHAPES = [(175e9, 96, 12288, 96), (8_030_261_248.0, 32, 4096, 32), (70_553_706_496.0, 80, 8192, 64),
          (405_853_388_800.0, 126, 16384, 128), (1.234567891e9, 7, 1000, 3)]
# Sequences up to 128K tokens, so the fp32 unfused totals pass 2^53 bytes and must round as Python's.
ACT_GRID = [dict(params=params, gpus=(8, 64, 1000)[i % 3], gpu="h100-80", precision=prec, optimizer="adam",
                 offload=("none", "cpu")[i % 2], seq=seq, mb=mb, layers=layers, hidden=hidden, heads=heads,
                 recompute=rc, fused=fused, dropout=dropout)
            for i, ((params, layers, hidden, heads), seq, mb, rc, prec, fused, dropout) in enumerate(itertools.product(
                SHAPES, (0, 1, 2048, 8192, 131072), (1, 3, 16), ("none", "unit", "selective"), ("fp32", "mixed"),
                (1, 0), (1, 0)))]
ITEMSIZE = {"fp32": 4, "mixed": 2}  # the page's stated choice: the forward's dtype


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


def python_activations(state: dict) -> int:
    """Activation bytes per GPU: Megatron's per-layer formula times the layers (none without a sequence)."""
    if not state["seq"]:
        return 0
    return state["layers"] * megatron_per_layer(
        state["seq"], state["mb"], state["hidden"], state["heads"], itemsize=ITEMSIZE[state["precision"]],
        dropout=bool(state["dropout"]), fused_attention=bool(state["fused"]), recompute=state["recompute"])


def python_figures(state: dict) -> list[dict]:
    """What `fxzero estimate --params` computes, per stage, for one view of the page, plus the
    activations every stage holds on the GPU."""
    rows = []
    activations = python_activations(state)
    for stage in estimate.STAGES:
        states = estimate.paper_model_states(state["params"], state["gpus"], stage, state["precision"],
                                             optimizer=OPTIMIZERS[state["optimizer"]])
        placed = estimate.place(states, stage, cli_offload_policy(None if state["offload"] == "none" else state["offload"]))
        gpu = wall_data()["gpus"][state["gpu"]]["bytes"]
        on_gpu = placed.device + activations
        rows.append({"bytes": {"params": states.params, "grads": states.grads, "optimizer": states.optimizer},
                     "tiers": {"device": placed.device, "cpu": placed.cpu, "nvme": placed.nvme},
                     "activations": float(activations), "on_gpu": on_gpu, "fits": on_gpu <= gpu, "left": gpu - on_gpu})
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
    assert data["limits"] == {"params": [1e9, 1e12], "gpus": [1, 4096], "seq": [0, 1_048_576], "mb": [1, 4096],
                              "layers": [1, 1000], "hidden": [1, 1_048_576], "heads": [1, 4096]}
    acts = data["activations"]
    assert acts["itemsize"] == ITEMSIZE
    coef = acts["coefficients"]
    # Korthikanti et al. 2022: 34sbh + 5as^2b in 16 bits with dropout; 34sbh when the scores are not
    # kept (fused attention, selective recompute); 2sbh under full recompute.
    assert coef["mixed"]["none"]["0"]["1"] == {"sbh": 34, "as2b": 5}
    assert coef["mixed"]["none"]["1"]["1"] == coef["mixed"]["selective"]["0"]["1"] == {"sbh": 34, "as2b": 0}
    assert coef["mixed"]["unit"]["0"]["1"] == {"sbh": 2, "as2b": 0}
    # fp32: 16 tensors of 4 bytes + 2 masks; scores 4 + 4 + 1 bytes; a layer's input in 4 bytes.
    assert coef["fp32"]["none"]["0"]["1"] == {"sbh": 66, "as2b": 9}
    assert coef["fp32"]["unit"]["1"]["0"] == {"sbh": 4, "as2b": 0}
    assert coef["mixed"]["none"]["0"]["0"] == {"sbh": 32, "as2b": 2}  # no dropout: no masks, no dropped scores
    assert data["defaults"]["seq"] == 0 and data["defaults"]["fused"] == 1


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
    embedded = _embedded(page.read_text())["presets"]
    presets = {k: p["params"] for k, p in embedded.items()}
    assert presets == {
        "gpt3-175b": 175e9,  # Brown et al. 2020, Table 2.1: 175.0B
        "llama3-8b": _llama(4096, 32, 8, 32, 14336),
        "llama3-70b": _llama(8192, 80, 8, 64, 28672),
        "llama3-405b": _llama(16384, 126, 8, 128, 53248),
    }
    assert presets["llama3-8b"] == 8_030_261_248 and presets["llama3-405b"] == 405_853_388_800
    # GPT-3: Brown et al. 2020, Table 2.1; Llama 3: num_hidden_layers, hidden_size, num_attention_heads.
    assert {k: (p["layers"], p["hidden"], p["heads"]) for k, p in embedded.items()} == {
        "gpt3-175b": (96, 12288, 96), "llama3-8b": (32, 4096, 32), "llama3-70b": (80, 8192, 64),
        "llama3-405b": (126, 16384, 128)}


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
  act_figures: ask.act_states.map(s => W.figures(data, s)),
  per_layer: ask.act_states.map(s => W.activations(data, s).perLayer),
  act_fragments: ask.act_states.map(s => { const f = W.formatFragment(s); return [f, W.parseFragment(data, f)]; }),
  act_forms: ["none", "unit", "selective"].flatMap(rc => ["fp32", "mixed"].flatMap(
    prec => [1, 0].map(fused => W.activationClosedForm(W.coefficients(data, Object.assign({}, data.defaults,
      { recompute: rc, precision: prec, fused: fused, dropout: 1 })))))),
  texts: ask.texts.map(h => { const st = W.parseFragment(data, h).state;
                              return [W.activationFormula(data, st), W.activationNotes(data, st)]; }),
};
process.stdout.write(JSON.stringify(out));
"""

BAD_FRAGMENTS = ["#params=5e13", "#gpus=1.5", "#gpus=0", "#colour=red", "#offload=disk", "#params=",
                 "#seq=2048&mb=0", "#seq=2k", "#seq=64&fused=yes", "#seq=64&recompute=all", "#layers=80&heads=64",
                 "#seq=0&mb=2"]
TEXTS = ["#seq=2048&mb=8&fused=0", "#seq=2048&mb=8", "#seq=4096&recompute=unit&precision=fp32", ""]


@pytest.fixture(scope="module")
def node_run(page, tmp_path_factory):
    if NODE is None:
        pytest.skip("node is not installed: the page's script is not evaluated here (apt-get install nodejs)")
    harness = tmp_path_factory.mktemp("node") / "harness.js"
    harness.write_text(NODE_HARNESS)
    ask = {"states": GRID, "bad": BAD_FRAGMENTS, "act_states": ACT_GRID, "texts": TEXTS}
    proc = subprocess.run([NODE, str(harness), str(page)], input=json.dumps(ask),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout, parse_int=_as_float)


def _as_float(digits: str) -> float:
    """JSON's integers as the doubles they were: JS writes 2^53-plus doubles in their shortest digits
    ("22965470590287870"), which as a Python int is not the double's exact value."""
    return float(digits)


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
        problems[3],
        ["offload=disk is not one of none, cpu, nvme; using none"],
        ["params= is not a number; using 7.5e9"],
        ["mb=0 is outside 1 to 4096; using 1"],
        ["seq=2k is not a whole number; using 0"],
        ["fused=yes is not 0 or 1; using 1"],
        ["recompute=all is not one of none, unit, selective; using none"],
        ["layers, heads have no effect without a sequence length: activations are counted when seq > 0"],
        ["mb has no effect without a sequence length: activations are counted when seq > 0"],
    ]
    assert problems[3] == ['unknown key "colour" ignored; the keys are params, gpus, gpu, precision, optimizer, '
                           'offload, seq, mb, layers, hidden, heads, recompute, fused, dropout']


def test_node_activations_equal_python_s_over_a_grid(node_run):
    assert len(node_run["act_figures"]) == len(ACT_GRID) == 1800
    for state, rows, per_layer in zip(ACT_GRID, node_run["act_figures"], node_run["per_layer"], strict=True):
        want_rows = python_figures(state)
        assert per_layer == (python_activations(state) // state["layers"] if state["seq"] else 0), state
        for got, want in zip(rows, want_rows, strict=True):
            assert {k: got[k] for k in want} == want, state
    # Past 2^53 bytes the page's one rounding is Python's: the grid reaches there.
    assert max(r[0]["activations"] for r in node_run["act_figures"]) > 2 ** 53


def test_node_activation_formula_and_the_paper_s_numbers(node_run):
    # recompute x precision x fused (dropout on), in the paper's notation.
    assert node_run["act_forms"] == ["66sbh", "66sbh + 9as\u00b2b", "34sbh", "34sbh + 5as\u00b2b",
                                     "4sbh", "4sbh", "2sbh", "2sbh",
                                     "66sbh", "66sbh", "34sbh", "34sbh"]
    (unfused, unfused_notes), (fused, fused_notes), (unit, unit_notes), (off, off_notes) = node_run["texts"]
    # Llama-3 8B's shape (the defaults), s 2048, b 8, unfused: 32 x (34sbh + 5as^2b), the paper's formula
    # written out here, not taken from the code.
    s, b, h, a, layers = 2048, 8, 4096, 32, 32
    assert layers * (34 * s * b * h + 5 * a * s * s * b) == 244_813_135_872
    assert unfused == ("activations per GPU, every stage: L \u00d7 (34sbh + 5as\u00b2b) = 32 \u00d7 "
                       "(34 \u00d7 2048 \u00d7 8 \u00d7 4096 + 5 \u00d7 32 \u00d7 2048\u00b2 \u00d7 8) bytes = 245 GB "
                       "(recompute none, 2-byte values, 1-byte dropout masks, unfused attention)")
    assert unfused_notes == []
    assert fused.startswith("activations per GPU, every stage: L \u00d7 34sbh = 32 \u00d7 34 \u00d7 2048 \u00d7 8 "
                            "\u00d7 4096 bytes = 73.0 GB")
    assert fused_notes == ["heads has no effect: no attention scores are kept"]
    assert "L \u00d7 4sbh = 32 \u00d7 4 \u00d7 4096 \u00d7 1 \u00d7 4096 bytes = 2.15 GB" in unit
    assert "4-byte values" in unit
    assert unit_notes == ["fused attention has no effect with recompute unit", "dropout has no effect with recompute unit",
                          "heads has no effect: no attention scores are kept"]
    assert (off, off_notes) == ("activations: not counted (give a sequence length)", [])


def test_node_activation_fragments_round_trip(node_run):
    for state, (fragment, parsed) in zip(ACT_GRID, node_run["act_fragments"], strict=True):
        assert parsed["problems"] == [], fragment
        if state["seq"]:
            assert parsed["state"] == state, fragment
        else:  # without a sequence the activation keys do nothing and are not written
            assert "seq=" not in fragment and parsed["state"] == dict(state, **NO_ACTIVATIONS), fragment
    with_seq = ACT_GRID.index(next(s for s in ACT_GRID if s["seq"] == 2048 and s["recompute"] == "unit"))
    assert node_run["act_fragments"][with_seq][0].endswith(
        "&seq=2048&mb=1&layers=96&hidden=12288&heads=96&recompute=unit&fused=1&dropout=1")


def test_node_verdict_flips_with_activations(node_run):
    # 7.5B on 64 GPUs (Table 1: 120 / 31.4 / 16.6 / 1.88 GB of states) with Llama-3 8B's shape at s 2048:
    # fused, 34sbh x 32 layers = 4.56 GB per sequence. b 4 adds 36.5 GB: ZeRO-1 to 3 still fit an 80 GB
    # H100; b 8 adds 73.0 GB: only ZeRO-3 (1.88 + 73.0) does; unit recompute (2sbh) fits them all again.
    table1 = [120e9, 31.4e9, 16.6e9, 1.875e9]
    cases = {4: [False, True, True, True], 8: [False, False, False, True]}
    for mb, verdicts in cases.items():
        state = dict(GRID[0], params=7.5e9, gpus=64, precision="mixed", offload="none", seq=2048, mb=mb)
        acts = 32 * 34 * 2048 * mb * 4096
        assert [x + acts <= 80e9 for x in table1] == verdicts
        assert [r["fits"] for r in python_figures(state)] == verdicts
    assert node_run["table1"] == ["120", "31.4", "16.6", "1.88"]


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


def _gb(nbytes: float) -> str:
    """Three digits in GB, as the page prints them (JavaScript's toPrecision(3))."""
    return f"{nbytes / 1e9:#.3g}".rstrip(".")


def _verdicts(tab):
    return tab.eval_on_selector_all("#figures td.fits, #figures td.nofit", "c => c.map(x => x.textContent)")


def _set(tab, selector, value):
    tab.fill(selector, str(value))
    tab.dispatch_event(selector, "change")


def test_browser_activations_equal_python_s_over_a_grid(browser, page):
    tab, requests, errors = _open(browser, page, "")
    got = tab.evaluate("""states => { const d = JSON.parse(document.getElementById("wall-data").textContent);
                                      return states.map(s => FxzeroWall.figures(d, s)); }""", ACT_GRID)
    got = json.loads(json.dumps(got), parse_int=_as_float)
    for state, rows in zip(ACT_GRID, got, strict=True):
        for r, want in zip(rows, python_figures(state), strict=True):
            assert {k: r[k] for k in want} == want, state
    assert errors == [] and len(requests) == 1
    tab.close()


def test_browser_activations_flip_the_verdict(browser, page):
    tab, requests, errors = _open(browser, page, "#params=7.5e9&gpus=64")
    assert not tab.is_visible("#figures td.act") and _verdicts(tab) == ["does not fit", "fits", "fits", "fits"]
    assert tab.evaluate("document.querySelectorAll('#chart .act-bar').length") == 0
    _set(tab, "#seq", 2048)
    _set(tab, "#mb", 4)
    assert tab.is_visible("#figures td.act")
    acts = 32 * 34 * 2048 * 4 * 4096  # Llama-3 8B's shape, fused: 36.5 GB per GPU at every stage
    assert _device_column(tab) == [_gb(x + acts) for x in (120e9, 31.4e9, 16.6e9, 1.875e9)]
    assert _verdicts(tab) == ["does not fit", "fits", "fits", "fits"]
    _set(tab, "#mb", 8)  # 73.0 GB of activations: only ZeRO-3's 1.88 GB of states leave room for them
    assert _verdicts(tab) == ["does not fit", "does not fit", "does not fit", "fits"]
    assert tab.evaluate("document.querySelectorAll('#chart .act-bar').length") == 4
    assert "L \u00d7 34sbh = 32 \u00d7 34 \u00d7 2048 \u00d7 8 \u00d7 4096 bytes = 73.0 GB" in \
        tab.text_content("#activation-formula")
    assert "1.88 GB model states + 73.0 GB activations = 74.9 GB on the GPU" in tab.text_content("#formulas")
    tab.select_option("#recompute", "unit")  # 2sbh: 4.29 GB
    assert _verdicts(tab) == ["does not fit", "fits", "fits", "fits"]
    assert tab.evaluate("location.hash").endswith("&seq=2048&mb=8&layers=32&hidden=4096&heads=32&recompute=unit"
                                                  "&fused=1&dropout=1")
    tab.select_option("#recompute", "none")
    tab.uncheck("#fused")  # the scores come back: 5as^2b more per layer
    assert tab.evaluate("location.hash").endswith("&recompute=none&fused=0&dropout=1")
    assert _device_column(tab)[3] == _gb(1.875e9 + 32 * (34 * 2048 * 8 * 4096 + 5 * 32 * 2048 ** 2 * 8))
    _set(tab, "#seq", "")  # empty: activations off, the page as without them
    assert _device_column(tab) == ["120", "31.4", "16.6", "1.88"] and not tab.is_visible("#figures td.act")
    assert "seq=" not in tab.evaluate("location.hash")
    _set(tab, "#mb", 0)
    assert tab.text_content("#problems") == "mb must be a whole number from 1 to 4096"
    assert errors == [] and len(requests) == 1
    tab.close()


def test_browser_preset_shape_and_fragment_restore(browser, page):
    tab, _, errors = _open(browser, page, "#gpus=512&seq=8192&mb=1")
    tab.select_option("#preset", "llama3-405b")
    assert [tab.input_value(f"#{k}") for k in ("layers", "hidden", "heads")] == ["126", "16384", "128"]
    fragment = tab.evaluate("location.hash")
    assert "&seq=8192&mb=1&layers=126&hidden=16384&heads=128&" in fragment
    # 126 x 34sbh at s 8192: 575 GB per GPU, over every GPU on offer at every stage.
    assert _device_column(tab)[3] == _gb(16 * 405_853_388_800 / 512 + 126 * 34 * 8192 * 16384)
    again, _, _ = _open(browser, page, fragment)  # the shared link shows the same view
    assert [again.input_value(f"#{k}") for k in ("seq", "mb", "layers", "hidden", "heads", "recompute")] == [
        "8192", "1", "126", "16384", "128", "none"]
    assert again.is_checked("#fused") and again.is_checked("#dropout")
    assert _device_column(again) == _device_column(tab)
    warned, _, _ = _open(browser, page, "#layers=80")
    assert warned.text_content("#problems") == (
        "layers has no effect without a sequence length: activations are counted when seq > 0")
    assert errors == []

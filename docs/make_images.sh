#!/usr/bin/env bash
# Regenerate the pictures the README shows, from a fresh compile:
#
#   bash docs/make_images.sh
#
# docs/graph-gpt-tiny.svg  `fxzero graph --collapse` of a 2-block GPT, ZeRO-3 on 2 ranks
# docs/memory-gpt-tiny.png `fxzero schedule --plot` of the same program
# docs/wall.png            `fxzero wall` at #params=7.5e9&gpus=64 (the ZeRO paper's Table 1) with
#                          activations (seq 2048, micro-batch 8), as Debian's chromium shows it
#                          (playwright; scripts/setup.sh installs both)
# docs/site-{home,guide,api}.png  the documentation site's home, the FSDP2 guide and the Config
#                          reference, built by mkdocs and shown in the same chromium
# docs/schedule-explorer.png `fxzero schedule --html` of a 2-rank `fxzero train` of that GPT (2 steps)
#                          above its ZeRO-2 compile, simulated, unit blocks.0 picked, in the same chromium
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FXZERO="${FXZERO:-$ROOT/.venv/bin/fxzero}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$FXZERO" compile 'gpt-tiny(n_blocks=2)' --world 2 -o "$work/tiny" >/dev/null
"$FXZERO" graph "$work/tiny" --collapse -o docs/graph-gpt-tiny.svg
"$FXZERO" schedule "$work/tiny" --plot docs/memory-gpt-tiny.png >/dev/null
"$FXZERO" wall -o "$work/wall.html" >/dev/null
"$ROOT/.venv/bin/python" - "$work/wall.html" <<'EOF'
import pathlib, shutil, sys
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    tab = browser.new_page(viewport={"width": 1100, "height": 800})
    tab.goto(pathlib.Path(sys.argv[1]).as_uri() + "#params=7.5e9&gpus=64&seq=2048&mb=8")
    tab.screenshot(path="docs/wall.png", full_page=True)
    browser.close()
EOF
# The schedule explorer: a recorded ZeRO-3 run (A) above a ZeRO-2 compile (B), both simulated for this
# kind of box (the page's Timeline choice shows A's ranks as measured).
"$FXZERO" train 'gpt-tiny(n_blocks=2)' --ranks 2 --steps 2 -o "$work/train" >/dev/null 2>&1
"$FXZERO" compile 'gpt-tiny(n_blocks=2)' --world 2 --stage 2 -o "$work/zero2" >/dev/null
(cd "$work" && "$FXZERO" schedule --html explorer.html train zero2 >/dev/null)  # labelled A: train, B: zero2
"$ROOT/.venv/bin/python" - "$work/explorer.html" <<'EOF'
import pathlib, shutil, sys
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    tab = browser.new_page(viewport={"width": 1300, "height": 1160})
    tab.goto(pathlib.Path(sys.argv[1]).as_uri() + "#preset=cpu-loopback&timeline=simulated&unit=blocks.0")
    # Hover A's all-gather of blocks.0, so the picture shows a tooltip and the synced cursor.
    where = tab.evaluate("FxzeroExplorer.locate(0, 'forward', FxzeroExplorer.data.runs[0].programs[0]"
                         ".instructions.findIndex(i => i.kind === 'all_gather' && i.unit === 'blocks.0'))")
    tab.mouse.move(where["x"], where["y"])
    tab.screenshot(path="docs/schedule-explorer.png", full_page=False)
    browser.close()
EOF
# The documentation site as a reader sees it: its home, a guide and an API page, built from the
# docs/ above (mkdocs build --strict) and shown in the same chromium.
NO_MKDOCS_2_WARNING=1 "$ROOT/.venv/bin/mkdocs" build --strict --quiet --site-dir "$work/site"
"$ROOT/.venv/bin/python" - "$work/site" <<'EOF'
import pathlib, shutil, sys
from playwright.sync_api import sync_playwright
site = pathlib.Path(sys.argv[1])
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
    tab = browser.new_page(viewport={"width": 1280, "height": 900})
    for page, png in (("index.html", "site-home"), ("guides/fsdp2.html", "site-guide"),
                      ("reference/config.html", "site-api")):
        tab.goto((site / page).as_uri())
        tab.screenshot(path=f"docs/{png}.png")
    browser.close()
EOF
echo "wrote docs/site-home.png docs/site-guide.png docs/site-api.png"
echo "wrote docs/graph-gpt-tiny.svg docs/memory-gpt-tiny.png docs/wall.png docs/schedule-explorer.png"

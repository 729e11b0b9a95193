#!/usr/bin/env bash
# Set up a development environment for fxzero in ./.venv. Safe to run again: each step is
# skipped when its result is already there.
#
#   1. graphviz's `dot` binary (apt-get, when missing and running as root)
#   2. .venv, created with python3 (override with PYTHON=/path/to/python3.11)
#   3. pip install -r requirements.txt, then pip install -e . --no-deps
#
# Step 3 is skipped while requirements.txt, pyproject.toml and the set of fxzero's package
# folders with an __init__.py are unchanged since the last successful run (a stamp in .venv
# records them) and the packages still import. The package set is in the stamp because the
# editable install records, when it runs, which folders are regular and which namespace
# packages; once a folder gains an __init__.py it must be installed again.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.fxzero-setup"

say() { echo "setup: $*"; }

# pip, quietly; drops the warnings pip prints for every missing local index folder on these
# machines (noise that says nothing about this project) but keeps all else it reports.
pip_install() {
    local rc=0 out
    out="$("$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1)" || rc=$?
    printf '%s\n' "$out" | grep -v -e 'is ignored: it is neither a file nor a directory' -e '^$' >&2 || true
    return "$rc"
}

# 1. graphviz: the CLI renders programs with `dot`.
if command -v dot >/dev/null 2>&1; then
    say "graphviz: found $(command -v dot)"
elif [ "$(id -u)" -ne 0 ]; then
    say "graphviz: 'dot' is missing and this is not root; skipping." \
        "Install it yourself (e.g. 'sudo apt-get install graphviz') to render programs."
elif ! command -v apt-get >/dev/null 2>&1; then
    say "graphviz: 'dot' is missing and apt-get is not available; skipping." \
        "Install graphviz with your system's package manager to render programs."
else
    say "graphviz: installing with apt-get"
    apt_log="$(mktemp)"
    if { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q graphviz; } \
        >"$apt_log" 2>&1; then
        say "graphviz: installed $(command -v dot)"
    else
        cat "$apt_log" >&2
        say "WARNING: 'apt-get install graphviz' failed (output above);" \
            "tests that render with dot will fail." >&2
    fi
    rm -f "$apt_log"
fi

# 1b. chromium: tests/cli/test_wall.py opens `fxzero wall`'s page in Debian's chromium, driven by
# playwright (requirements.txt) with executable_path: no browser is downloaded. Without it those
# tests skip and say why; the page's arithmetic is still checked under node.
if command -v chromium >/dev/null 2>&1; then
    say "chromium: found $(command -v chromium)"
elif [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "chromium: missing and not installable here (needs root and apt-get); the browser tests will skip"
else
    say "chromium: installing with apt-get"
    apt_log="$(mktemp)"
    if { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } \
        >"$apt_log" 2>&1; then
        say "chromium: installed $(command -v chromium)"
    else
        cat "$apt_log" >&2
        say "WARNING: 'apt-get install chromium' failed (output above); the browser tests will skip." >&2
    fi
    rm -f "$apt_log"
fi

# 2. The virtual environment.
if [ -x "$VENV/bin/python" ]; then
    say "venv: using $VENV"
else
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "setup: fxzero needs Python >= 3.11; '$PYTHON' is missing or older." \
             "Set PYTHON=/path/to/python3.11 and run again." >&2
        exit 1
    fi
    say "venv: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# 3. Packages. The stamp ties the installed set to the files that define it and to this checkout.
want="$( { cat requirements.txt pyproject.toml; find fxzero -name __init__.py | LC_ALL=C sort; } \
    | sha256sum | cut -d' ' -f1) $ROOT"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && "$VENV/bin/python" -c 'import importlib.metadata as md, torch, numpy, networkx, graphviz, click, pytest, pytest_timeout, mkdocs
md.version("fxzero")' >/dev/null 2>&1; then
    say "packages: up to date"
else
    rm -f "$STAMP"
    say "packages: pip install -r requirements.txt"
    pip_install -r requirements.txt
    say "packages: pip install -e . --no-deps"
    pip_install -e . --no-deps
    echo "$want" > "$STAMP"
    say "packages: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
fi

#!/usr/bin/env bash
# Create the benchmark's own environment, ./.venv-bench, for tools/bench.py. Safe to run again:
# each step is skipped when its result is already there.
#
#   1. .venv-bench, created with python3 (override with PYTHON=/path/to/python3.11)
#   2. requirements.txt (torch==2.13.0, the CPU build) and fxzero itself (pip install -e . --no-deps)
#   3. deepspeed==$DS_VERSION from PyPI. It ships as source only; it is built against the torch
#      already installed (--no-build-isolation, so no second torch is fetched), with every op
#      left to DeepSpeed's JIT (DS_BUILD_OPS=0).
#   4. Warms DeepSpeed's JIT cache (~/.cache/torch_extensions/) for the ops the benchmark uses on
#      CPU (DS_ACCELERATOR=cpu): the shared-memory comm op (deepspeed_shm_comm, which every
#      deepspeed.init_distributed() loads) and cpu_adam (the offload systems' optimizer).
#   5. Only with BENCH_NVME=1: libaio (apt-get, as root) and the async_io op, for the
#      ZeRO-Infinity system (`tools/bench.py --systems ds-zero3-offload-nvme`), off by default.
#
# Measured on a 2-core machine of this project: the deepspeed install 16 s (a source build with
# no ops), shm_comm 33 s, cpu_adam about a minute, async_io 201 s. A second run of this script
# finds everything in place and takes seconds.
#
# If deepspeed cannot be installed, the script says so and exits 0: tools/bench.py still runs
# every other system and prints a JSON line naming the reason for each DeepSpeed one.
#
# Usage: bash scripts/bench-env.sh            then: .venv-bench/bin/python tools/bench.py --help
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv-bench"
PY="$VENV/bin/python"
# The release this script was written against (ANCHORS.md's figures came from it too).
DS_VERSION="${DS_VERSION:-0.19.8}"
STAMP="$VENV/.bench-env"

say() { echo "bench-env: $*"; }
now() { date +%s; }

pip_install() {
    local rc=0 out
    out="$("$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1)" || rc=$?
    printf '%s\n' "$out" | grep -v -e 'is ignored: it is neither a file nor a directory' -e '^$' >&2 || true
    return "$rc"
}

# 1. The virtual environment.
if [ -x "$PY" ]; then
    say "venv: using $VENV"
else
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "bench-env: needs Python >= 3.11; '$PYTHON' is missing or older." \
             "Set PYTHON=/path/to/python3.11 and run again." >&2
        exit 1
    fi
    say "venv: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# 2. torch (exact pin, from requirements.txt) and fxzero.
want="$( { cat requirements.txt pyproject.toml; find fxzero -name __init__.py | LC_ALL=C sort; \
    echo "deepspeed==$DS_VERSION"; } | sha256sum | cut -d' ' -f1) $ROOT"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && "$PY" -c 'import importlib.metadata as md, torch; md.version("fxzero")' >/dev/null 2>&1; then
    say "packages: up to date"
else
    rm -f "$STAMP"
    say "packages: pip install -r requirements.txt"
    pip_install -r requirements.txt
    say "packages: pip install -e . --no-deps"
    pip_install -e . --no-deps
    echo "$want" > "$STAMP"
fi

# 3. DeepSpeed. Its install never pulls another torch: the torch pin is passed along, and the
#    build uses the torch already in the venv.
if "$PY" -c "import importlib.metadata as md, sys; sys.exit(md.version('deepspeed') != '$DS_VERSION')" \
    >/dev/null 2>&1; then
    say "deepspeed: $DS_VERSION installed"
else
    say "deepspeed: pip install deepspeed==$DS_VERSION (builds from source, no ops ahead of time)"
    t0=$(now)
    if DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip_install --no-build-isolation \
        "deepspeed==$DS_VERSION" "torch==2.13.0"; then
        say "deepspeed: installed in $(( $(now) - t0 )) s"
    else
        say "WARNING: deepspeed==$DS_VERSION did not install (output above); tools/bench.py" \
            "will report the DeepSpeed systems as unavailable." >&2
        exit 0
    fi
fi

# 4. Warm the JIT cache. Each load() compiles once and is a cache hit afterwards.
warm_op() {  # warm_op NAME BUILDER_CLASS
    local t0 rc=0
    t0=$(now)
    say "deepspeed: JIT-building $1 (first time: minutes)"
    DS_ACCELERATOR=cpu "$PY" - "$2" <<'EOF' >"$VENV/.jit-$1.log" 2>&1 || rc=$?
import sys
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder(sys.argv[1])
builder.load(verbose=False)
print("built", builder.name)
EOF
    if [ "$rc" -eq 0 ]; then
        say "deepspeed: $1 ready in $(( $(now) - t0 )) s"
    else
        tail -n 20 "$VENV/.jit-$1.log" >&2
        say "WARNING: JIT build of $1 failed (log: $VENV/.jit-$1.log); the DeepSpeed" \
            "systems that need it will fail at run time." >&2
    fi
}
warm_op shm_comm ShareMemCommBuilder
warm_op cpu_adam CPUAdamBuilder

# 5. NVMe offload (ZeRO-Infinity): opt-in, since it needs libaio and a long build.
if [ "${BENCH_NVME:-0}" = "1" ]; then
    if ! ldconfig -p 2>/dev/null | grep -q libaio.so; then
        if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
            say "libaio: installing libaio-dev with apt-get"
            { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev; } \
                >"$VENV/.apt-libaio.log" 2>&1 || say "WARNING: apt-get install libaio-dev failed" >&2
        else
            say "WARNING: libaio is missing; install libaio-dev for the NVMe system" >&2
        fi
    fi
    warm_op async_io AsyncIOBuilder
fi
say "done: $("$PY" -c 'import torch; print("torch", torch.__version__)')," \
    "$("$PY" -c 'import importlib.metadata as md; print("deepspeed", md.version("deepspeed"))' 2>/dev/null || echo 'no deepspeed')"

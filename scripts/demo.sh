#!/usr/bin/env bash
# Set up the environment, then train a small GPT on 2 CPU ranks with ZeRO-3.
# Extra arguments go to tools/demo.py, e.g. `bash scripts/demo.sh --steps 50 --size tiny`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
# One thread per rank (the demo also sets it); set here, it also keeps torchrun from warning.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "demo: torchrun --standalone --nproc_per_node=2 tools/demo.py $*"
exec .venv/bin/torchrun --standalone --nproc_per_node=2 tools/demo.py "$@"

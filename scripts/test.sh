#!/usr/bin/env bash
# Set up the environment, then run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -x -k gather`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh

rc=0
.venv/bin/python -m pytest -q tests "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    # pytest's exit code 5: no tests were collected. A run that tested nothing must not pass.
    echo "test.sh: FAILED: pytest collected no tests (exit code 5)." >&2
    exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# Set up the environment, then run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -x -k gather`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh

rc=0
# Two workers, each taking whole test files (a file's module-scoped runs stay in one worker, done
# once): on 2 cores the suite takes 17:37 instead of 23:28 one test at a time (requirements.txt).
.venv/bin/python -m pytest -q -n 2 --dist loadfile tests "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    # pytest's exit code 5: no tests were collected. A run that tested nothing must not pass.
    echo "test.sh: FAILED: pytest collected no tests (exit code 5)." >&2
    exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# Regenerate the pictures the README shows, from a fresh compile:
#
#   bash docs/make_images.sh
#
# docs/graph-gpt-tiny.svg  `fxzero graph --collapse` of a 2-block GPT, ZeRO-3 on 2 ranks
# docs/memory-gpt-tiny.png `fxzero schedule --plot` of the same program
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FXZERO="${FXZERO:-$ROOT/.venv/bin/fxzero}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$FXZERO" compile 'gpt-tiny(n_blocks=2)' --world 2 -o "$work/tiny" >/dev/null
"$FXZERO" graph "$work/tiny" --collapse -o docs/graph-gpt-tiny.svg
"$FXZERO" schedule "$work/tiny" --plot docs/memory-gpt-tiny.png >/dev/null
echo "wrote docs/graph-gpt-tiny.svg docs/memory-gpt-tiny.png"

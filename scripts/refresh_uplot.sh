#!/usr/bin/env bash
# Vendor uPlot (https://github.com/leeoniya/uPlot, MIT), the one charting library the schedule
# explorer page (`fxzero schedule --html`, fxzero/viz/explorer.py) inlines. Pinned: the page is
# one offline file, so what it runs must be exactly the bytes that were reviewed.
#
#   bash scripts/refresh_uplot.sh            re-fetch the pinned version (vendor/uplot/VERSION) and
#                                            check it against vendor/uplot/SHA256SUMS; writes nothing
#   bash scripts/refresh_uplot.sh 1.6.33     move the pin: fetch that version, replace the files,
#                                            VERSION and SHA256SUMS (review the diff, run the tests)
#
# The package comes from the npm registry through `npm pack`, which checks the tarball against
# the registry's sha512 integrity; the integrity is printed so it can be compared by hand.
# Vendored: dist/uPlot.iife.min.js (the script, no module loader needed), dist/uPlot.min.css
# and LICENSE.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/fxzero/viz/vendor/uplot"
FILES=(uPlot.iife.min.js uPlot.min.css LICENSE)

command -v npm >/dev/null || { echo "refresh_uplot: npm is needed (apt-get install npm)" >&2; exit 1; }
pinned="$(cat "$DEST/VERSION" 2>/dev/null || true)"
version="${1:-$pinned}"
[ -n "$version" ] || { echo "refresh_uplot: no VERSION in $DEST; give one: $0 1.6.32" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent "uplot@$version" >/dev/null
tar xzf "uplot-$version.tgz"
echo "refresh_uplot: uplot@$version, registry integrity $(npm view "uplot@$version" dist.integrity)"
got="$(node -p 'require("./package/package.json").version' 2>/dev/null || grep -o '"version": *"[^"]*"' package/package.json)"
case "$got" in *"$version"*) ;; *) echo "refresh_uplot: the tarball says version $got, not $version" >&2; exit 1;; esac
mkdir -p fresh
cp package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE fresh/
(cd fresh && sha256sum "${FILES[@]}") > fresh/SHA256SUMS

if [ "$version" = "$pinned" ]; then
    # Same pin: the registry's bytes must be the vendored ones, and the vendored ones their sums.
    (cd "$DEST" && sha256sum --quiet -c SHA256SUMS)
    if ! diff -q fresh/SHA256SUMS "$DEST/SHA256SUMS" >/dev/null; then
        echo "refresh_uplot: uplot@$version from the registry differs from the vendored copy:" >&2
        diff fresh/SHA256SUMS "$DEST/SHA256SUMS" >&2 || true
        exit 1
    fi
    echo "refresh_uplot: vendored uplot@$version matches the registry (SHA256SUMS)"
else
    mkdir -p "$DEST"
    cp fresh/* "$DEST/"
    echo "$version" > "$DEST/VERSION"
    echo "refresh_uplot: vendored uplot@$version into ${DEST#$ROOT/} (was ${pinned:-none}); run tests/cli/test_schedule_explorer.py"
fi

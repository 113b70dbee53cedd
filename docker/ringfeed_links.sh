#!/usr/bin/env bash
# ringfeed_links.sh DEST: make DEST/ringfeed the package as `pip install` lays it out - the
# repository's ringfeed/ plus its top-level train/, pipeline/ and shards/ as subpackages
# (pyproject's package-dir) - out of links to this tree, so that PYTHONPATH=DEST imports this
# checkout with nothing installed (gpu-check on a machine where pip cannot reach PyPI). The
# repository root alone is not importable as ringfeed: its ringfeed/ folder lacks those three.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: ringfeed_links.sh DEST" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$1/ringfeed"
rm -rf "$DEST"
mkdir -p "$DEST"
for f in "$ROOT"/ringfeed/*; do
  case "$(basename "$f")" in __pycache__) ;; *) ln -s "$f" "$DEST/" ;; esac
done
for sub in train pipeline shards; do ln -s "$ROOT/$sub" "$DEST/$sub"; done

#!/usr/bin/env bash
# The plugin's own decision time for several commits, in turn, in one sitting (machines differ by 1.5x between
# sittings: only figures from one run compare). Usage: bench-tools/side_by_side.sh ROUNDS REV [REV ...]
# e.g. bench-tools/side_by_side.sh 3 62c1428 HEAD   (62c1428: the code before costs were learned per pod)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=$1; shift
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'for d in "$work"/*/; do git worktree remove --force "$d" >/dev/null 2>&1 || true; done; rm -rf "$work"' EXIT
for rev in "$@"; do git worktree add -q --detach "$work/$rev" "$rev"; done
for round in $(seq "$rounds"); do
  for rev in "$@"; do
    printf 'round %s  %-10s ' "$round" "$rev"
    PYTHONPATH="$work/$rev/src" "$python" bench-tools/decision_own_part.py
  done
done

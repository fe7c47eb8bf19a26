#!/usr/bin/env bash
# README's test command: set up, then run the whole suite. Exit code 5 (no tests collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
PY=${PYTHON:-python3}
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
if [ "$#" -eq 0 ]; then  # the whole suite (CI): lint and types too
  "$PY" -m ruff check . || rc=1
  "$PY" -m mypy ftlaunch || rc=1
fi
exit "$rc"

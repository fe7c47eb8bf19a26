#!/usr/bin/env bash
# README's test command: set up, then run the whole suite. Exit code 5 (no tests collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
PY=${PYTHON:-python3}
# Without arguments: the representative suite (what CI runs). Scenarios marked `slow` (long
# multi-process chaos runs) are left out unless FTLAUNCH_TESTS=all; with arguments, exactly what you name.
select=()
if [ "$#" -eq 0 ] && [ "${FTLAUNCH_TESTS:-}" != "all" ]; then
  select=(-m "not slow")
fi
durations=()
if [ "$#" -eq 0 ]; then durations=(--durations=30); fi  # CI shows where its time goes
"$PY" -m pytest -q -p no:cacheprovider "${select[@]}" "${durations[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing on purpose" >&2
  exit 1
fi
if [ "$#" -eq 0 ]; then  # the whole suite (CI): lint, format and types too
  "$PY" -m ruff check . || rc=1
  "$PY" -m ruff format --check . || rc=1
  "$PY" -m mypy ftlaunch || rc=1
fi
exit "$rc"

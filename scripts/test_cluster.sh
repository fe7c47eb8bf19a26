#!/usr/bin/env bash
# Every test on a real Slurm cluster (tests/processes/test_cluster.py): the one CI runs and the slow ones.
# Needs root (network namespaces); installs Debian's slurm-wlm and munge with apt-get if missing.
# Each test starts its own cluster of 3-5 nodes on this machine and tears it down, pass or fail.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m pytest -q -p no:cacheprovider tests/processes/test_cluster.py tests/processes/test_multinode_restart.py "$@"

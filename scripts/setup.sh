#!/usr/bin/env bash
# Install ftlaunch (editable) with its test dependencies into the current Python.
# Keeps an existing torch (a CUDA build stays); otherwise installs the pinned CPU wheel first so pip
# never resolves `torch>=2.7` to a multi-GB CUDA download.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] torch not found: installing the pinned CPU build torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
else
  echo "[setup] keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi
extras=${FTLAUNCH_EXTRAS:-dev,torchx,fast}
"$PY" -m pip install -q --disable-pip-version-check -e ".[${extras}]"
echo "[setup] ftlaunch installed with extras [${extras}]"

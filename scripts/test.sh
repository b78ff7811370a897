#!/usr/bin/env bash
# Set up a virtual environment with the pinned CPU toolchain and run the test suite.
# Usage: scripts/test.sh [pytest args]     (VENV=path to use another environment folder)
# The ComfyUI contract tests run too when COMFYUI_PATH points at a ComfyUI tree (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q -r requirements-test.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .
exec "$VENV/bin/python" -m pytest "$@"

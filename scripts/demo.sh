#!/usr/bin/env bash
# Set up a virtual environment and run the built-in demo: build a small Flux-layout model,
# quantize it to every format, verify each file with comfy-kitchen, print the table.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q -r requirements-test.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .
exec "$VENV/bin/comfy-modelopt" demo "$@"

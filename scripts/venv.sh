#!/usr/bin/env bash
# Create (once) and update the project's virtual environment with the pinned CPU toolchain.
# Sourced by demo.sh and test.sh; VENV and PYTHON override the folder and the interpreter.
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q -r requirements-test.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .

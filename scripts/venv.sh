#!/usr/bin/env bash
# Create (once) and update the project's virtual environment with the pinned CPU toolchain.
# Sourced by demo.sh and test.sh; VENV and PYTHON override the folder and the interpreter.
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# torch's CPU build lives on PyTorch's own index; machines with a local mirror may not reach it
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
INDEX=()
if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$TORCH_CPU_INDEX/', timeout=5)" 2>/dev/null; then
  INDEX=(--extra-index-url "$TORCH_CPU_INDEX")
fi
"$VENV/bin/python" -m pip install -q "${INDEX[@]}" -r requirements-test.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .

#!/usr/bin/env bash
# Set up the virtual environment (pinned CPU toolchain) and run the test suite.
# Usage: scripts/test.sh [pytest args]
# The ComfyUI tests (tests/comfyui) also run when COMFYUI_PATH points at a ComfyUI tree whose
# requirements are installed in the environment (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec "$VENV/bin/python" -m pytest "$@"

#!/usr/bin/env bash
# Set up the virtual environment and run the built-in demo: build a small Flux-layout model,
# quantize it to every format, verify each file with comfy-kitchen, print the table.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec "$VENV/bin/comfy-modelopt" demo "$@"

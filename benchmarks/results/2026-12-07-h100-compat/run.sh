#!/usr/bin/env bash
# H100 80GB HBM3 (driver 580.159.04), torch 2.11.0+cu130, ComfyUI 0.29, comfy-kitchen 0.2.40 (no fa3-fwd), 2026-12-07.
# The bundle (kitchen's CUDA build, ComfyUI): ../shared/tools/gpu-bundle.sh, unpacked into /tmp/site and /tmp/ComfyUI.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
# a capture that fails inside (a patch syncing while captured) leaves the next captures working
COMFYUI_PATH=/tmp/ComfyUI python benchmarks/results/2026-12-07-h100-compat/diag2.py 2>&1 | grep -E "DIAG|after a failed|Error" > $OUT/diag2.log
# every SDXL case, then the Flux ControlNets and another size (one process each)
python benchmarks/compat.py --model sdxl --runs 2 --log-info --out $OUT > $OUT/compat_sdxl.log 2>&1
python benchmarks/compat.py --model flux --runs 2 --log-info --cases "plain,controlnet,controlnet instantx union,new size" --out $OUT > $OUT/compat_flux.log 2>&1

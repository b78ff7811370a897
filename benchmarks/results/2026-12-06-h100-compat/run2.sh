#!/usr/bin/env bash
# GPU run: after the failed-capture cleanup: the SDXL cases that failed, an eager profile, the Flux graph-path test
set -uo pipefail
mkdir -p /tmp/site && tar -xzf .bundle/site.tgz -C /tmp/site && tar -xzf .bundle/comfyui.tgz -C /tmp
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python benchmarks/compat.py --model sdxl --runs 3 --profile "deep shrink" --cases "plain,deep shrink,controlnet,area prompts,new size,hires fix 1.5x" --out $OUT 2>&1 | tee $OUT/compat_sdxl.log | grep "^\[compat\]" | cut -c1-700
timeout 60 python -m pytest -x -q -s tests/comfyui/test_attach.py -k "graphs and flux" 2>&1 | grep -v DEBUG | tee $OUT/attach_gpu.log | grep -v "^\s*$" | tail -6

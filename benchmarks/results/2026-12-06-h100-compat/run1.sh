#!/usr/bin/env bash
# GPU run: the SDXL compat matrix (speed, latent, how each case ran), then the Flux graph-path test
set -uo pipefail
mkdir -p /tmp/site && tar -xzf .bundle/site.tgz -C /tmp/site && tar -xzf .bundle/comfyui.tgz -C /tmp
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 python benchmarks/compat.py --model sdxl --runs 3 --cases "plain,controlnet,freeu_v2,pag,ip-adapter attn2,ip-adapter attn2 sigma range,tome,deep shrink,area prompts,new size,hires fix 1.5x" --out $OUT 2>&1 | tee $OUT/compat_sdxl.log | grep -v "^\[compat\] {" | tail -22
timeout 100 python -m pytest -x -q -s tests/comfyui/test_attach.py -k "graphs and flux" 2>&1 | tee $OUT/attach_gpu.log | grep -v "^\s*$" | tail -12

#!/usr/bin/env bash
# next GPU session: the rest of issue 63's matrix (Flux every case, SD3.5 Large), one process each
set -uo pipefail
mkdir -p /tmp/site && tar -xzf .bundle/site.tgz -C /tmp/site && tar -xzf .bundle/comfyui.tgz -C /tmp
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 330 python benchmarks/compat.py --model flux --runs 2 --log-info --out $OUT > $OUT/compat_flux.log 2>&1
grep "^|" $OUT/compat_flux.log | cut -c1-300
timeout 240 python benchmarks/compat.py --model sd3 --runs 2 --log-info --cases "plain,controlnet,skip layer guidance,area prompts,new size" --out $OUT > $OUT/compat_sd3.log 2>&1
grep "^|" $OUT/compat_sd3.log | cut -c1-300

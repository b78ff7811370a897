#!/usr/bin/env bash
# GPU run: per-step graphs + aten fp8 GEMM in compiled blocks: the graph-path tests, then the SDXL matrix's eager cases
set -uo pipefail
mkdir -p /tmp/site && tar -xzf .bundle/site.tgz -C /tmp/site && tar -xzf .bundle/comfyui.tgz -C /tmp
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python -m pytest -x -q -s tests/comfyui/test_attach.py -k "graphs" 2>&1 | grep -v DEBUG | tee $OUT/attach_gpu.log | grep -v "^\s*$" | tail -8
timeout 235 python benchmarks/compat.py --model sdxl --runs 3 --log-info --cases "plain,ip-adapter attn2 sigma range,deep shrink,controlnet,new size,hires fix 1.5x" --out $OUT > $OUT/compat_sdxl.log 2>&1
grep "^\[compat\]" $OUT/compat_sdxl.log | grep -v "^\[compat\] {" | tail -14
grep -i "per step\|step's sigma\|running eagerly\|capture failed" $OUT/compat_sdxl.log | sort | uniq -c | cut -c1-400 | head -20

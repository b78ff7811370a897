#!/usr/bin/env bash
# 2026-12-07, one H100 80GB HBM3 (driver 580.159.04), torch 2.11.0+cu130, ComfyUI 0.29, comfy-kitchen 0.2.40 (no fa3-fwd).
# The cases of issue 63's matrix not yet timed on a GPU, fp8 through Quantize Model with its defaults (runtime auto),
# 20 steps, the 16-bit model in the same process; one process per line (the bundle: ../shared/tools/gpu-bundle.sh).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
c() { mkdir -p $OUT/$1; python benchmarks/compat.py --model $2 --runs $3 --settle $4 --log-info --cases "$5" --out $OUT/$1 > $OUT/$1/compat.log 2>&1; }
c sdxl_guiders sdxl 2 0 "plain,cfg guider (SamplerCustomAdvanced),dual cfg guider,perp-neg guider,refiner"
c sd3_rest sd3 2 90 "plain,skip layer guidance,area prompts,new size"
# the guiders again, waiting for the background compile of their batch of 3 (settle), then 3 runs (the second run
# of a new batch size re-captures its graph over the newly compiled blocks: steady = the third)
c sdxl_guiders_settled sdxl 2 70 "plain,dual cfg guider,perp-neg guider"
c sdxl_dual3 sdxl 3 70 "plain,dual cfg guider"
c sd15_inpaint sd15_inpaint 3 0 "plain,inpainting model (concat)"   # (a first try with a 80 s limit stopped while compiling)
# issue 66: Wan 2.1 1.3B at 81 frames in nvfp4 (W4A8 on this GPU), through the nodes
mkdir -p $OUT/wan81_nvfp4 && python benchmarks/user_path.py --model wan81 --format nvfp4 --runs 2 --calib-prompts 1 \
  --skip-stock-file --out $OUT/wan81_nvfp4 > $OUT/wan81_nvfp4/run.log 2>&1

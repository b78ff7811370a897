#!/usr/bin/env bash
# 2026-12-08, one H100 80GB HBM3 (driver 580.159.04), torch 2.11.0+cu130, ComfyUI 0.29, comfy-kitchen 0.2.40 (no fa3-fwd).
# The GIL switch interval while blocks compile in the background (background_compile.SWITCH_INTERVAL), A/B with cold
# caches: no kept compiled code, a fresh Inductor cache per process; SDXL fp8 through Quantize Model with its defaults,
# 20 steps, the 16-bit model in the same process. DualCFG's batch of 3 starts a background compilation after its first
# run; Perp-Neg's two runs ran while it compiled (it was still compiling when the process ended).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1 COMFY_MODELOPT_COMPILE_CACHE=0
for s in 0.005 0.0002; do
  d=$OUT/switch_$s; mkdir -p $d
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/ind.XXXX)
  python benchmarks/compat.py --model sdxl --runs 2 --settle 0 --switch-interval $s --log-info \
    --cases "plain,dual cfg guider,perp-neg guider" --out $d > $d/compat.log 2>&1
done
# the Control-LoRA once its copies of the quantized layers get their real weights (commit 2387671; its network eager)
d=$OUT/control_lora_mended; mkdir -p $d
python benchmarks/compat.py --model sdxl --runs 2 --settle 0 --log-info --cases "plain,control-lora" --out $d > $d/compat.log 2>&1

#!/usr/bin/env bash
# 2026-12-07, ComfyUI 0.29, comfy-kitchen 0.2.40 (no fa3-fwd), torch 2.11.0+cu130, driver 580.159.04.
# Blocks compiled in the background for shapes a run replayed uncompiled (comfy_modelopt/comfyui/background_compile.py).
# The bundle (kitchen's CUDA build, ComfyUI): ../shared/tools/gpu-bundle.sh, unpacked into /tmp/site and /tmp/ComfyUI.
# --settle S: after a case's first run, wait up to S s for a background compilation (reported as waited_s, not timed).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
c() { mkdir -p $OUT/$1; python benchmarks/compat.py --model $2 --runs $3 --settle $4 --log-info --cases "$5" --out $OUT/$1 > $OUT/$1/compat.log 2>&1; }
# sdxl_bg/ - H200 (143 GB): the first version (a signature's shapes = its latent's and text's)
c sdxl_bg sdxl 4 240 "plain,new size,hires fix 1.5x,batch 2"
# flux_bg/ - H200: same version; reference latents were not compiled (their tokens are not the latent's: the shapes
# are now every tensor of 2+ dimensions); Flux's union ControlNet failed its capture (torch.tensor of its mode index)
c flux_bg flux 3 150 "plain,reference latents,mask prompts,controlnet,controlnet instantx union"
# flux_bg2/ - H100 80GB HBM3: with every 2+-dim tensor's shape
c flux_bg2 flux 3 150 "plain,reference latents,controlnet instantx union,batch 2,hires fix 1.5x"
# flux_union/, sdxl_bg2/ - the same H100: ConstantsOnDevice fills torch.tensor(numbers, device=cuda) on the device
c flux_union flux 3 60 "plain,controlnet instantx union"
c sdxl_bg2 sdxl 3 150 "plain,new size,hires fix 1.5x,controlnet"

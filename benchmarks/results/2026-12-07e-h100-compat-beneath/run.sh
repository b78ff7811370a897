#!/usr/bin/env bash
# H100 80GB HBM3 (driver 580.159.04), torch 2.11.0+cu130, ComfyUI 0.29, comfy-kitchen 0.2.40 (no fa3-fwd), 2026-12-07.
# The bundle (kitchen's CUDA build, ComfyUI): ../shared/tools/gpu-bundle.sh, unpacked into /tmp/site and /tmp/ComfyUI.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
# static/: at 0bfea2f (graphs beneath a per-call model wrapper; per-step graphs still from the second image)
python benchmarks/compat.py --model sdxl --runs 2 --log-info --out $OUT/static \
  --cases "plain,first-block cache wrapper,new size,hires fix 1.5x,batch 2,deep shrink,controlnet" > $OUT/static/compat_sdxl_static.log 2>&1
# dynamic/: the experiment - the same code with torch.compile(dynamic=False) turned into dynamic=True by a wrapper
# script (runpy around compat.py; not in the package): rejected, plain 0.784 s against 0.648 s static
python benchmarks/results/2026-12-07e-h100-compat-beneath/dynamic.py benchmarks/compat.py --model sdxl --runs 2 --log-info --out $OUT/dynamic \
  --cases "plain,new size,hires fix 1.5x,batch 2,deep shrink,controlnet" > $OUT/dynamic/compat_sdxl_dynamic.log 2>&1
# issue 66: SDXL nvfp4 through the nodes with fast accumulation
python benchmarks/user_path.py --model sdxl --format nvfp4 --runs 3 --skip-stock-file --log-info --out $OUT > $OUT/sdxl_nvfp4.log 2>&1
# final/: the committed code (per-step graphs from the first step, the replay check's tolerance over compiled blocks)
python -m pytest -q tests/comfyui/test_attach.py -k "graphs_or_say_why or capture_failed" > $OUT/final/test_attach_gpu.log 2>&1
python benchmarks/compat.py --model sdxl --runs 3 --log-info --out $OUT/final \
  --cases "plain,deep shrink,ip-adapter attn2 sigma range,first-block cache wrapper" > $OUT/final/compat_sdxl.log 2>&1
# dynamic2/: the experiment - compiled ahead at the calibration's shapes, then again at a latent 16 px larger each
# side with torch.compile(dynamic=None) (Dynamo's automatic dynamic shapes: a second variant, spatial dims
# symbolic): rejected, plain 0.786 s (the dynamic variant serves the calibration's shapes too), another size 0.813 s
python benchmarks/results/2026-12-07e-h100-compat-beneath/dynamic2.py benchmarks/compat.py --model sdxl --runs 2 --log-info \
  --cases "plain,new size,hires fix 1.5x,controlnet" --out $OUT/dynamic2 > $OUT/dynamic2/compat_sdxl_dynamic2.log 2>&1

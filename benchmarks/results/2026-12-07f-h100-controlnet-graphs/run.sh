#!/usr/bin/env bash
# H100 80GB HBM3 (driver 580.159.04), torch 2.11.0+cu130, ComfyUI 0.29, comfy-kitchen 0.2.40 (no fa3-fwd), 2026-12-07,
# at 08e3e81 (ControlNets' networks replayed as CUDA graphs: comfy_modelopt/comfyui/control_graphs.py).
# The bundle (kitchen's CUDA build, ComfyUI): ../shared/tools/gpu-bundle.sh, unpacked into /tmp/site and /tmp/ComfyUI.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
# first/: the ControlNet cases, another size and batch 2 (the 16-bit runs of this process were slow: plain 1.49 s)
python benchmarks/compat.py --model sdxl --runs 2 --log-info --cases "plain,controlnet,controlnet x2 start/end,new size,batch 2" \
  --out $OUT/first > $OUT/first/compat_sdxl.log 2>&1
# is an SDXL cldm ControlNet's eager forward host-bound? (1024x1024, batch 2, fp16; random weights)
python benchmarks/results/2026-12-07f-h100-controlnet-graphs/cn_probe.py
#   eager from an idle GPU: host 36.31 ms, wall 36.40 ms; eager back to back 28.07 ms per call;
#   CUDA graph replay 20.69 ms per call (bit-equal); 1118 kernels per forward
# cn3/: the ControlNet cases again, 3 runs each
python benchmarks/compat.py --model sdxl --runs 3 --log-info --cases "plain,controlnet,controlnet x2 start/end" \
  --out $OUT/cn3 > $OUT/cn3/compat_sdxl_cn.log 2>&1
# old/: the A/B of lean._fp8_forward inside a capture - torch's three rounding operations for small inputs (the code
# before 2026-12-07e) instead of kitchen's one-pass kernel: the same times (plain 0.650 vs 0.647 s, another size
# 0.863 vs 0.868 s, batch 2 1.470 vs 1.467 s)
python benchmarks/results/2026-12-07f-h100-controlnet-graphs/oldround.py benchmarks/compat.py --model sdxl --runs 2 \
  --log-info --cases "plain,new size,batch 2" --out $OUT/old > $OUT/old/compat_sdxl_old.log 2>&1

# W4A8's expanded way on an H100 (80GB HBM3, torch 2.11+cu130, Triton 3.6, kitchen 0.2.40, ComfyUI 0.29), 2026-12-07.
# GPU tests first: tests/test_w4a8.py 6 passed; tests/comfyui/test_contract.py -k w4a8 1 passed (CUDA).
python benchmarks/speed.py --w4a8 --out DIR                     # -> w4a8_gemms.json / .log (before fast accumulation)
# through the nodes (Calibrate -> Quantize Model -> KSampler, 20 steps 1024^2, next to the 16-bit model):
python benchmarks/user_path.py --model flux --format nvfp4 --no-gptq --runs 2 --skip-stock-file --out DIR   # verify_flux_nvfp4_gptq0.json
python benchmarks/user_path.py --model flux --format nvfp4 --runs 2 --skip-stock-file --out DIR             # verify_flux_nvfp4.json (GPTQ on: the default)
python benchmarks/user_path.py --model sdxl --format nvfp4 --runs 2 --skip-stock-file --out DIR             # verify_sdxl_nvfp4.json
# a 12 GiB card: quantized on the whole GPU, then a fresh process limited to 12 GiB loads the file next to stock bf16 (10 steps)
python benchmarks/user_path.py --model flux --format nvfp4 --vram-gib 12 --fresh-load --steps 10 --runs 2 --no-gptq --skip-stock-file --out DIR   # vram12/
python benchmarks/user_path.py --model flux --format float8_e4m3fn --vram-gib 12 --fresh-load --steps 10 --runs 2 --no-gptq --skip-stock-file --out DIR
# then fast accumulation for the expanded GEMM (the code's default since): the knobs per shape, and Flux again
python fast-accum/expanded_knobs.py          # -> fast-accum/diag3.log
python benchmarks/user_path.py --model flux --format nvfp4 --no-gptq --runs 2 --skip-stock-file --out DIR   # fast-accum/verify_flux_nvfp4_gptq0.json

# H100 80GB HBM3 (driver 580.159.04, torch 2.11+cu130, Triton 3.6, kitchen 0.2.40, ComfyUI 0.29), 2026-12-07.
# Through the nodes (Calibrate -> Quantize Model -> KSampler, 20 steps 1024x1024, 2 runs each, the 16-bit
# model in the same process), one process per line; the *.log files are each run's tail.
# The plain path after the background compilation and this session's changes (fp8, every input at its default):
python benchmarks/user_path.py --model flux --format float8_e4m3fn --runs 2 --skip-stock-file --out DIR   # verify_flux_float8_e4m3fn.json
python benchmarks/user_path.py --model sdxl --format float8_e4m3fn --runs 2 --skip-stock-file --out DIR   # verify_sdxl_float8_e4m3fn.json
# nvfp4 without the fp8 allowance (the code then; the default is now fp8_allowance 0.02) and with it, written as the
# planner's budget it derives (the nvfp4 plan's share of the 16-bit Linear bytes + 0.02: Flux 0.285 + 0.02, SDXL
# 0.350 + 0.02) with candidates nvfp4 and fp8 - the recipe the default now runs:
python benchmarks/user_path.py --model flux --format nvfp4 --runs 2 --skip-stock-file --out DIR           # verify_flux_nvfp4.json
python benchmarks/user_path.py --model flux --format nvfp4 --budget 0.305 --candidates nvfp4,float8_e4m3fn --runs 2 --skip-stock-file --out DIR
python benchmarks/user_path.py --model sdxl --format nvfp4 --runs 2 --skip-stock-file --out DIR           # verify_sdxl_nvfp4.json
python benchmarks/user_path.py --model sdxl --format nvfp4 --budget 0.37 --candidates nvfp4,float8_e4m3fn --runs 2 --skip-stock-file --out DIR
# (SDXL at --budget 0.305 was refused: the planner's budget is over the Linear bytes, where nvfp4 alone takes 0.350 -
# the report's hint then computed it from the whole file's ratio; fp8_allowance derives it from the plan instead.)

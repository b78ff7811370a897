# 2026-12-07, this project's 2-core CPU (torch 2.13.0+cpu, comfy-kitchen 0.2.40), shared with a real-ComfyUI test run
# (times are loose). nvfp4's default with and without its fp8 allowance (fp8_allowance 0.02 / 0).
python benchmarks/quality_real.py --format nvfp4 --variants "default,default without fp8_allowance" --no-floors --out $OUT/minilm
pip install --no-deps adaptive-terrain-diffusion==0.4.2 onnx==1.23.2 onnx2torch==1.5.15 protobuf==7.36.2 ml_dtypes==0.7.0
python benchmarks/quality_real.py --model terrain --format nvfp4 --variants "default,default without fp8_allowance" --no-floors --out $OUT/terrain
# the same MiniLM command again on the quiet CPU (nothing else running) -> minilm-quiet/: the quantize times
# and the terrain command on the quiet CPU -> terrain-quiet/

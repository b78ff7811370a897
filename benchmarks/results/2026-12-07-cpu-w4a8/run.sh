# nvfp4 as the W4A8 kernel computes it (w4a8.reference) next to the dequantized and the native
# semantics, on MiniLM and the trained conv UNet; 2-core CPU, 2026-12-07
python benchmarks/quality_real.py --model minilm --format nvfp4 --no-floors --out DIR
python benchmarks/quality_real.py --model terrain --format nvfp4 --no-floors --out DIR
python benchmarks/quality_real.py --model mpnet --format nvfp4 --no-floors --variants default --out DIR

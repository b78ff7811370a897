# W4A8 per Flux shape on an H100 (80GB HBM3, torch 2.11+cu130, Triton 3.6), 2026-12-07; the GPU
# tests ran first: tests/test_w4a8.py 6 passed (kernel and row rounding bit for bit the reference's)
python -m pytest -q tests/test_w4a8.py
python benchmarks/speed.py --w4a8 --out DIR     # -> speed.json (here w4a8_gemms.json), w4a8_gemms.log

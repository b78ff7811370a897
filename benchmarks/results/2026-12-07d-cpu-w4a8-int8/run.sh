# the int8 way of W4A8 (Turing/Ampere) on real trained weights, its arithmetic on this 2-core CPU, 2026-12-07
python benchmarks/quality_real.py --model minilm --format nvfp4 --no-floors --variants "W4A8 int8" --out DIR
python benchmarks/quality_real.py --model terrain --format nvfp4 --no-floors --variants "W4A8 int8" --out DIR
python benchmarks/quality_real.py --model mpnet --format nvfp4 --no-floors --variants "W4A8 int8 (Turing/Ampere, the pack's runtime): default" --out DIR
# ablations/: the choices measured before the per-channel scale and the 64-row floor were kept (results.txt)

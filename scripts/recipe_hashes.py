#!/usr/bin/env python3
"""Byte-identity across a refactor: quantize a small Flux-layout checkpoint (the tests' tiny one,
calibrated through real forward hooks) with a set of recipes - every format with and without
statistics and GPTQ, and the searches, smoothing, low-rank, planner, keep/weight-only and
sensitivity options - and write each output file's sha256, and one over its tensors alone (a change
to the report keeps that one).

    python scripts/recipe_hashes.py before.json              # on the old code
    python scripts/recipe_hashes.py after.json --against before.json   # exit 1 on any difference

Outputs carry no wall-clock time (docs/architecture.md), so the same code, torch and kitchen give
the same hashes; a change meant to keep behaviour (a redesign) must keep every one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from comfy_modelopt import Recipe  # noqa: E402
from comfy_modelopt.calibrate import calibrate  # noqa: E402
from comfy_modelopt.formats import FORMATS  # noqa: E402
from comfy_modelopt.pipeline import quantize  # noqa: E402
from comfy_modelopt.synthetic import flux_layout, write_checkpoint  # noqa: E402
from conftest import TINY_FLUX  # noqa: E402
from helpers import LinearTree  # noqa: E402


def recipes() -> list:
    """(name, recipe, calibrated?) for every case."""
    cases = []
    for f in FORMATS:
        cases += [(f, Recipe(f), False), (f"{f} +stats", Recipe(f), True),
                  (f"{f} +stats -gptq", Recipe(f, gptq=False), True)]
    fp8 = "float8_e4m3fn"
    return cases + [
        ("fp8 input mse", Recipe(fp8, input_scale="mse"), True),
        ("fp8 weight absmax", Recipe(fp8, weight_scale="absmax"), True),
        ("fp8 smoothquant", Recipe(fp8, smoothing="smoothquant"), True),
        ("int8 awq", Recipe("int8_tensorwise", smoothing="awq", convrot=False), True),
        ("nvfp4 lowrank 16", Recipe("nvfp4", lowrank=16), True),
        ("planner 0.6", Recipe(fp8, budget=0.6, candidates=(fp8, "nvfp4")), True),
        ("keep / weight-only", Recipe(fp8, keep=("double_blocks.*",), weight_only=("single_blocks.*",)), True),
        ("fp8 sensitivity", Recipe(fp8, sensitivity=True), True),
    ]


def hashes() -> dict:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="recipe-hashes-") as d, torch.inference_mode():
        src, out = os.path.join(d, "src.safetensors"), os.path.join(d, "out.safetensors")
        layout = flux_layout(**TINY_FLUX)
        write_checkpoint(src, layout, seed=1)
        stats = calibrate(LinearTree(layout, scale_amax=10.0), lambda m: [m(i) for i in range(3)])
        found, tensors = {}, {}
        for name, recipe, calibrated in recipes():
            try:
                quantize(src, recipe, stats if calibrated else None, out=out, overwrite=True)
                with open(out, "rb") as f:
                    found[name] = hashlib.sha256(f.read()).hexdigest()
                digest = hashlib.sha256()  # the tensors alone: what a report-only change keeps
                for k, t in sorted(load_file(out).items()):
                    digest.update(f"{k} {t.dtype} {tuple(t.shape)}".encode())
                    digest.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                tensors[name] = digest.hexdigest()
            except Exception as e:  # an error is an outcome too: it must stay the same
                found[name] = tensors[name] = f"error: {type(e).__name__}: {e}"
            print(f"{name:28s} {found[name][:16]}", flush=True)
        return found, tensors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file to write the hashes to")
    ap.add_argument("--against", help="an earlier run's JSON: exit 1 where any case differs")
    a = ap.parse_args(argv)
    files, tensors = hashes()
    found = {"torch": torch.__version__, "hashes": files, "tensors": tensors}
    with open(a.out, "w") as f:
        json.dump(found, f, indent=1)
    if not a.against:
        return 0
    with open(a.against) as f:
        base = json.load(f)
    if base.get("torch") != found["torch"]:
        print(f"note: {a.against} was made with torch {base.get('torch')}, this run {found['torch']}")
    old, new = base["hashes"], found["hashes"]
    differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    same_tensors = base.get("tensors", {})
    for k in differ:
        only = same_tensors.get(k) is not None and same_tensors.get(k) == found["tensors"].get(k)
        print(f"DIFFERS: {k}: {str(old.get(k))[:16]} -> {str(new.get(k))[:16]}"
              + (" (tensors identical: metadata only)" if only else ""))
    print(f"{len(new) - len(differ)} of {len(new)} cases byte-identical" + (" - all" if not differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

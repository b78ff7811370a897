"""What nvfp4's per-block clip costs per layer on the quantizing device.

    python benchmarks/block_clip_cost.py --out DIR [--device cpu|cuda]
    python benchmarks/block_clip_cost.py --reduced --out DIR      # small shapes, smoke run

For Flux.1-dev's Linear shapes (out x in), a random weight with outlier columns and the input
rows a 2 MiB bf16 calibration reservoir holds (68 rows of 15360), times the whole weight-clip
choice the weight-clip and block-clip steps (``steps/weight_clip.py``, ``steps/block_clip.py``)
make for nvfp4 with ``weight_scale=mse`` - the per-tensor search, the per-block search
(``scales.search_block_clip``) and the choice between them on the rows' outputs - and, as the
reference, one plain fake-quantization of the weight.

Prints a markdown table and writes ``block_clip_cost.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tables  # noqa: E402

from comfy_modelopt.families import GENERIC  # noqa: E402
from comfy_modelopt.formats import FORMATS  # noqa: E402
from comfy_modelopt.plan import LayerPlan, Plan  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402
from comfy_modelopt.steps import Work  # noqa: E402
from comfy_modelopt.steps.block_clip import STEP as BLOCK_CLIP  # noqa: E402
from comfy_modelopt.steps.weight_clip import STEP as WEIGHT_CLIP  # noqa: E402

SHAPES = [(3072, 3072), (3072, 12288), (12288, 3072), (3072, 15360), (21504, 3072)]
REDUCED = [(64, 256), (128, 512)]


def weight_clip(w, fmt, recipe, x) -> Work:
    """The weight's clip as a layer's steps choose it (no held-out prompts)."""
    layer = LayerPlan("layer", "layer", w.shape[0], w.shape[1], "BF16", fmt=fmt)
    work = Work(layer, Plan(recipe, GENERIC, "", [layer], {}), None, w, x)
    for step in (WEIGHT_CLIP, BLOCK_CLIP):
        if step.applies(work):
            step.run(work)
    return work


def timed(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def one_shape(n: int, k: int, rows: int, device) -> dict:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:, :: max(1, k // 64)] *= 8.0  # outlier input columns, as trained weights have
    x = torch.randn(rows, k, generator=g)
    x[:, :: max(1, k // 16)] *= 20.0
    w, x = w.to(device), x.to(device)
    fmt, recipe = FORMATS["nvfp4"], Recipe("nvfp4", weight_scale="mse")
    _, plain = timed(device, lambda: fmt.fake_rows(w))
    work, t = timed(device, lambda: weight_clip(w, fmt, recipe, x))
    return {"shape": f"{n}x{k}", "rows": rows, "weight_clip_s": round(t, 3), "one_fake_quant_s": round(plain, 3),
            "block_clip_chosen": work.clip.block_bound is not None, "notes": work.notes}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reduced", action="store_true", help="small shapes (smoke run, not a measurement)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    out = []
    for n, k in (REDUCED if a.reduced else SHAPES):
        r = one_shape(n, k, max(16, (2 << 20) // (2 * k)), device)
        out.append(r)
        print(json.dumps(r), flush=True)
    env = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    tables.print_markdown([("shape (out x in)", "shape"), ("rows", "rows"), ("weight clip choice s", "weight_clip_s"),
                           ("one fake quant s", "one_fake_quant_s"), ("block clip chosen", "block_clip_chosen")], out)
    tables.write_json(os.path.join(a.out, "block_clip_cost.json"), {"env": env, "rows": out})
    return out


if __name__ == "__main__":
    main()

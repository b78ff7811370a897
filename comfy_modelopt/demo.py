"""``comfy-modelopt demo``: the whole file path on a small built-in model, verified.
Design: docs/design.md, ``demo.py``.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from .fileformat import COMFY_QUANT, META_REPORT, SUFFIX_KEYS, read_comfy_quant
from .formats import FORMATS, get_format
from .pipeline import quantize
from .recipe import Recipe, convrot_formats
from .safetensors_io import SafetensorsFile
from .synthetic import flux_layout, tensor_for, write_checkpoint

DEMO_LAYOUT = dict(hidden=256, depth=2, depth_single=2, context_in=512, vec_in=256)
# every format, and for those with ConvRot (on by default) the unrotated variant too
DEMO_RECIPES = tuple(r for name in FORMATS for r in (
    (Recipe(name, convrot=False), Recipe(name)) if name in convrot_formats() else (Recipe(name),)))


def verify_file(path: str, source: dict[str, torch.Tensor]) -> tuple[int, float, float]:
    """Rebuild every quantized layer from disk with kitchen; return (layers, mean, max) relative
    error against ``source`` weights; raises if a layer disagrees with the stored report."""
    errs = []
    with SafetensorsFile(path) as f:
        report = json.loads(f.metadata[META_REPORT])["layers"]
        for key in f.keys():
            if not key.endswith(COMFY_QUANT):
                continue
            layer = key[: -len(COMFY_QUANT)]
            conf = read_comfy_quant(f, key)
            fmt = get_format(conf["format"])
            stored = {s: f.read(layer + k) for s, k in SUFFIX_KEYS.items() if layer + k in f}
            w = source[layer + ".weight"].float()
            deq = fmt.from_stored(stored, conf, tuple(w.shape)).dequantize().float()
            err = float((deq - w).norm() / w.norm())
            claimed = report[layer]["rel_err"]
            if abs(err - claimed) > 1e-4 * max(1.0, claimed):
                raise AssertionError(f"{path}: {layer}: stored tensors give error {err:.6f}, "
                                     f"the report says {claimed:.6f}")
            errs.append(err)
    if not errs:
        raise AssertionError(f"{path}: no quantized layers")
    return len(errs), sum(errs) / len(errs), max(errs)


def run_demo(out_dir: str | None = None, keep_files: bool = False) -> list[dict]:
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="comfy-modelopt-demo-")
        out_dir = tmp.name
    os.makedirs(out_dir, exist_ok=True)
    layout = flux_layout(**DEMO_LAYOUT)
    src = os.path.join(out_dir, "demo-flux-bf16.safetensors")
    write_checkpoint(src, layout, seed=0, overwrite=True)
    source = {k: tensor_for(k, v, 0) for k, v in layout.items()}
    src_bytes = os.path.getsize(src)
    print(f"built {src} ({len(layout)} tensors, {src_bytes / 2**20:.1f} MiB, Flux.1 key layout, "
          f"hidden {DEMO_LAYOUT['hidden']})")
    rows = []
    for i, recipe in enumerate(DEMO_RECIPES):
        name = recipe.format + ("+convrot" if recipe.convrot and recipe.format in convrot_formats() else "")
        out = os.path.join(out_dir, f"demo-flux-{name}.safetensors")
        print(f"[{i + 1}/{len(DEMO_RECIPES)}] {name}: quantizing and verifying ...", flush=True)
        t0 = time.perf_counter()
        report = quantize(src, recipe, out=out, overwrite=True).report
        seconds = time.perf_counter() - t0
        n, mean, worst = verify_file(out, source)
        size = os.path.getsize(out)
        rows.append({"format": name, "bytes": size, "ratio_vs_bf16": size / src_bytes,
                     "layers": n, "kept_16bit": len(report.kept), "mean_rel_err": mean,
                     "max_rel_err": worst, "seconds": seconds, "verified": True,
                     "weight_only": any(l.weight_only for l in report.quantized)})
    print(f"\n{'format':22s} {'MiB':>7s} {'vs bf16':>8s} {'layers':>7s} {'mean err':>9s} "
          f"{'max err':>9s} {'time s':>7s}  verified")
    for r in rows:
        print(f"{r['format']:22s} {r['bytes'] / 2**20:7.2f} {r['ratio_vs_bf16']:8.3f} {r['layers']:7d} "
              f"{r['mean_rel_err']:9.4f} {r['max_rel_err']:9.4f} {r['seconds']:7.2f}  "
              f"yes (kitchen dequant of stored tensors){' [weight-only]' if r['weight_only'] else ''}")
    print("\nrelative error = ||W - dequant(Q(W))|| / ||W|| per layer; the 16-bit layers "
          "(embedders, final layer) are excluded. fp8 without calibration is weight-only; "
          "run 'comfy-modelopt quantize --stats' or the ComfyUI nodes for W8A8.")
    if keep_files:
        print(f"files kept in {out_dir}")
    elif tmp is not None:
        tmp.cleanup()
    return rows

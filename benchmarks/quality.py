"""Quality proxies on identical inputs: relative error of the model output against the 16-bit
model at several noise levels, per format, naive vs comfy-modelopt's calibrated recipe.

    python benchmarks/quality.py --out DIR             # H200: Flux-dev width (3072) with 4+8 blocks, SDXL full
    python benchmarks/quality.py --out DIR --reduced   # small models on the CPU (not a measurement)

Random weights alone never produce the activation outliers real diffusion transformers show
(activations stay below ~20), so each model is measured twice: as built, and with injected
outlier structure:
- Flux: in every block's adaLN modulation, the "scale" outputs of 4 fixed channels get 19, 39,
  59 and 99 added to their bias (the scale chunks 1 and 4 of img_mod/txt_mod, chunk 1 of the
  single blocks' modulation), so (1 + scale) multiplies those channels of the normalized input of
  qkv/mlp/linear1 by about 20, 40, 60 and 100 - the modulation-driven channel outliers reported
  for Flux (they push activations past fp8's 448);
- SDXL: in every transformer block, norm1/norm2/norm3 LayerNorm gains of 4 fixed channels are
  multiplied by 20, 40, 60 and 100.
Calibration: the same kind of inputs (random latents and random text conditioning) evaluated at
10 noise levels; evaluation inputs are fresh draws.  Naive = absmax weight scales, and fp8 as
naive converters write it (no input_scale: ComfyUI quantizes activations with scale 1.0).
Ours = MSE (activation-aware) clipping, calibrated static input scales, SmoothQuant folded
where exact (SDXL), AWQ for nvfp4 (folded where exact).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import DEVICE, torch  # noqa: E402

from comfy_modelopt.calibrate import CalibrationOptions, calibrate  # noqa: E402
import architectures  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402

SIGMAS_EVAL = [1.0, 0.8, 0.5, 0.2, 0.05]
SIGMAS_CALIB = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
FLUX_REDUCED_DEPTH = dict(architectures.FLUX_FULL, depth=4, depth_single_blocks=8)
OUTLIER_CHANNELS = (7, 300, 1500, 2900)  # < 320 hits small test models too


DIAGNOSTIC = ("static-mse", "static-max", "sq-max")  # only when named in --variants


def variants():
    return [
        ("float8_e4m3fn", "naive", Recipe("float8_e4m3fn", weight_scale="absmax", sensitivity=False), "naive_w8a8"),
        ("float8_e4m3fn", "ours", Recipe("float8_e4m3fn", smoothing="smoothquant", sensitivity=False), None),
        # to take "ours" apart (the SDXL fp8 regression): static input scales alone (MSE clip /
        # calibrated max), and SmoothQuant with max-calibrated scales; run with --variants
        ("float8_e4m3fn", "static-mse", Recipe("float8_e4m3fn", sensitivity=False), None),
        ("float8_e4m3fn", "static-max", Recipe("float8_e4m3fn", input_scale="max", sensitivity=False), None),
        ("float8_e4m3fn", "sq-max", Recipe("float8_e4m3fn", smoothing="smoothquant", input_scale="max",
                                           sensitivity=False), None),
        ("int8_tensorwise", "naive", Recipe("int8_tensorwise", weight_scale="absmax", sensitivity=False), None),
        ("int8_tensorwise", "ours", Recipe("int8_tensorwise", smoothing="smoothquant", sensitivity=False), None),
        ("nvfp4", "naive", Recipe("nvfp4", weight_scale="absmax", sensitivity=False), None),
        ("nvfp4", "ours", Recipe("nvfp4", smoothing="awq", sensitivity=False), None),
        # own loader: AWQ kept as a per-layer input scale wherever it does not fold, plus a
        # rank-32 16-bit branch (SVDQuant-style); stock ComfyUI cannot load this file
        ("nvfp4", "ours+lowrank32", Recipe("nvfp4", smoothing="awq", lowrank=32, sensitivity=False), None),
    ]


def inject_outliers(family: str, sd: dict) -> None:
    if family == "flux":
        for k, v in sd.items():
            if not k.endswith(".bias"):
                continue
            if k.endswith(("_mod.lin.bias", "modulation.lin.bias")):
                h = v.shape[0] // (6 if "_mod." in k else 3)
                chunks = (1, 4) if "_mod." in k else (1,)
                for ch in chunks:
                    for c, add in zip(OUTLIER_CHANNELS, (19.0, 39.0, 59.0, 99.0)):
                        if c < h:
                            v[ch * h + c] += add
    else:
        for k, v in sd.items():
            if ".transformer_blocks." in k and k.endswith(("norm1.weight", "norm2.weight", "norm3.weight")):
                for c, f in zip(OUTLIER_CHANNELS, (20.0, 40.0, 60.0, 100.0)):
                    if c < v.shape[0]:
                        v[c] *= f


def emulate_w8a8(patcher) -> int:
    """On a CPU, where ComfyUI computes fp8 layers dequantized (activations never quantized),
    round each fp8 W8A8 layer's input to fp8 as the GPU path does: with the layer's static
    input_scale, else per call with amax / fp8 max (what ComfyUI does without one).  Weight-only
    layers stay as they are.  Returns how many layers it wrapped."""
    n = 0
    for m in patcher.model.diffusion_model.modules():
        fmt = getattr(m, "quant_format", None)
        if fmt not in ("float8_e4m3fn", "float8_e5m2") or getattr(m, "_full_precision_mm_config", False):
            continue
        dt = torch.float8_e4m3fn if fmt == "float8_e4m3fn" else torch.float8_e5m2
        fmax = float(torch.finfo(dt).max)

        def forward(x, *args, _stock=m.forward, _m=m, _dt=dt, _fmax=fmax, **kwargs):
            s = getattr(_m, "input_scale", None)
            s = s.float().to(x.device) if s is not None else (x.abs().amax().float() / _fmax).clamp_min(1e-12)
            xq = ((x.float() / s).clamp(-_fmax, _fmax).to(_dt).float() * s).to(x.dtype)
            return _stock(xq, *args, **kwargs)
        m.forward = forward
        n += 1
    return n


EMULATE = False
CONDITIONS = (False, True)  # without / with injected outliers
OVERRIDE: dict = {}  # res / batch / dtype for the full-size models (CPU diagnostics)


def build(name: str, reduced: bool):
    sd, family, batch, res, txt, dtype = _build(name, reduced)
    if OVERRIDE.get("dtype") is not None:
        dtype = OVERRIDE["dtype"]
        sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    return sd, family, OVERRIDE.get("batch") or batch, OVERRIDE.get("res") or res, txt, dtype


def _build(name: str, reduced: bool):
    if name == "flux":
        if reduced:
            _, sd = architectures.build("flux", "small", dtype=torch.bfloat16, weights_device=DEVICE)
            return sd, "flux_small", 1, 64, 16, torch.bfloat16
        architectures.CONFIGS["flux_quality"] = {"full": FLUX_REDUCED_DEPTH}
        _, sd = architectures.build("flux_quality", "full", dtype=torch.bfloat16, weights_device=DEVICE)
        return sd, "flux", 1, 1024, 512, torch.bfloat16
    if reduced:
        _, sd = architectures.build("sd15", "small", dtype=torch.float16, weights_device=DEVICE)
        return sd, "sd15", 2, 64, 77, torch.float16
    _, sd = architectures.build("sdxl", "full", dtype=torch.float16, weights_device=DEVICE)
    return sd, "sdxl", 2, 1024, 77, torch.float16


def draws(family, batch, res, txt, dtype, seed):
    torch.manual_seed(seed)
    x, _, kw = common.inputs(family, batch, res, txt, dtype)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(x.shape, generator=g, device=DEVICE, dtype=dtype)
    kw = {k: (torch.randn(v.shape, generator=g, device=DEVICE, dtype=v.dtype) if k != "guidance" else v)
          for k, v in kw.items()}
    return x, kw


def run(name: str, reduced: bool, results: dict, out_path: str, only=None):
    for outliers in CONDITIONS:
        sd, family, batch, res, txt, dtype = build(name, reduced)
        if outliers:
            inject_outliers("flux" if name == "flux" else "unet", sd)
        key = f"{name}{' + outliers' if outliers else ''}"
        print(f"\n== {key}", flush=True)
        base = common.load_stock(sd)
        evals = [draws(family, batch, res, txt, dtype, 100 + i) for i in range(2)]
        with torch.inference_mode():
            refs = [[base.model.apply_model(x, torch.full((batch,), s, device=DEVICE), **kw).float()
                     for s in SIGMAS_EVAL] for x, kw in evals]
            calib = [draws(family, batch, res, txt, dtype, i) for i in range(2)]

            def loop(_m):
                for x, kw in calib:
                    for s in SIGMAS_CALIB:
                        base.model.apply_model(x, torch.full((batch,), s, device=DEVICE), **kw)
            t0 = time.perf_counter()
            stats = calibrate(base.model.diffusion_model, loop, CalibrationOptions(reservoir_bytes=1 << 20))
            amax = max(s.amax_value() for s in stats.layers.values())
            print(f"  calibrated in {time.perf_counter() - t0:.0f}s; largest activation {amax:.1f}", flush=True)
        common.free(base)
        base = loop = None  # the closure held the 16-bit model: let it go before quantizing
        gc.collect()
        rows = results.setdefault(key, {"largest_activation": amax, "rows": []})["rows"]
        for fmt, kind, recipe, post in variants():
            if (only and f"{fmt}:{kind}" not in only) or (not only and kind in DIAGNOSTIC):
                continue
            t0 = time.perf_counter()
            with torch.inference_mode():
                q_sd, meta, report = common.quantize_sd(sd, recipe, stats if kind != "naive" else None)
            if post == "naive_w8a8":
                q_sd, meta = common.naive_w8a8(q_sd, meta)
            qs = time.perf_counter() - t0
            q = common.load_stock(q_sd, meta)
            del q_sd
            if EMULATE:
                emulate_w8a8(q)
            errs = []
            with torch.inference_mode():
                for (x, kw), ref_row in zip(evals, refs):
                    for s, ref in zip(SIGMAS_EVAL, ref_row):
                        out = q.model.apply_model(x, torch.full((batch,), s, device=DEVICE), **kw).float()
                        errs.append(float((out - ref).norm() / ref.norm()))
            per_sigma = [round(sum(errs[i::len(SIGMAS_EVAL)]) / len(evals), 5) for i in range(len(SIGMAS_EVAL))]
            folded = sum(1 for l in report.quantized if "folded" in l.notes or "smooth_scale" in l.notes)
            row = {"format": fmt, "recipe": kind, "mean_rel_err": round(sum(errs) / len(errs), 5),
                   "rel_err_by_sigma": dict(zip(map(str, SIGMAS_EVAL), per_sigma)),
                   "weight_rel_err": round(report.mean_rel_err(), 5), "quantize_s": round(qs, 1),
                   "smoothed_layers": folded}
            rows.append(row)
            print(f"  {fmt:16s} {kind:6s} output err {row['mean_rel_err']:.5f}  by sigma {per_sigma}  "
                  f"(weights {row['weight_rel_err']:.4f}, {folded} layers smoothed, {qs:.0f}s)", flush=True)
            common.free(q)
            common.write_json(out_path, results)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--models", nargs="*", default=["flux", "sdxl"])
    ap.add_argument("--variants", nargs="*", default=None,
                    help="only these FORMAT:RECIPE pairs, e.g. nvfp4:naive nvfp4:ours+lowrank32")
    ap.add_argument("--emulate-w8a8", action="store_true",
                    help="CPU: round fp8 layer inputs to fp8 as the GPU does (ComfyUI's CPU path does not)")
    ap.add_argument("--res", type=int, default=None, help="override the resolution (CPU diagnostics)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--fp32", action="store_true", help="compute in float32 (CPU diagnostics)")
    ap.add_argument("--conditions", nargs="*", choices=["plain", "outliers"], default=["plain", "outliers"])
    a = ap.parse_args(argv)
    global EMULATE, CONDITIONS
    EMULATE = a.emulate_w8a8
    CONDITIONS = tuple(c == "outliers" for c in a.conditions)
    OVERRIDE.update(res=a.res, batch=a.batch, dtype=torch.float32 if a.fp32 else None)
    os.makedirs(a.out, exist_ok=True)
    out_path = os.path.join(a.out, "quality.json")
    results = {"env": common.env_info(), "reduced": a.reduced, "sigmas": SIGMAS_EVAL,
               "emulate_w8a8": a.emulate_w8a8, "override": {k: str(v) for k, v in OVERRIDE.items()}}
    for name in a.models:
        run(name, a.reduced, results, out_path, a.variants)
    common.write_json(out_path, results)
    print("\n| model | format | naive | ours | ours / naive | ours+lowrank32 / naive |\n|---|---|---|---|---|---|")
    for key, block in results.items():
        if not isinstance(block, dict) or "rows" not in block:
            continue
        by = {(r["format"], r["recipe"]): r["mean_rel_err"] for r in block["rows"]}
        for fmt in ("float8_e4m3fn", "int8_tensorwise", "nvfp4"):
            if (fmt, "naive") in by and (fmt, "ours") in by:
                n, o = by[(fmt, "naive")], by[(fmt, "ours")]
                lr = by.get((fmt, "ours+lowrank32"))
                lr = f"{lr / n:.3f}" if lr is not None and n else "-"
                print(f"| {key} | {fmt} | {n:.5f} | {o:.5f} | {o / n if n else 0:.3f} | {lr} |")
            for kind in DIAGNOSTIC:
                if (fmt, "naive") in by and (fmt, kind) in by:
                    print(f"| {key} | {fmt} {kind} / naive | | {by[(fmt, kind)]:.5f} | "
                          f"{by[(fmt, kind)] / by[(fmt, 'naive')]:.3f} | |")
    return results


if __name__ == "__main__":
    main()

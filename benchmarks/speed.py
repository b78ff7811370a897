"""Sampling speed and VRAM per diffusion-model forward, side by side in one run.

    python benchmarks/speed.py --out DIR                  # H200: Flux-dev 1024^2 b1 (512 text tokens),
                                                          #       SDXL 1024^2 b2; full-size, random weights
    python benchmarks/speed.py --out DIR --reduced        # small models on the CPU (not a measurement)

Every model is built with ComfyUI's own classes (random weights), quantized by comfy-modelopt and
loaded the stock way (``comfy.sd.load_diffusion_model_state_dict``).  For each variant it times
``apply_model`` (median of 10 after warm-up, CUDA events) under three runtimes - stock ComfyUI
layers, our lean layers, lean layers + CUDA-graph replay - records the profiler's GPU kernel time,
the VRAM a forward needs beyond the weights (its first call's peak over what was resident) and
weight bytes, checks that lean equals stock bit for bit (graph replay equals eager), and reports
everything as ratios to the 16-bit model's stock eager time.  Also: raw GEMM ceilings.
    python benchmarks/speed.py --out DIR --w4a8           # an nvfp4 layer's ways per Flux shape (GPU)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import CUDA, DEVICE, torch  # noqa: E402

from comfy_modelopt.calibrate import CalibrationOptions, calibrate  # noqa: E402
import architectures  # noqa: E402
from comfy_modelopt.comfyui.lean import make_lean  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402

FULL = {
    "flux": dict(family="flux", size="full", batch=1, res=1024, txt=512, dtype=torch.bfloat16,
                 formats=["fp8-naive", "float8_e4m3fn", "int8_tensorwise", "int8_convrot", "nvfp4", "mxfp8",
                          "convrot_w4a4", "nvfp4-lowrank32"]),
    "sdxl": dict(family="sdxl", size="full", batch=2, res=1024, txt=77, dtype=torch.float16,
                 formats=["fp8-naive", "float8_e4m3fn", "int8_tensorwise", "nvfp4", "float8_e4m3fn-conv"]),
}
REDUCED = {
    "flux": dict(family="flux", size="small", batch=1, res=64, txt=16, dtype=torch.bfloat16,
                 formats=["fp8-naive", "float8_e4m3fn", "int8_tensorwise", "nvfp4", "nvfp4-lowrank32"],
                 inputs="flux_small"),
    "sd15": dict(family="sd15", size="small", batch=2, res=64, txt=77, dtype=torch.float16,
                 formats=["float8_e4m3fn", "int8_tensorwise", "float8_e4m3fn-conv"]),
}


def recipe_for(variant: str) -> Recipe:
    if variant == "int8_convrot":
        return Recipe("int8_tensorwise", weight_scale="absmax", convrot=True, sensitivity=False)
    if variant == "fp8-naive":
        return Recipe("float8_e4m3fn", weight_scale="absmax", sensitivity=False)
    if variant == "nvfp4-lowrank32":  # own loader: rank-32 16-bit branch beside the nvfp4 GEMM
        return Recipe("nvfp4", weight_scale="absmax", lowrank=32, sensitivity=False)
    if variant == "float8_e4m3fn-conv":  # own loader: fp8 W8A8 Linear + fp8 convolutions (UNets)
        return Recipe("float8_e4m3fn", weight_scale="absmax", input_scale="max", conv="fp8", sensitivity=False)
    return Recipe(variant, weight_scale="absmax", input_scale="max", sensitivity=False)


def measure(label, fn, ref, rows, base_ms, extra=None):
    # VRAM: the first call's peak over what was resident before it.  Resident are also the 16-bit
    # state dict and reference output the benchmark keeps, so the total peak is not the model's
    # need; its need is its weights plus this transient.  The first call of a graph variant is its
    # capture: a replay allocates nothing, its intermediates live in the pool sized at capture.
    before = common.allocated_gib()
    outs = []
    peak = common.peak_vram_gib(lambda: outs.append(fn()))
    out = outs.pop().float()
    ms, _ = common.time_ms(fn)
    row = {"variant": label, "ms": round(ms, 2), "vs_16bit_stock": round(base_ms / ms, 3) if base_ms else 1.0,
           "kernel_ms": _round(common.kernel_ms(fn)), "peak_vram_gib": _round(peak),
           "allocated_before_gib": _round(before),
           "transient_vram_gib": _round(None if peak is None else peak - before, 3),
           "rel_err_vs_16bit": _round(float((out - ref).norm() / ref.norm()) if ref is not None else 0.0, 5)}
    row.update(extra or {})
    rows.append(row)
    print(f"  {label:44s} {ms:8.2f} ms  x{row['vs_16bit_stock']:.3f}  kernels {row['kernel_ms']} ms  "
          f"VRAM +{row['transient_vram_gib']} GiB  err {row['rel_err_vs_16bit']}", flush=True)
    return out


def _round(v, n=2):
    return None if v is None else round(v, n)


def relean(patcher, **options) -> None:
    """Make the quantized layers lean again with other options (each layer's direct kernel replaced)."""
    for m in patcher.model.diffusion_model.modules():
        rec = getattr(m, "_modelopt", None)  # comfyui.records.LayerRecord
        if rec is not None:
            rec.kernel = None
    make_lean(patcher, **options)


def compiled_rows(patcher, label, x, sigma, kw, ref, rows, base_ms, exact_ref=None):
    """The same model under CUDA graphs captured over Inductor-compiled blocks (validated)."""
    if not COMPILE:
        return None
    t0 = time.perf_counter()
    fn, runner = common.graph_fn(patcher, x, sigma, kw, compile_blocks=True)
    before = common.allocated_gib()
    peak = common.peak_vram_gib(fn)  # capture: eager reference, compile, validate, graph
    compile_s = time.perf_counter() - t0
    out = measure(f"{label} + compiled blocks + CUDA graphs", fn, ref, rows, base_ms)
    # the capture ran above (with validation's extra eager outputs alive: an upper bound)
    rows[-1]["transient_vram_gib"] = _round(None if peak is None else peak - before, 3)
    cb = runner.compiled
    rows[-1].update({"compile_s": round(compile_s, 1), "compiled": cb.enabled, "compile_reason": cb.reason,
                     "compiled_vs_eager_rel_l2": cb.checks,
                     "graph": {"captures": runner.captures, "replays": runner.replays, "eager": runner.eager_calls}})
    if exact_ref is not None:
        rows[-1]["rel_l2_vs_eager"] = _round(float((out - exact_ref).norm() / exact_ref.norm()), 6)
    if PROFILE:
        rows[-1]["top_kernels"] = top_kernels(fn)
    return out


def int8_attention_rows(patcher, label, x, sigma, kw, ref, rows, base_ms):
    """The same model with kitchen's INT8 attention (opt-in runtime), under CUDA graphs."""
    from comfy_modelopt.comfyui.attention import enable_int8_attention, int8_attention_available
    if not CUDA or not int8_attention_available(DEVICE):
        return
    clone = enable_int8_attention(patcher, force=True)
    fn, runner = common.graph_fn(clone, x, sigma, kw)
    measure(f"{label} + INT8 attention + CUDA graphs", fn, ref, rows, base_ms)
    rows[-1]["graph"] = {"captures": runner.captures, "replays": runner.replays, "eager": runner.eager_calls}


def run_model(name: str, spec: dict, results: dict, deadline: float, out_path: str):
    print(f"\n== {name}: {spec['family']} {spec['size']}, batch {spec['batch']}, {spec['res']}px", flush=True)
    t0 = time.perf_counter()
    _, sd = architectures.build(spec["family"], spec["size"], seed=0, dtype=spec["dtype"], weights_device=DEVICE)
    x, sigma, kw = common.inputs(spec.get("inputs", spec["family"]), spec["batch"], spec["res"], spec["txt"],
                                 spec["dtype"])
    base = common.load_stock(sd)
    print(f"  built and loaded in {time.perf_counter() - t0:.0f}s", flush=True)
    rows = results.setdefault(name, {"spec": {k: str(v) for k, v in spec.items()}, "rows": []})["rows"]
    with torch.inference_mode():
        eager = lambda: base.model.apply_model(x, sigma, **kw)  # noqa: E731
        ref = eager().float()
        base_ms, _ = common.time_ms(eager)
        measure("16-bit stock eager", eager, ref, rows, base_ms, {"weight_bytes": common.model_bytes(base)})
        if CUDA:
            fn, runner = common.graph_fn(base, x, sigma, kw)
            out = measure("16-bit + CUDA graphs", fn, ref, rows, base_ms)
            rows[-1]["bit_exact_vs_eager"] = bool(torch.equal(out, ref))
            rows[-1]["graph"] = {"captures": runner.captures, "replays": runner.replays, "eager": runner.eager_calls}
            if INT8_ATTENTION:
                int8_attention_rows(base, "16-bit", x, sigma, kw, ref, rows, base_ms)
            compiled_rows(base, "16-bit", x, sigma, kw, ref, rows, base_ms, exact_ref=ref)
        # statistics for static fp8 input scales: a few real evaluations at several noise levels
        sigmas = [1.0, 0.7, 0.4, 0.1]
        stats = calibrate(base.model.diffusion_model,
                          lambda m: [base.model.apply_model(x, torch.full_like(sigma, s), **kw) for s in sigmas],
                          CalibrationOptions(reservoir_bytes=0))
    common.write_json(out_path, results)
    for variant in spec["formats"]:
        if time.time() > deadline:
            print(f"  (time budget reached: skipping {variant})", flush=True)
            results[name]["skipped"] = results[name].get("skipped", []) + [variant]
            continue
        try:
            run_variant(variant, sd, x, sigma, kw, ref, base_ms, stats, rows)
        except Exception as e:  # record and go on: one broken variant must not lose the run
            import traceback
            traceback.print_exc()
            results[name].setdefault("errors", {})[variant] = f"{type(e).__name__}: {e}"
            common.free()
        common.write_json(out_path, results)
    common.free(base)


def run_variant(variant, sd, x, sigma, kw, ref, base_ms, stats, rows):
    t1 = time.perf_counter()
    recipe = recipe_for(variant)
    use_stats = stats if variant not in ("fp8-naive",) and recipe.format.startswith("float8") else None
    with torch.inference_mode():
        q_sd, meta, report = common.quantize_sd(sd, recipe, use_stats)
    if variant == "fp8-naive":
        q_sd, meta = common.naive_w8a8(q_sd, meta)
    qt = time.perf_counter() - t1
    q = common.load_stock(q_sd, meta)
    del q_sd
    extra = {"weight_bytes": common.model_bytes(q), "quantize_s": round(qt, 1)}
    with torch.inference_mode():
        stock_fn = lambda: q.model.apply_model(x, sigma, **kw)  # noqa: E731
        stock_out = measure(f"{variant} stock eager", stock_fn, ref, rows, base_ms, extra)
        n = make_lean(q)
        lean_out = measure(f"{variant} lean eager", stock_fn, ref, rows, base_ms, {"lean_layers": n})
        rows[-1]["bit_exact_vs_stock"] = bool(torch.equal(lean_out, stock_out))
        if CUDA:
            fn, runner = common.graph_fn(q, x, sigma, kw)
            g_out = measure(f"{variant} lean + CUDA graphs", fn, ref, rows, base_ms)
            rows[-1]["bit_exact_vs_stock"] = bool(torch.equal(g_out, stock_out))
            rows[-1]["graph"] = {"captures": runner.captures, "replays": runner.replays, "eager": runner.eager_calls}
            if PROFILE:
                rows[-1]["top_kernels"] = top_kernels(fn)
            if variant in COMPILE_VARIANTS:
                compiled_rows(q, f"{variant} lean", x, sigma, kw, ref, rows, base_ms, exact_ref=stock_out)
            if variant == "float8_e4m3fn":
                relean(q, fast_accum=True)
                fn, runner = common.graph_fn(q, x, sigma, kw)
                measure(f"{variant} lean fast-accum + CUDA graphs", fn, ref, rows, base_ms)
                compiled_rows(q, f"{variant} lean fast-accum", x, sigma, kw, ref, rows, base_ms, exact_ref=stock_out)
                if INT8_ATTENTION:
                    int8_attention_rows(q, f"{variant} lean fast-accum", x, sigma, kw, ref, rows, base_ms)
        if DEQUANT_CACHE_GIB and lean_dequantized(q):
            dequant_cache_rows(q, variant, x, sigma, kw, ref, rows, base_ms, stock_out)
    common.free(q)


def lean_dequantized(patcher) -> bool:
    """Whether any layer of this model is computed dequantized here (nvfp4/mxfp8 before Blackwell)."""
    from comfy_modelopt.comfyui.lean import native_formats
    native = native_formats(patcher.load_device)
    return any(getattr(m, "quant_format", None) not in (None, *native) for m in patcher.model.diffusion_model.modules())


def dequant_cache_rows(q, variant, x, sigma, kw, ref, rows, base_ms, stock_out):
    """The layers computed dequantized, with 16-bit copies cached within --dequant-cache-gib."""
    relean(q, dequant_cache_bytes=int(DEQUANT_CACHE_GIB * 2**30))
    cache = q.model._modelopt.dequant_cache
    fn, runner = common.graph_fn(q, x, sigma, kw)
    out = measure(f"{variant} lean + dequant cache + CUDA graphs", fn, ref, rows, base_ms)
    rows[-1].update({"dequant_cache_gib": round(cache.used / 2**30, 2), "cached_layers": len(cache.entries),
                     "bit_exact_vs_stock": bool(torch.equal(out, stock_out))})


PROFILE = False
INT8_ATTENTION = False
DEQUANT_CACHE_GIB = 0.0
COMPILE = False
COMPILE_VARIANTS = ("float8_e4m3fn", "int8_tensorwise", "nvfp4", "nvfp4-lowrank32", "float8_e4m3fn-conv")


def top_kernels(fn, n: int = 12) -> list:
    """Where the GPU time goes: kernel time per call grouped by kernel name."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    common.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        common.sync()
    rows = sorted(((e.key[:90], e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda r: -r[1])[:n]
    for name, ms, count in rows:
        print(f"      {ms:8.2f} ms  x{count:4d}  {name}", flush=True)
    return [{"kernel": k, "ms": round(ms, 3), "calls": c} for k, ms, c in rows]


def gemm_ceiling(results: dict, reduced: bool):
    m, k, n = (4608, 3072, 12288) if not reduced else (256, 256, 512)
    dt = torch.bfloat16 if CUDA else torch.float32
    a = torch.randn(m, k, device=DEVICE, dtype=dt)
    b = torch.randn(n, k, device=DEVICE, dtype=dt)
    rows = []
    bf, _ = common.time_ms(lambda: a @ b.t(), warmup=5, iters=20)
    rows.append({"op": f"16-bit matmul {m}x{k}x{n}", "ms": round(bf, 3), "vs_16bit": 1.0})
    if CUDA:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=DEVICE)
        for fast in (False, True):
            t, _ = common.time_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=dt,
                                                           use_fast_accum=fast), warmup=5, iters=20)
            rows.append({"op": f"fp8 _scaled_mm fast_accum={fast}", "ms": round(t, 3), "vs_16bit": round(bf / t, 3)})
        ai, bi = torch.randint(-127, 127, (m, k), device=DEVICE, dtype=torch.int8), \
            torch.randint(-127, 127, (n, k), device=DEVICE, dtype=torch.int8)
        t, _ = common.time_ms(lambda: torch._int_mm(ai, bi.t()), warmup=5, iters=20)
        rows.append({"op": "int8 _int_mm", "ms": round(t, 3), "vs_16bit": round(bf / t, 3)})
        rows += attention_backends()
    results["gemm"] = rows
    for r in rows:
        print(f"  {r['op']:40s} {r['ms']} ms  x{r['vs_16bit']} {r.get('error', '')}", flush=True)


# Flux.1-dev's Linear shapes (N, K) and its rows per call at 1024^2 (1 = the modulation's vector)
FLUX_GEMMS = ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360))
W4A8_CONFIGS = ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3),
                (64, 128, 128, 4, 3), (64, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4))


def w4a8_gemms(results: dict, rows_per_call=(1, 512, 4096, 4608)):
    """An nvfp4 layer's ways on this GPU, per Flux shape: the 16-bit GEMM, fp8 (kitchen's input
    rounding + _scaled_mm), nvfp4 dequantized (kitchen's dequantization + 16-bit GEMM: stock
    ComfyUI before Blackwell) and W4A8 (the rows' rounding + the one kernel: its default tile and the
    best of W4A8_CONFIGS; + the expanded way, and its expansion alone), each output against the
    16-bit one of the nvfp4 weight."""
    import comfy_kitchen as ck
    from comfy_modelopt import w4a8
    rows = []
    for n, k in FLUX_GEMMS:
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        g = (w.abs().amax().float() / (448 * 6)).reshape(1)
        q, bs = ck.quantize_nvfp4(w, g)
        dense = ck.dequantize_nvfp4(q, g, bs, torch.bfloat16)
        w8s = (w.abs().amax().float() / 448).reshape(1)
        w8 = ck.quantize_per_tensor_fp8(w, w8s, torch.float8_e4m3fn)
        for m in rows_per_call:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            sx = (x.abs().amax().float() / 448).reshape(1)
            ref = x @ dense.t()
            times = {"16-bit": common.time_ms(lambda: x @ w.t(), 5, 20)[0],
                     "fp8": common.time_ms(lambda: torch._scaled_mm(
                         ck.quantize_per_tensor_fp8(x, sx, torch.float8_e4m3fn), w8.t(), scale_a=sx, scale_b=w8s,
                         out_dtype=torch.bfloat16), 5, 20)[0],
                     "dequantized": common.time_ms(lambda: x @ ck.dequantize_nvfp4(q, g, bs, torch.bfloat16).t(),
                                                   5, 20)[0]}
            run = lambda c=None: w4a8.linear(*w4a8.quantize_rows(x), q, g, bs, None, torch.bfloat16,  # noqa: E731
                                             config=c)
            times["w4a8"] = common.time_ms(run, 5, 20)[0]
            times["expanded"] = common.time_ms(lambda: w4a8.linear_expanded(*w4a8.quantize_rows(x), q, g, bs, None,
                                                                            torch.bfloat16), 5, 20)[0]
            times["expand alone"] = common.time_ms(lambda: w4a8.expand(q, bs), 5, 20)[0]
            best = min(W4A8_CONFIGS, key=lambda c: common.time_ms(lambda: run(c), 3, 10)[0])
            times["w4a8 best"] = common.time_ms(lambda: run(best), 5, 20)[0]
            err = float((run().float() - ref.float()).norm() / ref.float().norm())
            err_x = float((w4a8.linear_expanded(*w4a8.quantize_rows(x), q, g, bs, None, torch.bfloat16).float()
                           - ref.float()).norm() / ref.float().norm())
            row = {"m": m, "n": n, "k": k, "ms": {key: round(t, 4) for key, t in times.items()},
                   "w4a8_vs_16bit": round(times["16-bit"] / times["w4a8"], 3),
                   "w4a8_vs_dequantized": round(times["dequantized"] / times["w4a8"], 3),
                   "expanded_vs_16bit": round(times["16-bit"] / times["expanded"], 3),
                   "fastest_4bit_way": min(("w4a8", "expanded", "dequantized"), key=times.get),
                   "best_config": best, "default_config": w4a8.pick_config(m, n, k),
                   "w4a8_rel_err_vs_nvfp4_16bit": round(err, 5), "expanded_rel_err_vs_nvfp4_16bit": round(err_x, 5),
                   "resident_vs_16bit": round((q.numel() + bs.numel()) / (2 * n * k), 4)}
            rows.append(row)
            print(f"  {m:5d}x{k:5d}x{n:5d}  " + "  ".join(f"{key} {t:.3f}" for key, t in times.items())
                  + f"  ms | W4A8 {row['w4a8_vs_16bit']}x 16-bit, {row['w4a8_vs_dequantized']}x dequantized, "
                  f"expanded {row['expanded_vs_16bit']}x 16-bit, best {best}, err {err:.4f} / {err_x:.4f}", flush=True)
    results["w4a8"] = rows


def attention_backends() -> list:
    """SDPA kernels at Flux-dev 1024^2 (24 heads x 4608 tokens x 128): what the 16-bit part costs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(1, 24, 4608, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    rows, base = [], None
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                t, _ = common.time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                      warmup=5, iters=20)
        except RuntimeError as e:
            rows.append({"op": f"sdpa {name}", "ms": None, "vs_16bit": None, "error": str(e)[:80]})
            continue
        base = base or t
        rows.append({"op": f"sdpa {name} 1x24x4608x128", "ms": round(t, 3), "vs_16bit": round(base / t, 3)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for speed.json")
    ap.add_argument("--reduced", action="store_true", help="small models (CPU smoke run; not a measurement)")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--budget-s", type=float, default=540, help="stop starting new variants after this")
    ap.add_argument("--formats", nargs="*", default=None, help="only these variants")
    ap.add_argument("--profile", action="store_true", help="print the top GPU kernels of graph variants")
    ap.add_argument("--int8-attention", action="store_true", help="also time kitchen's INT8 attention runtime")
    ap.add_argument("--compile", action="store_true",
                    help="also time CUDA graphs over Inductor-compiled blocks (validated against eager)")
    ap.add_argument("--dequant-cache-gib", type=float, default=0.0,
                    help="also time formats computed dequantized with a cache of 16-bit weights this large")
    ap.add_argument("--skip-ceilings", action="store_true", help="skip the GEMM/attention microbenchmarks")
    ap.add_argument("--w4a8", action="store_true", help="only the nvfp4 layer's ways per Flux shape (w4a8_gemms)")
    a = ap.parse_args(argv)
    global PROFILE, INT8_ATTENTION, COMPILE, DEQUANT_CACHE_GIB
    PROFILE, INT8_ATTENTION, COMPILE = a.profile, a.int8_attention, a.compile
    DEQUANT_CACHE_GIB = a.dequant_cache_gib
    os.makedirs(a.out, exist_ok=True)
    deadline = time.time() + a.budget_s
    specs = REDUCED if a.reduced else FULL
    out_path = os.path.join(a.out, "speed.json")
    results = {"env": common.env_info(), "reduced": a.reduced}
    print(results["env"], flush=True)
    if a.w4a8:
        w4a8_gemms(results)
        common.write_json(out_path, results)
        return results
    if not a.skip_ceilings:
        print("\n== GEMM ceiling", flush=True)
        gemm_ceiling(results, a.reduced)
    for name in a.models or list(specs):
        spec = dict(specs[name])
        if a.formats:
            spec["formats"] = [f for f in spec["formats"] if f in a.formats]
        run_model(name, spec, results, deadline, out_path)
    common.write_json(out_path, results)
    print_table(results)
    return results


def print_table(results: dict):
    for name, block in results.items():
        if not isinstance(block, dict) or "rows" not in block:
            continue
        print(f"\n### {name}\n\n| variant | ms/forward | vs 16-bit stock eager | GPU kernel ms | "
              f"weights GiB | forward VRAM over weights GiB | output rel. err vs 16-bit | bit-exact |")
        print("|---|---|---|---|---|---|---|---|")
        for r in block["rows"]:
            wb = r.get("weight_bytes")
            exact = r.get("bit_exact_vs_stock", r.get("bit_exact_vs_eager", ""))
            print(f"| {r['variant']} | {r['ms']} | {r['vs_16bit_stock']}x | {r['kernel_ms']} | "
                  f"{'' if wb is None else round(wb / 2**30, 2)} | {r.get('transient_vram_gib')} | {r['rel_err_vs_16bit']} | {exact} |")


if __name__ == "__main__":
    main()

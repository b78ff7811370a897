"""Per-layer algorithms: output error and time, per format x algorithm, on real-architecture
layer shapes with realistic activation outliers.  Core only (no ComfyUI); runs on a CPU.

    python benchmarks/algorithms.py --out DIR [--quick]

Weights: random N(0, 1/K) at the shapes of Flux.1 and SDXL layers.  Activations: rows of N(0, 1)
whose 8 fixed channels are scaled 20-100x (as reported for real DiTs and LLMs); the
calibration rows (512) and the evaluation rows (512) are separate draws with the same outlier
channels.  Error = ||Qa(x') Qw(W')^T - x W^T|| / ||x W^T|| on the evaluation rows, where Qa is
the activation rounding ComfyUI applies at run time for the format (fp8: static scale from the
calibration amax; int8/int4: dynamic per row; nvfp4/mxfp8: dynamic blocks) and x', W' are the
smoothed input and weight where smoothing applies.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

from comfy_modelopt.formats import get_format  # noqa: E402
from comfy_modelopt.gptq import damped, gptq, gram  # noqa: E402
from comfy_modelopt.lowrank import lowrank_split  # noqa: E402
from comfy_modelopt.scales import choose_weight_clip  # noqa: E402
from comfy_modelopt.smoothing import search_smoothing  # noqa: E402

LAYERS = {  # name: (out_features N, in_features K)
    "flux double_blocks.N.img_attn.proj": (3072, 3072),
    "flux double_blocks.N.img_mlp.0": (12288, 3072),
    "flux double_blocks.N.img_mlp.2": (3072, 12288),
    "sdxl ...attn1.to_q": (640, 640),
    "sdxl ...ff.net.0.proj": (10240, 1280),
    "sdxl ...ff.net.2": (1280, 5120),
}
QUICK = {"small test layer": (512, 1024)}  # --quick: a smoke run of every algorithm
FORMATS = ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4", "convrot_w4a4"]


def outliers(m, k, seed, channels):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, channels] *= torch.linspace(20, 100, len(channels))
    return x


def act_scale(fmt, x_absmax):
    if not fmt.needs_input_scale:
        return None
    return float(x_absmax.max()) / fmt.input_fmax()


def out_err(fmt, w_deq_search, x, ref, s=None, input_scale=None):
    xs = x if s is None else x / s
    q = fmt.fake_act(xs, input_scale) @ w_deq_search.T
    return float((q - ref).norm() / ref.norm())


def run_layer(name, n, k, fmt_name, quick):
    fmt = get_format(fmt_name)
    if fmt.shape_problem(n, k):
        return []
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    channels = torch.randperm(k, generator=g)[:8]
    cal, ev = outliers(512, k, 1, channels), outliers(512, k, 2, channels)
    ref = ev @ w.T
    xabs, xmean = cal.abs().amax(0), cal.abs().mean(0)
    rows = []

    def record(algo, t0, wq_search, s=None):
        scale = act_scale(fmt, xabs if s is None else xabs / s)
        rows.append({"layer": name, "shape": [n, k], "format": fmt_name, "algorithm": algo,
                     "output_err": round(out_err(fmt, wq_search, ev, ref, s, scale), 5),
                     "seconds": round(time.perf_counter() - t0, 3)})

    t0 = time.perf_counter()
    record("absmax", t0, fmt.fake_rows(fmt.search_space(w)))
    t0 = time.perf_counter()
    c = choose_weight_clip(w, fmt, "mse")
    record("mse clip (weight)", t0, fmt.fake_rows(fmt.search_space(w), c.alpha))
    if fmt.free_scale == "tensor":
        t0 = time.perf_counter()
        c = choose_weight_clip(w, fmt, "mse", xs=cal)
        record("mse clip (output-aware)", t0, fmt.fake_rows(fmt.search_space(w), c.alpha))
    for method in ("smoothquant", "awq"):
        t0 = time.perf_counter()
        sm = search_smoothing(w, cal, xabs, xmean, fmt, method, static_input=fmt.needs_input_scale)
        s = sm.scales
        ws = w if s is None else w * s
        record(f"{method}" + (f" (a={sm.alpha:.1f})" if s is not None else " (no gain)"), t0,
               fmt.fake_rows(fmt.search_space(ws)), s)
    rounding = fmt.gptq_rounding(w, None)
    if rounding is not None and not quick:
        t0 = time.perf_counter()
        q = gptq(w, damped(gram(cal), 0.01), rounding[0])
        record("gptq", t0, q)
    if fmt.lowrank:
        for rank in (32,) if quick else (16, 64):
            t0 = time.perf_counter()
            sm = search_smoothing(w, cal, xabs, xmean, fmt, "awq")
            s = sm.scales if sm.scales is not None else torch.ones(k)
            parts = lowrank_split(w * s, rank)
            xs = ev / s
            q = fmt.fake_act(xs) @ fmt.fake_rows(fmt.search_space(parts.residual)).T + xs @ (parts.l1 @ parts.l2).T
            rows.append({"layer": name, "shape": [n, k], "format": fmt_name, "algorithm": f"awq + low-rank r={rank}",
                         "output_err": round(float((q - ref).norm() / ref.norm()), 5),
                         "seconds": round(time.perf_counter() - t0, 3), "stock_loadable": False})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="two layers, no GPTQ (CI smoke run)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    torch.set_grad_enabled(False)
    rows = []
    for name, (n, k) in (QUICK if a.quick else LAYERS).items():
        for fmt in FORMATS:
            for r in run_layer(name, n, k, fmt, a.quick):
                rows.append(r)
                print(f"{r['layer']:38s} {r['format']:16s} {r['algorithm']:28s} err {r['output_err']:.5f} "
                      f"{r['seconds']:7.2f}s", flush=True)
    doc = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpus": os.cpu_count(), "rows": rows}
    with open(os.path.join(a.out, "algorithms.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print("\n| layer | format | absmax | best algorithm | its error | vs absmax |\n|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["layer"] for r in rows):
        for fmt in FORMATS:
            rs = [r for r in rows if r["layer"] == name and r["format"] == fmt]
            if not rs:
                continue
            base = next(r for r in rs if r["algorithm"] == "absmax")["output_err"]
            stock = [r for r in rs if r.get("stock_loadable", True)]
            best = min(stock, key=lambda r: r["output_err"])
            print(f"| {name} | {fmt} | {base:.4f} | {best['algorithm']} | {best['output_err']:.4f} | "
                  f"{best['output_err'] / base:.2f} |")
    return rows


if __name__ == "__main__":
    main()

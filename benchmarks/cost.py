"""Quantization cost on the GPU: calibrate (16 prompts x 20 steps through ComfyUI's own sampler)
and quantize full-size Flux-dev and SDXL models to fp8 (W8A8) and to nvfp4 with AWQ.

    python benchmarks/cost.py --out DIR              # H200, full-size models, random weights
    python benchmarks/cost.py --out DIR --reduced    # small models on the CPU (not a measurement)

Prompts are random text-conditioning tensors of the real shapes (no text encoder is loaded; the
diffusion model does the same work either way).  Reports wall time, peak GPU memory allocated and
the process's peak resident memory after each phase, and writes JSON.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import CUDA, DEVICE, torch  # noqa: E402

import comfy.sample  # noqa: E402

from comfy_modelopt.calibrate import CalibrationOptions, calibrate  # noqa: E402
import architectures  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402

FULL = {"flux": dict(family="flux", size="full", res=1024, txt=512, dtype=torch.bfloat16, cfg=1.0),
        "sdxl": dict(family="sdxl", size="full", res=1024, txt=77, dtype=torch.float16, cfg=5.0)}
REDUCED = {"flux": dict(family="flux", size="small", res=64, txt=16, dtype=torch.bfloat16, cfg=1.0,
                        inputs="flux_small"),
           "sd15": dict(family="sd15", size="small", res=64, txt=77, dtype=torch.float16, cfg=5.0)}


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def phase(label, fn, rows):
    common.sync()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    common.sync()
    row = {"phase": label, "seconds": round(time.perf_counter() - t0, 1),
           "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if CUDA else None,
           "peak_rss_gib": round(rss_gib(), 2)}
    rows.append(row)
    print(f"  {label:40s} {row['seconds']:8.1f} s  GPU {row['peak_gpu_gib']} GiB  RSS {row['peak_rss_gib']} GiB",
          flush=True)
    return out


def conditioning(spec, n, seed):
    """n random 'prompts' in ComfyUI's conditioning format for this model."""
    g = torch.Generator().manual_seed(seed)
    conds = []
    for _ in range(n):
        if spec["family"] == "flux":
            width = 4096 if spec["size"] == "full" else 256
            c = [[torch.randn(1, spec["txt"], width, generator=g),
                  {"pooled_output": torch.randn(1, 768 if spec["size"] == "full" else 256, generator=g),
                   "guidance": 3.5}]]
        elif spec["family"] == "sdxl":
            c = [[torch.randn(1, 77, 2048, generator=g), {"pooled_output": torch.randn(1, 1280, generator=g),
                                                           "width": spec["res"], "height": spec["res"],
                                                           "crop_w": 0, "crop_h": 0, "target_width": spec["res"],
                                                           "target_height": spec["res"]}]]
        else:
            c = [[torch.randn(1, 77, 768, generator=g), {}]]
        conds.append(c)
    return conds


def run(name, spec, prompts, steps, results, out_path):
    print(f"\n== {name}", flush=True)
    rows = results.setdefault(name, {"spec": {k: str(v) for k, v in spec.items()}, "rows": []})["rows"]
    sd = phase("build random weights", lambda: architectures.build(
        spec["family"], spec["size"], dtype=spec["dtype"], weights_device=DEVICE)[1], rows)
    model = phase("load (stock)", lambda: common.load_stock(sd), rows)
    latent = torch.zeros(1, 4, spec["res"] // 8, spec["res"] // 8)
    latent = comfy.sample.fix_empty_latent_channels(model, latent)
    conds = conditioning(spec, prompts, 0)
    negative = conditioning(spec, 1, 99)[0]

    def loop(_m):
        for i, c in enumerate(conds):
            noise = comfy.sample.prepare_noise(latent, i)
            comfy.sample.sample(model, noise, steps, spec["cfg"], "euler", "simple", c, negative, latent,
                                seed=i, disable_pbar=True)
    with torch.inference_mode():
        stats = phase(f"calibrate {prompts} prompts x {steps} steps",
                      lambda: calibrate(model.model.diffusion_model, loop, CalibrationOptions()), rows)
    rows[-1]["forward_calls"] = stats.forward_calls
    rows[-1]["stats_mib"] = round(stats.nbytes() / 2**20, 1)
    common.free(model)
    for label, recipe in (("quantize float8_e4m3fn W8A8", Recipe("float8_e4m3fn")),
                          ("quantize nvfp4 + AWQ", Recipe("nvfp4", smoothing="awq"))):
        with torch.inference_mode():
            report = phase(label, lambda: common.quantize_sd(sd, recipe, stats)[2], rows)
        rows[-1]["mean_weight_err"] = round(report.mean_rel_err(), 5)
        rows[-1]["smoothed_layers"] = sum(1 for l in report.quantized if "folded" in l.notes)
        common.free()
        common.write_json(out_path, results)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    specs = REDUCED if a.reduced else FULL
    out_path = os.path.join(a.out, "cost.json")
    results = {"env": common.env_info(), "reduced": a.reduced, "prompts": a.prompts, "steps": a.steps}
    for name in a.models or list(specs):
        run(name, specs[name], a.prompts, a.steps, results, out_path)
    common.write_json(out_path, results)
    print("\n| model | phase | seconds | peak GPU GiB | peak RSS GiB |\n|---|---|---|---|---|")
    for name, block in results.items():
        if isinstance(block, dict) and "rows" in block:
            for r in block["rows"]:
                print(f"| {name} | {r['phase']} | {r['seconds']} | {r['peak_gpu_gib']} | {r['peak_rss_gib']} |")
    return results


if __name__ == "__main__":
    main()

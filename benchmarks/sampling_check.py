"""Whole sampling runs through ComfyUI's sampler with each runtime of a quantized model.

``python benchmarks/sampling_check.py --out DIR [--model sdxl|flux] [--steps N]`` builds the
full-size model (random weights, ComfyUI's own classes), quantizes it to fp8 W8A8 with static
input scales, and samples the same noise/conditioning (KSampler path: ``comfy.sample.sample``,
euler, CFG, so the model sees changing timesteps and a cond+uncond batch) with the runtimes the
nodes offer: stock, lean, lean + CUDA graphs, lean + compiled blocks + CUDA graphs - and, as the
yardstick for compiled blocks, lean with each model input rounded once more.  Prints the
wall time per run, the final latents' relative L2 difference against the stock run, and how
often the graphs were captured / replayed / bypassed.  ``--reduced`` runs a small model on a CPU
(graphs then fall back to eager: a smoke run, not a measurement).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import architectures  # noqa: E402

architectures.setup_comfy()
import comfy.sample  # noqa: E402

import common  # noqa: E402
from comfy_modelopt.comfyui.compiled_blocks import rounding_noise  # noqa: E402
from comfy_modelopt.comfyui.cuda_graphs import CudaGraphs  # noqa: E402
from comfy_modelopt.comfyui.lean import make_lean  # noqa: E402
from comfy_modelopt.comfyui.runtime import apply_runtime  # noqa: E402

EAGER_NOISE = "lean, input rounded once more per call (eager's own noise)"

SPECS = {"sdxl": dict(family="sdxl", size="full", res=1024, dtype=torch.float16),
         "flux": dict(family="flux", size="full", res=1024, dtype=torch.bfloat16, txt=512)}
# --reduced: the same families at ComfyUI's small configurations (CPU smoke runs)
REDUCED = {"sdxl": dict(family="sdxl", size="small", res=64, dtype=torch.float32),
           "flux": dict(family="flux", size="small", res=64, dtype=torch.float32, txt=16, inputs="flux_small")}
POOLED = {"sdxl": 1280}  # SDXL's ADM vector = pooled CLIP-G output (1280) + 6 size embeddings (1536)


def conds(family: str, inputs: str, txt: int, dtype):
    x, _, kw = common.inputs(inputs, 1, 64, txt, dtype)
    extra = {"pooled_output": kw["y"][:, :POOLED.get(family, kw["y"].shape[1])]} if "y" in kw else {}
    if family == "flux":
        extra["guidance"] = 3.5
    pos = [[kw["c_crossattn"], dict(extra)]]
    neg = [[torch.zeros_like(kw["c_crossattn"]), dict(extra)]]
    return pos, neg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="sdxl", choices=list(SPECS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reduced", action="store_true", help="the model at a small configuration (CPU smoke run)")
    a = ap.parse_args(argv)
    spec = (REDUCED if a.reduced else SPECS)[a.model]
    os.makedirs(a.out, exist_ok=True)
    _, sd = architectures.build(spec["family"], spec["size"], seed=0, dtype=spec["dtype"], weights_device=common.DEVICE)
    base = common.load_stock(sd)
    inputs = spec.get("inputs", spec["family"])
    x, sigma, kw = common.inputs(inputs, 1, spec["res"], spec.get("txt", 77), spec["dtype"])
    q_sd, meta = common.calibrated_fp8(base, sd, x, sigma, kw)
    common.free(base)
    del sd
    fam = spec["family"]
    pos, neg = conds(fam, inputs, spec.get("txt", 77), spec["dtype"])
    latent_c = 16 if fam == "flux" else 4
    latent = torch.zeros(1, latent_c, spec["res"] // 8, spec["res"] // 8)
    noise = comfy.sample.prepare_noise(latent, 0)
    results = {"env": common.env_info(), "model": a.model + (" (reduced)" if a.reduced else ""), "steps": a.steps,
               "rows": []}
    ref = None
    # the last "runtime" is eager with every model input rounded once more: how far eager itself
    # drifts along the trajectory from one extra rounding per step - the yardstick for compiled
    # blocks, whose fused kernels round differently
    runs = ["stock", "lean", "lean + cuda graphs", "lean + compiled blocks + cuda graphs", EAGER_NOISE]
    for runtime in runs:
        q = common.load_stock(q_sd, meta)
        if runtime == EAGER_NOISE:
            make_lean(q)
            dtype = q.model.get_dtype_inference()
            q.set_model_unet_function_wrapper(
                lambda apply_model, args: apply_model(rounding_noise(args["input"], dtype), args["timestep"], **args["c"]))
        else:  # as the nodes install it
            q, _ = apply_runtime(q, runtime)
        runner = q.model_options.get("model_function_wrapper")
        runner = runner if isinstance(runner, CudaGraphs) else None
        # graph runtimes run twice: the first run captures (and compiles), ComfyUI's cleanup then
        # releases the graphs, and the second run shows the steady state a user sees
        for attempt in range(2 if runner is not None else 1):
            with torch.inference_mode():
                common.sync()
                t0 = time.perf_counter()
                out = comfy.sample.sample(q, noise, a.steps, 4.0, "euler", "simple", pos, neg, latent, seed=0,
                                          disable_pbar=True).float()
                common.sync()
                secs = time.perf_counter() - t0
            ref = out if ref is None else ref
            label = runtime + (" (second run)" if attempt else "")
            row = {"runtime": label, "seconds": round(secs, 2),
                   "rel_l2_vs_stock": float((out - ref).norm() / ref.norm()), "finite": bool(torch.isfinite(out).all())}
            if runner is not None:
                row["graph"] = {"captures": runner.captures, "capture_s": list(runner.capture_seconds),
                                "replays": runner.replays, "eager": runner.eager_calls,
                                "releases": runner.releases, "eager_reasons": sorted(runner.warned)}
                if runner.compiled is not None:
                    row["compiled"] = {"enabled": runner.compiled.enabled, "reason": runner.compiled.reason,
                                       "checks": runner.compiled.checks}
            results["rows"].append(row)
            print(f"  {label:52s} {secs:7.2f} s  rel L2 vs stock {row['rel_l2_vs_stock']:.2e}  "
                  f"{row.get('graph', '')} {row.get('compiled', '')}", flush=True)
        common.free(q)
        common.write_json(os.path.join(a.out, "sampling.json"), results)
    return results


if __name__ == "__main__":
    main()

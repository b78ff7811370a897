"""LoRA on a quantized model: merged into the weights vs bypass (computed beside them).

``python benchmarks/lora.py --out DIR [--models flux sdxl] [--rank 32]`` builds the full-size
model (random weights, ComfyUI's own classes), a random LoRA of the given rank on every
attention and MLP Linear of the transformer blocks (ComfyUI's ``lora_up``/``lora_down`` keys),
quantizes the model to fp8 W8A8 with static input scales, and applies the LoRA both ways
ComfyUI offers: ``load_lora_for_models`` (merge: ComfyUI adds the delta to each weight and
re-quantizes it at load) and ``load_bypass_lora_for_models`` (bypass: the weights stay as they
are, each layer adds ``up(down(x))``).  For each it reports the load time, ms per forward under
the runtimes (stock layers, lean, lean + CUDA graphs) side by side with the 16-bit model with
the LoRA merged, and the output error against that 16-bit model.  ``--reduced`` runs small
models on a CPU (a smoke run: graphs fall back to eager there).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import architectures  # noqa: E402

architectures.setup_comfy()
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402

import common  # noqa: E402
from comfy_modelopt.comfyui.lean import make_lean  # noqa: E402

SPECS = {"flux": dict(family="flux", size="full", batch=1, res=1024, txt=512, dtype=torch.bfloat16),
         "sdxl": dict(family="sdxl", size="full", batch=2, res=1024, txt=77, dtype=torch.float16)}
REDUCED = {"flux": dict(family="flux", size="small", batch=1, res=64, txt=16, dtype=torch.bfloat16, inputs="flux_small"),
           "sdxl": dict(family="sd15", size="small", batch=1, res=64, txt=77, dtype=torch.float32, inputs="sd15")}
# the Linear layers a typical LoRA trains
TARGETS = re.compile(r"(attn\.(qkv|proj)|_attn\.(qkv|proj)|mlp\.[02]|linear[12]|attn[12]\.to_(q|k|v|out\.0)|ff\.net\.(0\.proj|2))\.weight$")


def random_lora(sd: dict, rank: int, seed: int = 0, strength: float = 0.1) -> dict:
    """A LoRA whose delta per layer is ``strength`` x the weight's RMS scale (typical of trained ones)."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for k, w in sd.items():
        if w.dim() != 2 or not TARGETS.search(k):
            continue
        n, kk = w.shape
        r = min(rank, n, kk)
        base = "diffusion_model." + k[: -len(".weight")]
        rms = float(w.float().pow(2).mean().sqrt())
        # delta = up @ down, entries ~ strength * rms
        lora[base + ".lora_down.weight"] = (torch.randn(r, kk, generator=g) / kk ** 0.25).to(w.dtype)
        lora[base + ".lora_up.weight"] = (torch.randn(n, r, generator=g) * strength * rms / (r ** 0.5 * kk ** 0.25)).to(w.dtype)
        lora[base + ".alpha"] = torch.tensor(float(r))
    return lora


def timed_load(patcher) -> float:
    common.sync()
    t0 = time.perf_counter()
    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    common.sync()
    return time.perf_counter() - t0


def run(name: str, spec: dict, rank: int, results: dict, out_path: str):
    print(f"\n== {name}: {spec['family']} {spec['size']}, LoRA rank {rank}", flush=True)
    _, sd = architectures.build(spec["family"], spec["size"], seed=0, dtype=spec["dtype"], weights_device=common.DEVICE)
    x, sigma, kw = common.inputs(spec.get("inputs", spec["family"]), spec["batch"], spec["res"], spec["txt"], spec["dtype"])
    lora = random_lora({k: v.cpu() for k, v in sd.items()}, rank)
    rows = results.setdefault(name, {"rank": rank, "lora_layers": len(lora) // 3, "rows": []})["rows"]
    base = common.load_stock(sd)
    # calibrate first: the 16-bit + LoRA clone shares base's model, and freeing it offloads that
    q_sd, meta = common.calibrated_fp8(base, sd, x, sigma, kw)
    ref16, _ = comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0)
    load_s = timed_load(ref16)
    with torch.inference_mode():
        fn = lambda: ref16.model.apply_model(x, sigma, **kw)  # noqa: E731
        ref = fn().float()
        base_ms, _ = common.time_ms(fn)
        rows.append({"variant": "16-bit + LoRA merged, stock eager", "ms": round(base_ms, 2), "load_s": round(load_s, 2)})
        print(f"  {rows[-1]}", flush=True)
        common.free(ref16, base)
    del sd
    for mode, loader in (("merge", comfy.sd.load_lora_for_models), ("bypass", comfy.sd.load_bypass_lora_for_models)):
        q = common.load_stock(q_sd, meta)
        lq, _ = loader(q, None, lora, 1.0, 0)
        load_s = timed_load(lq)  # as ComfyUI's sampler does (outside inference mode)
        with torch.inference_mode():
            for runtime in ("stock", "lean", "lean + CUDA graphs"):
                if runtime == "lean":
                    make_lean(lq)
                if runtime.endswith("graphs"):
                    if not common.CUDA:
                        continue
                    fn, runner = common.graph_fn(lq, x, sigma, kw)
                else:
                    fn = lambda: lq.model.apply_model(x, sigma, **kw)  # noqa: E731
                out = fn().float()
                ms, _ = common.time_ms(fn)
                row = {"variant": f"fp8 + LoRA {mode}, {runtime}", "ms": round(ms, 2),
                       "vs_16bit_lora": round(base_ms / ms, 3), "load_s": round(load_s, 2),
                       "rel_err_vs_16bit_lora": round(float((out - ref).norm() / ref.norm()), 5)}
                if runtime.endswith("graphs"):
                    row["graph"] = {"captures": runner.captures, "replays": runner.replays, "eager": runner.eager_calls}
                rows.append(row)
                print(f"  {row}", flush=True)
        common.free(lq, q)
        common.write_json(out_path, results)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="*", default=["flux", "sdxl"])
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--reduced", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    out_path = os.path.join(a.out, "lora.json")
    results = {"env": common.env_info(), "reduced": a.reduced}
    for name in a.models:
        run(name, (REDUCED if a.reduced else SPECS)[name], a.rank, results, out_path)
    common.write_json(out_path, results)
    print("\n| model | variant | ms | vs 16-bit + LoRA | load s | rel. err vs 16-bit + LoRA |\n|---|---|---|---|---|---|")
    for name in a.models:
        for r in results[name]["rows"]:
            print(f"| {name} | {r['variant']} | {r['ms']} | {r.get('vs_16bit_lora', 1.0)}x | {r['load_s']} | "
                  f"{r.get('rel_err_vs_16bit_lora', 0.0)} |")
    return results


if __name__ == "__main__":
    main()

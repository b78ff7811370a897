"""Smoothing folded through Flux's adaLN modulation: held-out output error with and without it.

``COMFYUI_PATH=... python benchmarks/flux_smoothing.py --out DIR`` builds ComfyUI's Flux class at
its small config (float32, random weights), calibrates it on 12 forwards (4 inputs x 3 sigmas),
quantizes it with smoothing none / smoothquant / awq for int8, nvfp4 and fp8, loads each file with
ComfyUI's own loader and reports the relative L2 error of the model output against the float
model on 6 held-out forwards (inputs the calibration never saw), and how many layers got a fold.
A CPU run: a correctness-and-direction check on random weights, not a real-weights claim.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import architectures  # noqa: E402

architectures.setup_comfy()
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402

import common  # noqa: E402
from comfy_modelopt import Recipe, quantize  # noqa: E402
from comfy_modelopt.calibrate import calibrate  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    _, sd = architectures.build("flux", "small", seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)

    def run(patcher, seed, sigma):
        g.manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        return patcher.model.apply_model(r(1, 16, 16, 16), torch.tensor([sigma]), c_crossattn=r(1, 8, 256) * 3,
                                         y=r(1, 256), guidance=torch.tensor([3.5])).float()
    base = comfy.sd.load_diffusion_model_state_dict(dict(sd))  # ComfyUI's loader consumes the dict
    comfy.model_management.load_models_gpu([base])
    results = {"env": common.env_info(), "model": "flux small (random weights, float32)", "rows": []}
    with torch.inference_mode():
        stats = calibrate(base.model.diffusion_model,
                          lambda m: [run(base, s, sig) for s in range(4) for sig in (0.9, 0.5, 0.1)])
        refs = {(s, sig): run(base, s, sig) for s in (100, 101) for sig in (0.9, 0.5, 0.1)}
        for fmt in ("int8_tensorwise", "nvfp4", "float8_e4m3fn"):
            for smoothing in ("none", "smoothquant", "awq"):
                q, _, rep = quantize(sd, Recipe(fmt, smoothing=smoothing, sensitivity=False), stats)
                patcher = comfy.sd.load_diffusion_model_state_dict(q)
                errs = [float((run(patcher, s, sig) - ref).norm() / ref.norm()) for (s, sig), ref in refs.items()]
                folded = sum(" folded into " in layer.notes and "not folded" not in layer.notes
                             for layer in rep.quantized)
                row = {"format": fmt, "smoothing": smoothing, "held_out_rel_err": round(sum(errs) / len(errs), 5),
                       "folded_layers": folded}
                results["rows"].append(row)
                print(f"{fmt:16s} {smoothing:12s} held-out rel err {row['held_out_rel_err']:.4f}  "
                      f"folded layers {folded}", flush=True)
    common.write_json(os.path.join(a.out, "flux_smoothing.json"), results)
    return results


if __name__ == "__main__":
    main()

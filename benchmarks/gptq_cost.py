"""What one GPTQ pass over a layer costs, by the column loop that runs it.

    python benchmarks/gptq_cost.py --device cuda --out DIR
    python benchmarks/gptq_cost.py --reduced --out DIR        # small shapes, CPU smoke run

For Flux.1-dev's Linear shapes (out x in: the single blocks' down projection 3072 x 15360 and
up projection 21504 x 3072, the MLP's 3072 x 12288, attention's 3072 x 3072), a random weight,
``--rows`` input rows with outlier channels (default: what a 2 MiB calibration reservoir holds -
68 rows of 15360) and act-order, one ``gptq.gptq`` pass at the default damping with fp8's and
int8's (plain and ConvRot) and nvfp4's column rounders, timed three ways:

- ``kernel s``: each full block of 128 columns one Triton kernel (``gptq_kernel``; a CUDA GPU);
- ``graph s``: the block's eager column loop replayed from a CUDA graph (``gptq._BlockGraph``;
  only rounders with one scale per tensor or row);
- ``eager s``: the eager loop, a few small kernels per column.

``differ``: the fraction of rounded weights where the kernel's result is not the eager loop's,
and ``rel diff`` the relative norm of the difference (on a rounding boundary the two may round
apart: the eager update's cuBLAS product sums in its own order).  Prints a markdown table
and writes ``gptq_cost.json``.
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
from comfy_modelopt import gptq, gptq_kernel  # noqa: E402
from comfy_modelopt.formats import get_format  # noqa: E402

SHAPES = [(3072, 15360), (21504, 3072), (3072, 12288), (3072, 3072)]
REDUCED = [(64, 512), (384, 128)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


ROUNDERS = {"fp8": ("float8_e4m3fn", {}), "int8": ("int8_tensorwise", {"convrot": False}),
            "int8 convrot": ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 64}), "nvfp4": ("nvfp4", {})}


def one_shape(n: int, k: int, rows: int, device, rounder: str) -> dict:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device)
    x = torch.randn(rows, k, generator=g)
    x[:, :: max(1, k // 16)] *= 20.0  # channel outliers, as diffusion activations have
    name, opts = ROUNDERS[rounder]
    fmt = get_format(name)
    ws, xs = fmt.search_space(w, **opts), fmt.search_space(x.to(device), **opts)
    quant, _scale = fmt.gptq_rounding(ws, None, **opts)
    h = gptq.gram(xs)

    def one_pass():
        return gptq.gptq(ws, h, quant, act_order=True, damp=gptq.DAMPING)
    one_pass()  # warm-up: solver handles, the kernel's compilation, a graph's first capture
    fused, t_fused = timed(device, one_pass)
    gptq_kernel.ENABLED = False
    try:
        one_pass()
        graph, t_graph = timed(device, one_pass)
        gptq._BlockGraph.ENABLED = False
        eager, t_eager = timed(device, one_pass)
    finally:
        gptq_kernel.ENABLED, gptq._BlockGraph.ENABLED = True, True
    graphed = device.type == "cuda" and getattr(quant, "index_free", False)
    return {"shape": f"{n}x{k}", "rows": rows, "rounder": rounder,
            "kernel_s": round(t_fused, 3) if gptq_kernel.usable(ws, quant) and gptq.kernel_trusted(ws.device, quant)
            else None,
            "graph_s": round(t_graph, 3) if graphed else None, "eager_s": round(t_eager, 3),
            "differ": round(float((fused != eager).float().mean()), 6),
            "rel_diff": round(float((fused - eager).norm() / eager.norm()), 6)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=0, help="input rows (default: a 2 MiB bf16 reservoir's)")
    ap.add_argument("--reduced", action="store_true", help="small shapes (smoke run, not a measurement)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    rows_out = []
    for n, k in (REDUCED if a.reduced else SHAPES):
        rows = a.rows or max(16, (2 << 20) // (2 * k))
        for rounder in ROUNDERS:
            r = one_shape(n, k, rows, device, rounder)
            rows_out.append(r)
            print(json.dumps(r), flush=True)
    env = {"torch": torch.__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    tables.print_markdown([("shape (out x in)", "shape"), ("rows", "rows"), ("rounder", "rounder"),
                           ("kernel s", "kernel_s"), ("graph s", "graph_s"), ("eager s", "eager_s"),
                           ("differ", "differ"), ("rel diff", "rel_diff")], rows_out)
    tables.write_json(os.path.join(a.out, "gptq_cost.json"), {"env": env, "rows": rows_out})
    return rows_out


if __name__ == "__main__":
    main()

"""What GPTQ's rounding costs per layer, and where: one call per damping vs ``gptq_dampings``.

    python benchmarks/gptq_cost.py --device cuda --out DIR
    python benchmarks/gptq_cost.py --reduced --out DIR        # small shapes, CPU smoke run

For Flux.1-dev's Linear shapes (out x in: the single blocks' down projection 3072 x 15360 and
up projection 21504 x 3072, the MLP's 3072 x 12288), a random weight and ``--rows`` input rows
(the calibration reservoir of a 2 MiB budget holds 68 rows of 15360), fp8's column rounder:

- ``hinv batched`` / ``hinv each``: the inverse-Hessian factor of three dampings as one batched
  Cholesky, or one call per Hessian (what ``_gptq_batch`` does);
- ``3 x gptq``: three calls of ``gptq`` (one damping each); ``gptq_dampings``: the three in one
  column loop.  The rounded weights are compared (equal on a CPU; on a GPU cuBLAS may pick
  another kernel for another batch size);
- ``eager loop s``: ``gptq_dampings`` with the block loop run eagerly instead of replayed from a
  CUDA graph (``gptq._BlockGraph``; a GPU only), and whether both rounded the same (``graph equal``).

Prints a markdown table and writes ``gptq_cost.json``.
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
from comfy_modelopt import gptq  # noqa: E402

SHAPES = [(3072, 15360), (21504, 3072), (3072, 12288)]
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


def one_shape(n: int, k: int, rows: int, device, act_order: bool) -> dict:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device)
    x = torch.randn(rows, k, generator=g)
    x[:, :: max(1, k // 16)] *= 20.0  # channel outliers, as diffusion activations have
    x = x.to(device)
    quant = gptq.fp8_column_quantizer(float(w.abs().max()) / 448.0, torch.float8_e4m3fn)
    h = gptq.gram(x)
    hs = [gptq.damped(h, d) for d in gptq.DAMPINGS]
    gptq._upper_inverse_factor(hs[0])  # warm-up: solver handles, kernels
    _, batched = timed(device, lambda: torch.linalg.cholesky(
        torch.cholesky_inverse(torch.linalg.cholesky(torch.stack(hs))), upper=True))
    _, each = timed(device, lambda: [gptq._upper_inverse_factor(m) for m in hs])
    singles, t_single = timed(device, lambda: [gptq.gptq(w, h, quant, act_order=act_order, damp=d)
                                                for d in gptq.DAMPINGS])
    together, t_together = timed(device, lambda: gptq.gptq_dampings(w, h, gptq.DAMPINGS, quant,
                                                                   act_order=act_order))
    gptq._BlockGraph.ENABLED = False
    eager, t_eager = timed(device, lambda: gptq.gptq_dampings(w, h, gptq.DAMPINGS, quant, act_order=act_order))
    gptq._BlockGraph.ENABLED = True
    return {"shape": f"{n}x{k}", "rows": rows, "act_order": act_order,
            "eager_loop_s": round(t_eager, 3), "graph_equal": all(torch.equal(a, b) for a, b in zip(eager, together)),
            "hinv_batched_s": round(batched, 3), "hinv_each_s": round(each, 3),
            "three_gptq_s": round(t_single, 3), "gptq_dampings_s": round(t_together, 3),
            "speedup": round(t_single / t_together, 2),
            "equal": all(torch.equal(a, b) for a, b in zip(singles, together))}


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
        for act_order in (False, True):
            r = one_shape(n, k, rows, device, act_order)
            rows_out.append(r)
            print(json.dumps(r), flush=True)
    env = {"torch": torch.__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "date": time.strftime("%Y-%m-%d %H:%M")}
    for r in rows_out:
        r["speed_up"] = f"{r['speedup']}x"
    tables.print_markdown([("shape (out x in)", "shape"), ("rows", "rows"), ("act-order", "act_order"),
                           ("hinv batched s", "hinv_batched_s"), ("hinv each s", "hinv_each_s"),
                           ("3 x gptq s", "three_gptq_s"), ("gptq_dampings s", "gptq_dampings_s"),
                           ("speed-up", "speed_up"), ("equal", "equal"), ("eager loop s", "eager_loop_s"),
                           ("graph equal", "graph_equal")], rows_out)
    tables.write_json(os.path.join(a.out, "gptq_cost.json"), {"env": env, "rows": rows_out})
    return rows_out


if __name__ == "__main__":
    main()

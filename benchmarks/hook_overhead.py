"""Cost of the calibration hooks per model evaluation: apply_model timed with and without the
statistics hooks on every Linear input (same inputs, same GPU, one run), the statistics computed
eagerly and replayed from CUDA graphs (the default).

    python benchmarks/hook_overhead.py --out DIR [--reduced]
    python benchmarks/hook_overhead.py --out DIR --ops   # what one statistics update costs, per step
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import DEVICE, torch  # noqa: E402

from comfy_modelopt.calibrate import CalibrationOptions, calibrate  # noqa: E402
import architectures  # noqa: E402

FULL = {"flux": ("flux", "full", 1, 1024, 512, torch.bfloat16, "flux"),
        "sdxl": ("sdxl", "full", 2, 1024, 77, torch.float16, "sdxl")}
REDUCED = {"flux": ("flux", "small", 1, 64, 16, torch.bfloat16, "flux_small")}


OP_SHAPES = {"flux qkv input": (4608, 3072, torch.bfloat16), "flux mlp.2 input": (4608, 12288, torch.bfloat16),
             "sdxl attn input": (8192, 640, torch.float16)}


def ops(results: dict) -> None:
    """Milliseconds per step of LayerStats.update on activations of real shapes."""
    from comfy_modelopt import stats as S
    for label, (m, k, dtype) in OP_SHAPES.items():
        g = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(m, k, generator=g, device=DEVICE, dtype=dtype)
        ls = S.LayerStats(k, S.rows_for_budget(k, CalibrationOptions().reservoir_bytes))
        ls.update(x)
        ls.rows = 100 * m  # mid-calibration (100 evaluations seen): how often rows replace a slot then
        a = x.abs()

        def sample():  # as update() does: the next rows, never the same ones again
            ls._sample(x)
            ls.rows += m
        idx = S._hist_index(x)
        graphs = S.UpdateGraphs()
        steps = {
            "update (all)": lambda: ls.update(x),
            "update, partials replayed from a CUDA graph": lambda: ls.update(x, graphs),
            "abs": lambda: x.abs(),
            "histogram index": lambda: S._hist_index(x),
            "histogram counts": lambda: S._bincount(idx),
            "channel amax": lambda: a.amax(dim=0),
            "channel sum (fp64)": lambda: a.sum(dim=0, dtype=torch.float64),
            "reservoir sample": sample,
        }
        row = {"activation": label, "shape": [m, k], "dtype": str(dtype)}
        with torch.inference_mode():
            for name, fn in steps.items():
                row[name] = round(common.time_ms(fn, warmup=2, iters=10)[0], 3)
        graphs.release()
        results["rows"].append(row)
        print(row, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--ops", action="store_true", help="time the steps of one statistics update")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    results = {"env": common.env_info(), "rows": []}
    if a.ops:
        ops(results)
        common.write_json(os.path.join(a.out, "hook_ops.json"), results)
        return
    for name, (family, size, batch, res, txt, dtype, inp) in (REDUCED if a.reduced else FULL).items():
        _, sd = architectures.build(family, size, dtype=dtype, weights_device=DEVICE)
        model = common.load_stock(sd)
        del sd
        x, sigma, kw = common.inputs(inp, batch, res, txt, dtype)
        with torch.inference_mode():
            plain, _ = common.time_ms(lambda: model.model.apply_model(x, sigma, **kw), warmup=2, iters=5)
            times = {}
            for graphs in (False, True):  # statistics eagerly / replayed from CUDA graphs
                def loop(_m, graphs=graphs):
                    t, _ = common.time_ms(lambda: model.model.apply_model(x, sigma, **kw), warmup=1, iters=5)
                    times[graphs] = t
                calibrate(model.model.diffusion_model, loop, CalibrationOptions(cuda_graphs=graphs))
        row = {"model": name, "plain_ms": round(plain, 1), "with_hooks_ms": round(times[True], 1),
               "overhead": round(times[True] / plain, 3), "with_hooks_no_graphs_ms": round(times[False], 1),
               "overhead_no_graphs": round(times[False] / plain, 3)}
        results["rows"].append(row)
        print(row, flush=True)
        common.free(model)
    common.write_json(os.path.join(a.out, "hook_overhead.json"), results)


if __name__ == "__main__":
    main()

"""Cost of the calibration hooks per model evaluation: apply_model timed with and without the
statistics hooks on every Linear input (same inputs, same GPU, one run).

    python benchmarks/hook_overhead.py --out DIR [--reduced]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import DEVICE, torch  # noqa: E402

from comfy_modelopt.calibrate import CalibrationOptions, calibrate  # noqa: E402
from comfy_modelopt.comfyui import architectures  # noqa: E402

FULL = {"flux": ("flux", "full", 1, 1024, 512, torch.bfloat16, "flux"),
        "sdxl": ("sdxl", "full", 2, 1024, 77, torch.float16, "sdxl")}
REDUCED = {"flux": ("flux", "small", 1, 64, 16, torch.bfloat16, "flux_small")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reduced", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    results = {"env": common.env_info(), "rows": []}
    for name, (family, size, batch, res, txt, dtype, inp) in (REDUCED if a.reduced else FULL).items():
        _, sd = architectures.build(family, size, dtype=dtype, weights_device=DEVICE)
        model = common.load_stock(sd)
        del sd
        x, sigma, kw = common.inputs(inp, batch, res, txt, dtype)
        with torch.inference_mode():
            plain, _ = common.time_ms(lambda: model.model.apply_model(x, sigma, **kw), warmup=2, iters=5)
            times = []

            def loop(_m):
                t, _ = common.time_ms(lambda: model.model.apply_model(x, sigma, **kw), warmup=1, iters=5)
                times.append(t)
            calibrate(model.model.diffusion_model, loop, CalibrationOptions())
        row = {"model": name, "plain_ms": round(plain, 1), "with_hooks_ms": round(times[0], 1),
               "overhead": round(times[0] / plain, 3)}
        results["rows"].append(row)
        print(row, flush=True)
        common.free(model)
    common.write_json(os.path.join(a.out, "hook_overhead.json"), results)


if __name__ == "__main__":
    main()

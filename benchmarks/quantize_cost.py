"""Quantization cost of the CLI: wall time and peak resident memory per format.

    python benchmarks/quantize_cost.py --workdir /big/disk            # full Flux.1-dev shape (~24 GB bf16)
    python benchmarks/quantize_cost.py --reduced --workdir /tmp/x     # small, for CI (not timed)

Builds a Flux.1-dev-shaped bf16 checkpoint with deterministic random weights (once; reused when it
exists), then runs ``comfy-modelopt quantize`` for each format in a fresh process and reads that
process's peak RSS from the kernel (wait4 rusage).  Prints a markdown table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

FORMATS = ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4", "convrot_w4a4"]


def run_one(src: str, out: str, fmt: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "comfy_modelopt.cli", "quantize", src, "-o", out, "--format", fmt,
           "--overwrite", "-q", "--report", out + ".json"] + extra
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stderr = proc.stderr.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{fmt}: exit {code}\n{stderr}")
    report = json.load(open(out + ".json"))
    row = {"format": fmt, "seconds": wall,
           "peak_rss_gib": usage.ru_maxrss / 2**20, "out_bytes": os.path.getsize(out),
           "bytes_16bit": report["bytes_16bit"],
           "quantized_layers": sum(1 for l in report["layers"].values() if l["format"] == fmt),
           "mean_rel_err": _mean([l["rel_err"] for l in report["layers"].values() if l["format"] == fmt])}
    os.remove(out)
    os.remove(out + ".json")
    return row


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="folder for the source and output files")
    ap.add_argument("--reduced", action="store_true", help="small model (CI smoke run; not a measurement)")
    ap.add_argument("--formats", nargs="*", default=FORMATS)
    ap.add_argument("--weight-scale", default="mse", choices=["mse", "absmax"])
    ap.add_argument("--json", default=None, help="result file (default: WORKDIR/quantize_cost.json)")
    a = ap.parse_args(argv)
    from comfy_modelopt.synthetic import flux_layout, write_checkpoint
    os.makedirs(a.workdir, exist_ok=True)
    if a.reduced:
        layout = flux_layout(hidden=256, depth=2, depth_single=2, context_in=256, vec_in=256)
        src = os.path.join(a.workdir, "flux-reduced-bf16.safetensors")
    else:
        layout = flux_layout()
        src = os.path.join(a.workdir, "flux-dev-shape-bf16.safetensors")
    if not os.path.exists(src):
        t0 = time.perf_counter()
        write_checkpoint(src, layout, seed=0)
        print(f"wrote {src} ({os.path.getsize(src) / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f}s",
              flush=True)
    params = sum(__import__("math").prod(s) for s in layout.values())
    rows = []
    for fmt in a.formats:
        rows.append(run_one(src, os.path.join(a.workdir, f"out-{fmt}.safetensors"), fmt,
                            ["--weight-scale", a.weight_scale]))
        r = rows[-1]
        print(f"{r['format']}: {r['seconds']:.0f}s, peak RSS {r['peak_rss_gib']:.2f} GiB", flush=True)
    import torch

    import comfy_kitchen
    env = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__,
           "comfy_kitchen": getattr(comfy_kitchen, "__version__", "?"), "params": params,
           "source_bytes": os.path.getsize(src), "reduced": a.reduced, "weight_scale": a.weight_scale}
    print(f"\nFlux.1-dev shape ({params / 1e9:.2f} B params, source {env['source_bytes'] / 2**30:.2f} GiB bf16), "
          f"{env['cpus']} CPUs, torch {env['torch']}, weight scale {a.weight_scale}\n")
    print("| format | wall time | peak RSS | output | vs bf16 | mean rel. weight error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['seconds']:.0f} s | {r['peak_rss_gib']:.2f} GiB | "
              f"{r['out_bytes'] / 2**30:.2f} GiB | {r['out_bytes'] / env['source_bytes']:.3f} | "
              f"{r['mean_rel_err']:.4f} |")
    path = a.json or os.path.join(a.workdir, "quantize_cost.json")
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()

"""What quantizing costs, four ways (one mode per run; each prints a markdown table and writes JSON):

    python benchmarks/cost.py [sampling] --out DIR [--reduced]      # calibrate + quantize in one process
    python benchmarks/cost.py cli --workdir DIR [--reduced]         # the CLI, a fresh process per format
    python benchmarks/cost.py gptq --out DIR [--device cuda] [--reduced]   # one GPTQ pass per layer shape
    COMFYUI_PATH=... python benchmarks/cost.py verify --out DIR     # verifying a file next to loading it

``sampling`` (ComfyUI): calibrate 16 prompts x 20 steps through ComfyUI's own sampler and quantize
full-size Flux-dev and SDXL (random weights; prompts are random text conditioning of the real shapes)
to fp8 W8A8 and to nvfp4 with AWQ: wall time, peak GPU memory and the process's peak RSS per phase
(``--reduced``: small models on the CPU, not a measurement).

``cli``: a Flux.1-dev-shaped bf16 checkpoint with deterministic random weights (written once, reused),
then ``comfy-modelopt quantize`` per format in a fresh process, its peak RSS read from the kernel
(wait4 rusage): wall time, peak RSS, output size, mean weight error.

``gptq``: Flux.1-dev's Linear shapes (3072 x 15360, 21504 x 3072, 3072 x 12288, 3072 x 3072), a
random weight, ``--rows`` input rows with outlier channels (default: a 2 MiB reservoir's) and
act-order, one ``gptq.gptq`` pass with fp8's, int8's (plain and ConvRot) and nvfp4's column rounders,
timed three ways: ``kernel s`` (each block of 128 columns one Triton kernel, ``gptq_kernel``; CUDA),
``graph s`` (the block's eager loop replayed from a CUDA graph; rounders with one scale per tensor or
row), ``eager s`` (a few small kernels per column).  ``differ``/``rel diff``: where the kernel's
rounding is not the eager loop's (on a rounding boundary the two may round apart).

``verify`` (ComfyUI): a full-size Flux.1-dev fp8 file, loaded the stock way and through Load
Quantized Model's path in one process, alternating (neither gets a warmer page cache); best of
``--repeats`` seconds for the stock load call, that plus reading every weight once, our read,
verify (every layer's contract and value), deep (plus every fp8 weight's NaN codes), our build and
``inspect --verify``.  ``--cold`` drops the page cache before each load (root).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import tables  # noqa: E402


def _parser(mode: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"cost.py {mode}", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """(``fn()``, its wall time in seconds, the GPU's work included)."""
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def env_info() -> dict:
    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------- sampling: calibrate + quantize in ComfyUI
SAMPLING_FULL = {"flux": dict(family="flux", size="full", res=1024, txt=512, dtype=torch.bfloat16, cfg=1.0),
                 "sdxl": dict(family="sdxl", size="full", res=1024, txt=77, dtype=torch.float16, cfg=5.0)}
SAMPLING_REDUCED = {"flux": dict(family="flux", size="small", res=64, txt=16, dtype=torch.bfloat16, cfg=1.0),
                    "sd15": dict(family="sd15", size="small", res=64, txt=77, dtype=torch.float16, cfg=5.0)}


def phase(label, fn, rows):
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out, seconds = timed(fn)
    row = {"phase": label, "seconds": round(seconds, 1),
           "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
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


def sampling_model(name, spec, prompts, steps, results, out_path):
    import architectures
    import comfy.sample
    import common
    from comfy_modelopt.calibrate import CalibrationOptions, calibrate
    from comfy_modelopt.recipe import Recipe
    print(f"\n== {name}", flush=True)
    rows = results.setdefault(name, {"spec": {k: str(v) for k, v in spec.items()}, "rows": []})["rows"]
    sd = phase("build random weights", lambda: architectures.build(
        spec["family"], spec["size"], dtype=spec["dtype"], weights_device=common.DEVICE)[1], rows)
    model = phase("load (stock)", lambda: common.load_stock(sd), rows)
    latent = comfy.sample.fix_empty_latent_channels(model, torch.zeros(1, 4, spec["res"] // 8, spec["res"] // 8))
    conds, negative = conditioning(spec, prompts, 0), conditioning(spec, 1, 99)[0]

    def loop(_m):
        for i, c in enumerate(conds):
            comfy.sample.sample(model, comfy.sample.prepare_noise(latent, i), steps, spec["cfg"], "euler", "simple", c,
                                negative, latent, seed=i, disable_pbar=True)
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
        tables.write_json(out_path, results)


def sampling(argv):
    ap = _parser("sampling")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reduced", action="store_true")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    import common
    specs = SAMPLING_REDUCED if a.reduced else SAMPLING_FULL
    out_path = os.path.join(a.out, "cost.json")
    results = {"env": common.env_info(), "reduced": a.reduced, "prompts": a.prompts, "steps": a.steps}
    for name in a.models or list(specs):
        sampling_model(name, specs[name], a.prompts, a.steps, results, out_path)
    tables.write_json(out_path, results)
    tables.print_markdown([("model", "model"), ("phase", "phase"), ("seconds", "seconds"),
                           ("peak GPU GiB", "peak_gpu_gib"), ("peak RSS GiB", "peak_rss_gib")],
                          [dict(r, model=name) for name, block in results.items()
                           if isinstance(block, dict) and "rows" in block for r in block["rows"]])
    return results


# ---------------------------------------------------------------- cli: the command line per format
CLI_FORMATS = ["float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4", "convrot_w4a4"]


def cli_one(src: str, out: str, fmt: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "comfy_modelopt.cli", "quantize", src, "-o", out, "--format", fmt,
           "--overwrite", "-q", "--report", out + ".json"] + extra
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{fmt}: exit {code}\n{proc.stderr.read()}")
    report = json.load(open(out + ".json"))
    errs = [l["rel_err"] for l in report["layers"].values() if l["format"] == fmt]
    row = {"format": fmt, "seconds": round(wall), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
           "out_gib": round(os.path.getsize(out) / 2**30, 2), "vs_bf16": round(os.path.getsize(out) / os.path.getsize(src), 3),
           "bytes_16bit": report["bytes_16bit"], "quantized_layers": len(errs),
           "mean_rel_err": round(sum(errs) / len(errs), 4) if errs else 0.0}
    os.remove(out)
    os.remove(out + ".json")
    return row


def cli(argv):
    ap = _parser("cli")
    ap.add_argument("--workdir", required=True, help="folder for the source and output files")
    ap.add_argument("--reduced", action="store_true", help="small model (CI smoke run; not a measurement)")
    ap.add_argument("--formats", nargs="*", default=CLI_FORMATS)
    ap.add_argument("--weight-scale", default="mse", choices=["mse", "absmax"])
    ap.add_argument("--json", default=None, help="result file (default: WORKDIR/quantize_cost.json)")
    a = ap.parse_args(argv)
    from comfy_modelopt.synthetic import flux_layout, write_checkpoint
    os.makedirs(a.workdir, exist_ok=True)
    layout = flux_layout(hidden=256, depth=2, depth_single=2, context_in=256, vec_in=256) if a.reduced else flux_layout()
    src = os.path.join(a.workdir, "flux-reduced-bf16.safetensors" if a.reduced else "flux-dev-shape-bf16.safetensors")
    if not os.path.exists(src):
        _, seconds = timed(lambda: write_checkpoint(src, layout, seed=0))
        print(f"wrote {src} ({os.path.getsize(src) / 2**30:.2f} GiB) in {seconds:.0f}s", flush=True)
    rows = []
    for fmt in a.formats:
        rows.append(cli_one(src, os.path.join(a.workdir, f"out-{fmt}.safetensors"), fmt, ["--weight-scale", a.weight_scale]))
        print(f"{fmt}: {rows[-1]['seconds']}s, peak RSS {rows[-1]['peak_rss_gib']} GiB", flush=True)
    env = dict(env_info(), params=sum(math.prod(s) for s in layout.values()), source_bytes=os.path.getsize(src),
               reduced=a.reduced, weight_scale=a.weight_scale)
    tables.print_markdown([("format", "format"), ("wall s", "seconds"), ("peak RSS GiB", "peak_rss_gib"),
                           ("output GiB", "out_gib"), ("vs bf16", "vs_bf16"), ("mean rel. weight error", "mean_rel_err")],
                          rows)
    tables.write_json(a.json or os.path.join(a.workdir, "quantize_cost.json"), {"env": env, "rows": rows})
    return rows


# ---------------------------------------------------------------- gptq: one pass per layer shape
GPTQ_SHAPES = [(3072, 15360), (21504, 3072), (3072, 12288), (3072, 3072)]
GPTQ_REDUCED = [(64, 512), (384, 128)]
ROUNDERS = {"fp8": ("float8_e4m3fn", {}), "int8": ("int8_tensorwise", {"convrot": False}),
            "int8 convrot": ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 64}), "nvfp4": ("nvfp4", {})}


def gptq_shape(n: int, k: int, rows: int, device, rounder: str) -> dict:
    from comfy_modelopt import gptq, gptq_kernel
    from comfy_modelopt.formats import get_format
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
    fused, t_fused = timed(one_pass)
    with mock.patch.object(gptq_kernel, "usable", lambda *_a: False):  # the loops the kernel replaces
        one_pass()
        _graph, t_graph = timed(one_pass)
        with mock.patch.object(gptq._BlockGraph, "make", classmethod(lambda *_a: None)):
            eager, t_eager = timed(one_pass)
    graphed = device.type == "cuda" and getattr(quant, "index_free", False)
    kernel = gptq_kernel.usable(ws, quant) and gptq.kernel_trusted(ws.device, quant)
    return {"shape": f"{n}x{k}", "rows": rows, "rounder": rounder, "kernel_s": round(t_fused, 3) if kernel else None,
            "graph_s": round(t_graph, 3) if graphed else None, "eager_s": round(t_eager, 3),
            "differ": round(float((fused != eager).float().mean()), 6),
            "rel_diff": round(float((fused - eager).norm() / eager.norm()), 6)}


def gptq_cost(argv):
    ap = _parser("gptq")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=0, help="input rows (default: a 2 MiB bf16 reservoir's)")
    ap.add_argument("--reduced", action="store_true", help="small shapes (smoke run, not a measurement)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    rows_out = []
    for n, k in (GPTQ_REDUCED if a.reduced else GPTQ_SHAPES):
        for rounder in ROUNDERS:
            rows_out.append(gptq_shape(n, k, a.rows or max(16, (2 << 20) // (2 * k)), device, rounder))
            print(json.dumps(rows_out[-1]), flush=True)
    tables.print_markdown([("shape (out x in)", "shape"), ("rows", "rows"), ("rounder", "rounder"),
                           ("kernel s", "kernel_s"), ("graph s", "graph_s"), ("eager s", "eager_s"),
                           ("differ", "differ"), ("rel diff", "rel_diff")], rows_out)
    tables.write_json(os.path.join(a.out, "gptq_cost.json"), {"env": dict(env_info(), device=str(device)),
                                                              "rows": rows_out})
    return rows_out


# ---------------------------------------------------------------- verify: verifying next to loading
def write_fp8(path: str, layout: dict, device: str) -> float:
    """The deterministic Flux weights in fp8 (absmax: what ``quantize --format float8_e4m3fn`` writes
    without statistics), straight into ``path``."""
    from comfy_modelopt.pipeline import DeviceSource, DictSource, FileSink, quantize
    from comfy_modelopt.recipe import Recipe
    from comfy_modelopt.safetensors_io import ST_DTYPES
    from comfy_modelopt.synthetic import tensor_for
    shapes = {k: (ST_DTYPES[torch.bfloat16], tuple(v)) for k, v in layout.items()}
    source = DictSource(shapes, lambda k: tensor_for(k, layout[k], 1, torch.bfloat16))
    if device != "cpu":
        source = DeviceSource(source, device)
    with torch.inference_mode():
        return timed(lambda: quantize(source, Recipe("float8_e4m3fn", weight_scale="absmax"), sink=FileSink(path),
                                      family="flux", refuse_unknown=False))[1]


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def verify_round(path: str, name: str, cold: bool) -> dict:
    import comfy.sd
    import comfy.utils
    from comfy_modelopt.checkpoint import inspect_file
    from comfy_modelopt.comfyui import ownloader

    def materialize(patcher):  # every stored weight read once
        for p in patcher.model.diffusion_model.parameters():
            t = getattr(p, "_qdata", p)
            torch.empty_like(t).copy_(t)
    row = {}
    if cold:
        drop_caches()
    stock, row["stock load"] = timed(lambda: comfy.sd.load_diffusion_model(path))
    row["stock load + read every weight"] = row["stock load"] + timed(lambda: materialize(stock))[1]
    stock = None
    if cold:
        drop_caches()
    (sd, meta), row["our read"] = timed(lambda: comfy.utils.load_torch_file(path, safe_load=True, return_metadata=True))
    checked, row["verify"] = timed(lambda: ownloader.verify_state_dict(sd, meta, name))
    row["verify deep"] = timed(lambda: ownloader.verify_state_dict(sd, meta, name, deep=True))[1]
    row["our build"] = timed(lambda: ownloader.load_state_dict(sd, meta, where=name))[1]
    row["inspect --verify"] = timed(lambda: inspect_file(path, verify_values=True))[1]
    row["layers"], row["values MiB"] = checked.layers, checked.bytes_read / 2**20
    return row


def verify_cost(argv):
    ap = _parser("verify")
    ap.add_argument("--out", required=True, help="folder for the fp8 file (reused when present)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=19, help="double blocks (Flux.1-dev: 19)")
    ap.add_argument("--depth-single", type=int, default=38, help="single blocks (Flux.1-dev: 38)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the file is quantized")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    import architectures
    architectures.setup_comfy()
    from comfy_modelopt.synthetic import flux_layout
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"flux-fp8-{a.depth}-{a.depth_single}.safetensors")
    made = None
    if not os.path.exists(path):
        made = write_fp8(path, flux_layout(depth=a.depth, depth_single=a.depth_single), a.device)
        print(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB) in {made:.0f}s")
    rounds = [verify_round(path, os.path.basename(path), a.cold) for _ in range(a.repeats)]
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    load = best["stock load + read every weight"]
    best["verify / (load + read)"] = best["verify"] / load
    best["verify deep / (load + read)"] = best["verify deep"] / load
    best["verify / stock load call"] = best["verify"] / best["stock load"]
    tables.print_markdown([("step", "step"), (f"best of {a.repeats}", "value")],
                          [{"step": k, "value": f"{v:.3f}" if isinstance(v, float) else v} for k, v in best.items()])
    result = {"env": env_info(), "file": path, "file_gib": os.path.getsize(path) / 2**30, "cold": a.cold,
              "rounds": rounds, "best": best, "write_s": made}
    if a.json:
        tables.write_json(a.json, result)
    return result


MODES = {"sampling": sampling, "cli": cli, "gptq": gptq_cost, "verify": verify_cost}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    mode = argv.pop(0) if argv and argv[0] in MODES else "sampling"
    return MODES[mode](argv)


if __name__ == "__main__":
    main()

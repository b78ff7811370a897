#!/usr/bin/env python3
"""What users attach, on the 16-bit model and on Quantize Model's output, side by side in one process.

For one full-size model (random weights, ComfyUI's own classes): the 16-bit model, a calibration
on its sampling runs, Quantize Model with every input at its default (fp8, runtime auto); then for
each case of benchmarks/attachments.py - ControlNets in ComfyUI's layouts, the stock patch nodes,
an IP-Adapter-style replace, a diffusion-model wrapper, regional prompts, img2img, a hires-fix
pass, batch 2, another size - the same KSampler runs on both models with the case applied:
first and steady run, quantized / 16-bit speed, the final latent's distance between the two
(and without the case), the case's own effect on each model's latent, and how the quantized
model ran it (replayed from CUDA graphs, or eagerly and why).  Prints a table, writes JSON.

Usage (COMFYUI_PATH set, the project importable, a CUDA GPU):
  python benchmarks/compat.py --model sdxl|flux|sd15|sd15_inpaint|sd3|qwen_image --out DIR [--steps 20] [--runs 3] [--res 1024]
                              [--cases "controlnet,freeu_v2,..."] [--format float8_e4m3fn]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="sdxl", choices=("sd15", "sd15_inpaint", "sdxl", "flux", "sd3", "qwen_image"))
ap.add_argument("--out", default=os.environ.get("OUT", "compat_out"))
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--runs", type=int, default=3, help="runs per model and case (the first one shown apart)")
ap.add_argument("--res", type=int, default=0, help="image side (default: 512 for SD1.5, else 1024)")
ap.add_argument("--cases", default="", help="comma-separated case names (default: every case of the family)")
ap.add_argument("--format", default="float8_e4m3fn")
ap.add_argument("--calib-prompts", type=int, default=2)
ap.add_argument("--calib-steps", type=int, default=8)
ap.add_argument("--log-info", action="store_true")
ap.add_argument("--profile", default="", metavar="CASE",
                help="run the quantized model with this case once more under cProfile (profile_<case>.txt in --out)")
ap.add_argument("--cpu-tiny", action="store_true", help="the family's small config at 96 px: a CPU smoke run")
ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                help="the GIL switch interval while blocks compile in the background (default: the runtime's)")
ap.add_argument("--settle", type=float, default=0, metavar="S",
                help="after a case's first run, wait up to S seconds for blocks compiling in the background "
                     "(the steady runs then time the compiled blocks; the wait is reported, not timed)")
A = ap.parse_args()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if A.log_info:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(levelname)s %(message)s")
import torch  # noqa: E402

import architectures  # noqa: E402

architectures.setup_comfy()
import comfy.model_management as mm  # noqa: E402
import comfy.sd  # noqa: E402

import attachments as att  # noqa: E402
from comfy_modelopt.calibrate import CalibrationOptions, calibrate  # noqa: E402
from comfy_modelopt.comfyui import nodes as N  # noqa: E402
from comfy_modelopt.comfyui.runtime import graph_runner  # noqa: E402

CUDA = torch.cuda.is_available()
SIZE = "small" if A.cpu_tiny else "full"
if A.switch_interval is not None:
    from comfy_modelopt.comfyui import background_compile
    background_compile.SWITCH_INTERVAL = A.switch_interval
RES = {"args": vars(A), "rows": []}
if CUDA:
    RES["gpu"] = torch.cuda.get_device_name(0)
RES["torch"] = torch.__version__


def log(*a):
    print("[compat]", *a, flush=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def timed(s: att.Setup, settled: dict | None = None):
    times, out = [], None
    for i in range(A.runs):
        if i == 1 and A.settle and settled is not None:  # blocks compiling for the first run's shapes
            from comfy_modelopt.comfyui.background_compile import BACKGROUND
            t0 = time.perf_counter()
            while BACKGROUND.is_set() and time.perf_counter() - t0 < A.settle:
                time.sleep(0.1)
            settled["waited_s"] = round(time.perf_counter() - t0, 1)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = att.run(s)
        sync()
        times.append(time.perf_counter() - t0)
    return out.float().cpu(), times


def model_and_conditioning():
    res = A.res or (96 if A.cpu_tiny else 512 if A.model.startswith("sd15") else 1024)
    dtype = torch.float16 if A.model in ("sd15", "sd15_inpaint", "sdxl") else torch.bfloat16
    if not CUDA:
        dtype = torch.float32
    _, sd = architectures.build(A.model, SIZE, seed=0, dtype=dtype, weights_device="cuda" if CUDA else "cpu")
    sd = {k: v.cpu() for k, v in sd.items()}
    model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": dtype})
    g = torch.Generator().manual_seed(7)
    if A.model == "flux":
        ctx = torch.randn(1, 16, 256, generator=g) if A.cpu_tiny else torch.randn(1, 512, 4096, generator=g)
        pooled = torch.randn(1, 256 if A.cpu_tiny else 768, generator=g)
        extra = {"pooled_output": pooled, "guidance": 3.5}
        pos, neg, cfg = [[ctx, dict(extra)]], [[ctx * 0, dict(extra)]], 1.0
    elif A.model == "sdxl":
        ctx, pooled = torch.randn(1, 77, 2048, generator=g), torch.randn(1, 1280, generator=g)
        extra = {"pooled_output": pooled, "width": res, "height": res}
        pos, neg, cfg = [[ctx, dict(extra)]], [[ctx * 0, dict(extra)]], 7.0
    elif A.model == "sd3":  # SD3.5 Large's layout at full size
        ctx, pooled = torch.randn(1, 77 if A.cpu_tiny else 333, 4096, generator=g), torch.randn(1, 2048, generator=g)
        pos, neg, cfg = [[ctx, {"pooled_output": pooled}]], [[ctx * 0, {"pooled_output": pooled * 0}]], 4.5
    elif A.model == "qwen_image":  # Qwen2.5-VL's hidden states
        ctx = torch.randn(1, 12 if A.cpu_tiny else 128, 3584, generator=g)
        pos, neg, cfg = [[ctx, {}]], [[ctx * 0, {}]], 4.0
    else:
        ctx = torch.randn(1, 77, 768, generator=g)
        pos, neg, cfg = [[ctx, {}]], [[ctx * 0, {}]], 7.0
    latent = torch.zeros(1, 16 if A.model in ("flux", "sd3", "qwen_image") else 4, res // 8, res // 8)
    return sd, att.Setup(A.model, model, pos, neg, latent, cfg, steps=A.steps)


def runner_state(runner, controls=None):
    """Per graph runner (the model's - or, with ``controls``, the runtime's ControlGraphs, its
    ControlNets' runners): its counts, so that what a run did is the difference of two states."""
    if runner is None:
        return None
    runners = [runner] if controls is None else list(controls.runners.values())
    state = {id(r): (r.captures, r.replays, r.eager_calls, set(r.failed.values()) | set(r.warned)) for r in runners}
    if controls is not None:  # the runners of networks built for one run (a Control-LoRA's), gone with it
        state["dropped"] = (*controls.dropped[:3], set(controls.dropped[3]))
    return state


def how_it_ran(before, after) -> str:
    if after is None:
        return "no graph runtime"
    counts, new = [0, 0, 0], set()
    for key, (*now, said) in after.items():  # a runner made during the run counts from zero
        *then, said_then = before.get(key, (0, 0, 0, set()))
        counts = [c + n - t for c, n, t in zip(counts, now, then)]
        new |= said - said_then
    text = f"{counts[0]} captures, {counts[1]} replays, {counts[2]} eager"
    return text + (f" ({'; '.join(r[:160] for r in sorted(new))})" if new else "")


def quantized(s16: att.Setup, key: str):
    """Calibrate Model (``A.calib_prompts`` prompts of ``A.calib_steps`` steps) then Quantize Model
    with its defaults on ``s16``'s model (its time as ``RES[key]``): (the quantized MODEL, the report)."""
    mm.load_models_gpu([s16.model])
    calib = s16.replace(steps=A.calib_steps)
    t0 = time.perf_counter()
    stats = calibrate(s16.model.model.diffusion_model,
                      lambda _m: [att.run(calib.replace(seed=100 + i)) for i in range(A.calib_prompts)],
                      CalibrationOptions())
    log(f"calibration {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    with torch.inference_mode():
        q, report = N.ModelOptQuantizeUNet.execute(model=s16.model, format=A.format, calibration=stats).args[:2]
    RES[key] = round(time.perf_counter() - t0, 1)
    return q, report


def main():
    t0 = time.perf_counter()
    sd, s16 = model_and_conditioning()
    log(f"{A.model} built in {time.perf_counter() - t0:.1f} s")
    q, report = quantized(s16, "quantize_s")
    RES["runtime_note"] = next((line for line in report.splitlines() if line.startswith("runtime")), None)
    log(f"Quantize Model {RES['quantize_s']} s; {RES['runtime_note']}")
    sq = s16.replace(model=q)
    runner = graph_runner(q)
    controls = next(iter(q.get_wrappers("calc_cond_batch", "comfy_modelopt_cuda_graphs")), None)
    names = [n.strip() for n in A.cases.split(",") if n.strip()] or \
        ["plain"] + att.cases_for(A.model, full_size=not A.cpu_tiny) + ["merge", "refiner"] * (A.model != "flux")
    other = other_q = None
    base = {}
    for name in names:
        c16 = cq = None
        try:
            if name in ("merge", "refiner") and other is None:  # another 16-bit model of the same layout
                _, osd = architectures.build(A.model, SIZE, seed=5, dtype=s16.model.model.get_dtype(),
                                             weights_device="cuda" if CUDA else "cpu")
                other = comfy.sd.load_diffusion_model_state_dict({k: v.cpu() for k, v in osd.items()})
            if name == "merge":
                c16, cq = att.merge(s16, other), att.merge(sq, other)
            elif name == "refiner":  # base + refiner, both quantized: two quantized models in one workflow
                if other_q is None:
                    other_q = quantized(s16.replace(model=other), "refiner_quantize_s")[0]
                step = A.steps * 4 // 5
                c16, cq = s16.replace(refiner=(other, step)), sq.replace(refiner=(other_q, step))
            elif name == "plain":
                c16, cq = s16, sq
            else:
                c16, cq = att.apply(name, s16), att.apply(name, sq)
            out16, t16 = timed(c16)
            before, controls_before = runner_state(runner), runner_state(runner, controls)
            second = graph_runner(cq.refiner[0]) if cq.refiner is not None else None
            second_before = runner_state(second)
            settled = {}
            outq, tq = timed(cq, settled)
            if name == A.profile:
                profile(name, cq)
            row = {"case": name, "16bit_s": [round(t, 3) for t in t16], "quant_s": [round(t, 3) for t in tq],
                   "speed": round(min(t16[1:] or t16) / min(tq[1:] or tq), 3), "latent": round(rel(outq, out16), 5),
                   "ran": how_it_ran(before, runner_state(runner)), **settled}
            if runner is not None and runner.compiled is not None:  # compiled in the background so far
                row["compiled_later"] = runner.compiled.landed
            if second is not None:
                row["refiner_ran"] = how_it_ran(second_before, runner_state(second))
            nets_after = runner_state(runner, controls) if controls is not None else None
            if controls is not None and (controls.runners or nets_after["dropped"] != controls_before["dropped"]):
                row["controlnets_ran"] = how_it_ran(controls_before, nets_after)  # the ControlNets' own networks
            if name == "plain":
                base = {"16": out16, "q": outq}
            elif out16.shape == base["16"].shape and c16.second_pass is None and c16.denoise == 1.0:
                row["effect_16bit"], row["effect_quant"] = round(rel(out16, base["16"]), 5), round(rel(outq, base["q"]), 5)
        except Exception as e:  # a case that fails is a row saying so, not the end of the matrix
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        RES["rows"].append(row)
        log(json.dumps(row))
        save()
        del c16, cq
        gc.collect()
    print(table(), flush=True)


def profile(name: str, s: att.Setup) -> None:
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    with torch.inference_mode():
        prof.runcall(att.run, s)
    sync()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
    os.makedirs(A.out, exist_ok=True)
    with open(os.path.join(A.out, f"profile_{''.join(c if c.isalnum() else '_' for c in name)}.txt"), "w") as f:
        f.write(text.getvalue())


def table() -> str:
    plain = next((r["latent"] for r in RES["rows"] if r["case"] == "plain" and "latent" in r), None)
    head = ("case", "16-bit first / steady", "quantized first / steady", "vs 16-bit", "latent vs 16-bit",
            "effect 16-bit / quantized", "quantized model ran it")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in RES["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error'][:120]} | | | | | |")
            continue
        first = lambda t: f"{t[0]:.2f} / {min(t[1:] or t):.3f} s"  # noqa: E731
        effect = f"{r['effect_16bit']:.4f} / {r['effect_quant']:.4f}" if "effect_16bit" in r else "-"
        lat = f"{r['latent']:.4f}" + (f" ({r['latent'] / plain:.2f}x plain)" if plain else "")
        lines.append(f"| {r['case']} | {first(r['16bit_s'])} | {first(r['quant_s'])} | {r['speed']:.2f}x | {lat} | "
                     f"{effect} | {r['ran']}" + (f"; ControlNets: {r['controlnets_ran']}" if "controlnets_ran" in r else "")
                     + (f"; refiner: {r['refiner_ran']}" if "refiner_ran" in r else "")
                     + " |")
    return "\n".join(lines)


def save():
    os.makedirs(A.out, exist_ok=True)
    with open(os.path.join(A.out, f"compat_{A.model}.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Whole sampling runs - what a user sees - for a 16-bit model and its fp8 W8A8 file under every
runtime the nodes offer.

``python benchmarks/sampling_check.py --out DIR [--model sdxl|flux|wan|wan81|wan14b] [--steps N] [--runs N]``
builds the full-size model (random weights with channel outliers, ComfyUI's own classes),
quantizes it to fp8 W8A8 with static input scales, and samples the same noise/conditioning
through ComfyUI's KSampler path (``comfy.sample.sample``, euler/simple; Flux cfg 1, SDXL cfg 7, Wan 2.1
1.3B cfg 5 at 17 frames of 512x512; ``wan81``: 81 frames of 832x480, the size it is made for; ``wan14b``: the 14B's width at 33
frames of 832x480)
``--runs`` times with:

- the 16-bit model in stock ComfyUI (the baseline), and the same model in the other 16-bit
  dtype (bf16 vs fp16: how far a change of rounding alone moves the final latent);
- the fp8 file in stock ComfyUI, and under each runtime of ``comfyui.runtime.RUNTIMES``
  (installed by ``apply_runtime``, as the nodes do);
- lean with each model input rounded once more (eager's own noise: the yardstick for compiled
  blocks).

Per variant: first run (includes capture, and with compiled blocks their compilation: run the
script twice with one ``TORCHINDUCTOR_CACHE_DIR`` for a warm compile cache), steady run (best of runs 2..n), ratio to the 16-bit steady run, peak VRAM, final-latent relative L2 against the 16-bit run,
and the graphs' captures/replays.  ``--runtimes`` picks variants; ``--reduced`` runs a small model
on a CPU (graphs then fall back to eager: a smoke run, not a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import architectures  # noqa: E402

architectures.setup_comfy()
import comfy.model_management  # noqa: E402
import comfy.sample  # noqa: E402

import common  # noqa: E402
from comfy_modelopt.comfyui.compiled_blocks import rounding_noise  # noqa: E402
from comfy_modelopt.comfyui.runtime import graph_runner  # noqa: E402
from comfy_modelopt.comfyui.lean import make_lean  # noqa: E402
from comfy_modelopt.comfyui.runtime import RUNTIMES, apply_runtime  # noqa: E402
from comfy_modelopt.graph_memory import AllocationTrace  # noqa: E402

EAGER_NOISE = "lean, input rounded once more per call (eager's own noise)"

SPECS = {"sdxl": dict(family="sdxl", size="full", res=1024, dtype=torch.float16),
         # Wan 2.1 1.3B text-to-video: 17 frames at 512x512 (5 latent frames, 5,120 tokens per step)
         "wan": dict(family="wan", size="full", res=512, frames=17, dtype=torch.bfloat16, txt=512),
         # ... at the size Wan 2.1 is made for: 81 frames of 832x480 (21 latent frames, 32,760 tokens per step)
         "wan81": dict(family="wan", size="full", res=(480, 832), frames=81, dtype=torch.bfloat16, txt=512),
         # Wan 2.1 14B's width at 33 frames of 832x480 (9 latent frames, 14,040 tokens per step)
         "wan14b": dict(family="wan", size="14b", res=(480, 832), frames=33, dtype=torch.bfloat16, txt=512),
         "flux": dict(family="flux", size="full", res=1024, dtype=torch.bfloat16, txt=512)}
# --reduced: the same families at ComfyUI's small configurations (CPU smoke runs)
REDUCED = {"sdxl": dict(family="sdxl", size="small", res=64, dtype=torch.float32),
           "wan": dict(family="wan", size="small", res=64, frames=5, dtype=torch.float32, txt=16),
           "wan81": dict(family="wan", size="small", res=(48, 80), frames=9, dtype=torch.float32, txt=16),
           "wan14b": dict(family="wan", size="small", res=(48, 80), frames=9, dtype=torch.float32, txt=16),
           "flux": dict(family="flux", size="small", res=64, dtype=torch.float32, txt=16, inputs="flux_small")}
POOLED = {"sdxl": 1280}  # SDXL's ADM vector = pooled CLIP-G output (1280) + 6 size embeddings (1536)


def conds(family: str, inputs: str, txt: int, dtype):
    x, _, kw = common.inputs(inputs, 1, 64, txt, dtype, frames=5)
    extra = {"pooled_output": kw["y"][:, :POOLED.get(family, kw["y"].shape[1])]} if "y" in kw else {}
    if family == "flux":
        extra["guidance"] = 3.5
    pos = [[kw["c_crossattn"], dict(extra)]]
    neg = [[torch.zeros_like(kw["c_crossattn"]), dict(extra)]]
    return pos, neg


STOCK_16BIT, OTHER_16BIT, STOCK_FP8 = "16-bit, stock ComfyUI", "other 16-bit dtype, stock", "fp8 file, stock ComfyUI"
# the variants that sample the calibrated fp8 file: stock ComfyUI, each of our runtimes, eager's own noise
FP8_VARIANTS = [STOCK_FP8] + [r for r in RUNTIMES if r != "stock"] + [EAGER_NOISE]
# --quality: files made with these recipes from one calibration (8 noise levels, statistics with
# sampled rows), sampled in stock ComfyUI: the final-latent difference a user sees per format
QUALITY_RECIPES = {
    "fp8 W8A8 (calibrated, mse)": dict(format="float8_e4m3fn"),
    "int8 + ConvRot": dict(format="int8_tensorwise", convrot=True),
    "nvfp4 (mse)": dict(format="nvfp4"),
    "nvfp4 + AWQ (exact folds)": dict(format="nvfp4", smoothing="awq"),
    "planner 0.35 (nvfp4 / fp8 / int8 + ConvRot)": dict(format="int8_tensorwise", convrot=True, budget=0.35),
}
QUALITY_SIGMAS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.12, 0.04)
CFG = {"flux": 1.0, "sdxl": 7.0, "wan": 5.0}


TRACE_PEAK = False  # --trace-peak


def _run_variant(label, q, runs, sample, ref, fp8_ref=None):
    """``runs`` whole sampling runs of patcher ``q``; one row."""
    runner = graph_runner(q)
    secs, out, peaks, captured = [], None, [], []
    for i in range(runs):
        if common.CUDA:
            torch.cuda.reset_peak_memory_stats()
        before = runner.captures if runner is not None else 0
        with torch.inference_mode():
            common.sync()
            t0 = time.perf_counter()
            out = sample(q)
            common.sync()
            secs.append(time.perf_counter() - t0)
        captured.append((runner.captures if runner is not None else 0) - before)
        if common.CUDA:
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
    peak_trace = None
    if TRACE_PEAK and common.CUDA:
        # one more run with the allocator's history and stacks on: what is live at its peak
        from allocations import live_at_peak
        with torch.inference_mode(), AllocationTrace(stacks=True) as trace:
            sample(q)
            common.sync()
        peak_trace = live_at_peak(trace.entries) if trace.entries is not None else None
    row = {"variant": label, "first_s": round(secs[0], 3), "steady_s": round(min(secs[1:] or secs), 3),
           "runs_s": [round(x, 3) for x in secs], "peak_vram_gib": round(max(peaks), 2) if peaks else None,
           "finite": bool(torch.isfinite(out).all())}
    if peaks:
        # the memory a user's steady runs need beyond the weights: the steady runs' peak (after
        # compilation and captures) over the model's own bytes (ComfyUI's model_size); resident =
        # what stays allocated between runs (weights, persistent graph pools, anything held)
        steady_peak = max(peaks[1:] or peaks)
        row["peak_runs_gib"] = [round(x, 3) for x in peaks]
        row["resident_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
        row["model_gib"] = round(q.model_size() / 2**30, 3)
        row["steady_peak_gib"] = round(steady_peak, 3)
        row["steady_over_resident_gib"] = round(steady_peak - row["resident_gib"], 3)
        row["steady_over_model_gib"] = round(steady_peak - row["model_gib"], 3)
        # the runs after the last capture (graphs replayed only): what every later run needs;
        # steady_peak above also holds run 2, which captures the compiled blocks once
        settled = [p for i, p in enumerate(peaks) if i and not captured[i]]
        row["captures_per_run"] = captured
        if settled:
            row["settled_over_model_gib"] = round(max(settled) - row["model_gib"], 3)
        # what the device has in use (any allocator backend: cudaMallocAsync, ComfyUI's default on
        # CUDA 13 torch, keeps graph memory outside torch's counters) and what ComfyUI thinks is free
        free, total = torch.cuda.mem_get_info()
        row["device_used_gib"] = round((total - free) / 2**30, 3)
        row["comfy_free_gib"] = round(comfy.model_management.get_free_memory() / 2**30, 3)
        row["allocator"] = torch.cuda.get_allocator_backend()
        if row["allocator"] == "native":  # where the memory between runs sits: which pool, in use or idle
            ours = tuple(runner.pool.handle) if runner is not None and runner.pool is not None and runner.pool.handle else None
            by_pool: dict = {}
            for seg in torch.cuda.memory_snapshot():
                pid = tuple(seg.get("segment_pool_id", (0, 0)))
                kind = "default" if pid == (0, 0) else "graph pool" if pid == ours else "other private pools"
                acc = by_pool.setdefault(kind, {"reserved": 0, "allocated": 0, "segments": 0})
                acc["reserved"] += seg["total_size"]
                acc["allocated"] += seg["allocated_size"]
                acc["segments"] += 1
            row["memory_by_pool_gib"] = {k: {"reserved": round(v["reserved"] / 2**30, 3),
                                             "allocated": round(v["allocated"] / 2**30, 3), "segments": v["segments"]}
                                         for k, v in by_pool.items()}
    if peak_trace is not None:  # the traced run's peak counts only what it allocated itself
        row["traced_run_peak"] = {"peak_gib": round(peak_trace["peak_bytes"] / 2**30, 3), "largest_live": [
            {"mib": round(a["bytes"] / 2**20, 1), "stream": a["stream"], "frames": a["frames"]}
            for a in peak_trace["allocations"]]}
    if ref is not None:
        row["rel_l2_vs_16bit"] = float((out - ref).norm() / ref.norm())
    if fp8_ref is not None:  # 0 where the runtime is bit-exact with stock ComfyUI
        row["rel_l2_vs_fp8_stock"] = float((out - fp8_ref).norm() / fp8_ref.norm())
    if runner is not None:
        row["graph"] = {"captures": runner.captures, "capture_s": list(runner.capture_seconds),
                        "replays": runner.replays, "eager": runner.eager_calls, "releases": runner.releases,
                        "persistent": runner.persistent, "eager_reasons": sorted(runner.warned)}
        if runner.pool is not None and runner.pool.handle is not None:  # the caching allocator's pool
            segments = runner.pool._segments()
            row["graph"]["pool_reserved_gib"] = round(sum(seg["total_size"] for seg in segments) / 2**30, 3)
            row["graph"]["pool_segments_mib"] = sorted((round(seg["total_size"] / 2**20, 1) for seg in segments),
                                                       reverse=True)
        # what each first capture asked of its pool (graph_memory): the peak in use at once, the
        # segments the allocator grew, the segments fitted, and the pool it was captured into
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        row["graph"]["pool_needs_mib"] = [{"compiled": compiled, "peak": mib(n.peak), "grown_simulated": mib(n.grown),
                                           "fitted": mib(n.fitted), "segments": [mib(b) for b in n.segments],
                                           "requests": n.requests}
                                          for (_sig, compiled), n in runner.pool_needs.items()]
        row["graph"]["pool_sizing_mib"] = [{k: v if k == "from_warm_up" else mib(v) for k, v in r.items()}
                                           for r in runner.pool_sizing]
        # the recorded large requests themselves, written beside the JSON (record): graph_memory's
        # placement can be replayed on them offline
        row["_pool_events"] = [{"compiled": compiled, "events": n.events} for (_sig, compiled), n in runner.pool_needs.items()]
        if runner.compiled is not None:
            row["compiled"] = {"enabled": runner.compiled.enabled, "reason": runner.compiled.reason,
                               "checks": runner.compiled.checks, "compile_s": list(runner.compile_seconds)}
            # Dynamo's own counts, for the whole process so far (graph breaks split a block into
            # stretches whose frames keep tensors alive: see comfyui/traced_layers.py)
            from torch._dynamo.utils import counters
            row["compiled"]["dynamo"] = {"graph_breaks": sum(counters["graph_break"].values()),
                                         "unique_graphs": counters["stats"]["unique_graphs"]}
    return row, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="sdxl", choices=list(SPECS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3, help="whole runs per variant (first + steady)")
    ap.add_argument("--runtimes", nargs="*", default=None,
                    help=f"variants to run (default all): {STOCK_16BIT!r}, {OTHER_16BIT!r}, {STOCK_FP8!r}, "
                         f"the runtimes {list(RUNTIMES)}, {EAGER_NOISE!r}")
    ap.add_argument("--profile", action="store_true",
                    help="after its runs, profile one more steady run of each variant (torch.profiler: where the "
                         "wall time of a whole run goes outside the model's kernels)")
    ap.add_argument("--reduced", action="store_true", help="the model at a small configuration (CPU smoke run)")
    ap.add_argument("--quality", action="store_true",
                    help="also sample files of QUALITY_RECIPES (calibrated on 8 noise levels) in stock ComfyUI: "
                         "final-latent difference vs 16-bit next to the other-dtype yardstick")
    ap.add_argument("--quality-recipes", nargs="*", default=None,
                    help=f"with --quality: only these of {list(QUALITY_RECIPES)}")
    ap.add_argument("--trace-peak", action="store_true",
                    help="after its runs, one more run of each variant with the allocator's history on: the "
                         "largest allocations live at that run's peak, with where they were made (slower)")
    ap.add_argument("--trace-held", action="store_true",
                    help="record every allocation's Python stack from before each fp8 variant loads (slow): what "
                         "stays allocated between its runs beyond the model's weights, largest first, with where it "
                         "was made; the runtime's graph-pool sizing, which records the allocator itself, is off then")
    a = ap.parse_args(argv)
    global TRACE_PEAK
    TRACE_PEAK = a.trace_peak
    unknown = set(a.quality_recipes or ()) - set(QUALITY_RECIPES)
    if unknown:
        ap.error(f"unknown --quality-recipes {sorted(unknown)}; choose from {list(QUALITY_RECIPES)}")
    spec = (REDUCED if a.reduced else SPECS)[a.model]
    wanted = a.runtimes or [STOCK_16BIT, OTHER_16BIT] + FP8_VARIANTS
    later = [v for v in FP8_VARIANTS if v in wanted]
    os.makedirs(a.out, exist_ok=True)
    _, sd = architectures.build(spec["family"], spec["size"], seed=0, dtype=spec["dtype"], weights_device=common.DEVICE)
    fam = spec["family"]
    inputs = spec.get("inputs", fam)
    pos, neg = conds(fam, inputs, spec.get("txt", 77), spec["dtype"])
    latent_c = 16 if fam in ("flux", "wan") else 4
    frames = (spec["frames"] - 1) // 4 + 1 if "frames" in spec else None  # the video VAE's 4x time stride
    height, width = (spec["res"], spec["res"]) if isinstance(spec["res"], int) else spec["res"]
    latent = torch.zeros(1, latent_c, *((frames,) if frames else ()), height // 8, width // 8)
    noise = comfy.sample.prepare_noise(latent, 0)
    cfg = CFG[fam]

    def sample(q):
        return comfy.sample.sample(q, noise, a.steps, cfg, "euler", "simple", pos, neg, latent, seed=0,
                                   disable_pbar=True).float()
    results = {"env": common.env_info(), "model": a.model + (" (reduced)" if a.reduced else ""), "steps": a.steps,
               "cfg": cfg, "runs": a.runs, "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
               "rows": []}

    def record(row):
        events = row.pop("_pool_events", None)
        if events:
            slug = "".join(ch if ch.isalnum() else "_" for ch in row["variant"])
            common.write_json(os.path.join(a.out, f"pool_events_{a.model}_{slug}.json"), events)
        results["rows"].append(row)
        base = next((r for r in results["rows"] if r["variant"] == STOCK_16BIT), None)
        if base is not None:
            row["steady_speedup_vs_16bit"] = round(base["steady_s"] / row["steady_s"], 3)
            if row is not base and base.get("steady_over_resident_gib"):
                # the peak-VRAM target: steady peak <= model + 1.25x the 16-bit forward's activation peak
                row["over_model_vs_16bit_activation"] = round(row["steady_over_model_gib"] /
                                                              base["steady_over_resident_gib"], 3)
                if "settled_over_model_gib" in row:
                    row["settled_over_model_vs_16bit_activation"] = round(
                        row["settled_over_model_gib"] / base["steady_over_resident_gib"], 3)
                if "settled_over_model_and_held_gib" in row:  # like for like with the baseline's
                    row["settled_net_vs_16bit_activation"] = round(
                        row["settled_over_model_and_held_gib"] / base["steady_over_resident_gib"], 3)
        print(f"  {row['variant']:58s} first {row['first_s']:7.2f} s  steady {row['steady_s']:6.2f} s  "
              f"x{row.get('steady_speedup_vs_16bit', float('nan')):.2f}  peak {row['peak_vram_gib']} GiB "
              f"(steady {row.get('steady_peak_gib')}, model {row.get('model_gib')}, "
              f"x{row.get('over_model_vs_16bit_activation')} of 16-bit activations; runs without a capture "
              f"x{row.get('settled_over_model_vs_16bit_activation')}, less what the process held before "
              f"x{row.get('settled_net_vs_16bit_activation')})  "
              f"rel L2 {row.get('rel_l2_vs_16bit', 0):.2e}  {row.get('graph', '')} {row.get('compiled', '')}",
              flush=True)
        common.write_json(os.path.join(a.out, f"sampling_{a.model}.json"), results)

    base = common.load_stock(sd)
    row, ref = _run_variant(STOCK_16BIT, base, a.runs, sample, None)  # always: the baseline
    record(row)
    if OTHER_16BIT in wanted and common.CUDA:
        other = torch.float16 if spec["dtype"] == torch.bfloat16 else torch.bfloat16
        common.free(base)
        alt = common.load_stock({k: v.to(other) if v.is_floating_point() else v for k, v in sd.items()})
        row, _ = _run_variant(OTHER_16BIT + f" ({str(other)[6:]})", alt, a.runs, sample, ref)
        record(row)
        common.free(alt)
        base = common.load_stock(sd)
    x, sigma, kw = common.inputs(inputs, 1, spec["res"], spec.get("txt", 77), spec["dtype"], frames=spec.get("frames", 1))
    if a.quality:
        from comfy_modelopt.calibrate import calibrate
        from comfy_modelopt.errors import ModelOptError
        from comfy_modelopt.recipe import Recipe
        with torch.inference_mode():
            stats = calibrate(base.model.diffusion_model, lambda m: [
                base.model.apply_model(x, torch.full_like(sigma, s_), **kw) for s_ in QUALITY_SIGMAS])
        common.free(base)
        for label in a.quality_recipes or QUALITY_RECIPES:  # in the order asked for
            fields = QUALITY_RECIPES[label]
            t0 = time.perf_counter()
            try:
                q_sd_, meta_, rep = common.quantize_sd(sd, Recipe(**fields, sensitivity=False), stats)
            except ModelOptError as e:  # e.g. a budget below what a float32 model keeps
                results["rows"].append({"variant": label, "error": str(e)})
                print(f"  {label}: {e}")
                continue
            q_sd_ = common.on_host(q_sd_)  # only the loaded model on the GPU
            q = common.load_stock(q_sd_, meta_)
            row, _ = _run_variant(label, q, max(1, a.runs - 1), sample, ref)
            row["quantize_s"] = round(time.perf_counter() - t0, 1)
            row["bytes_vs_16bit"] = round(rep.total_bytes() / rep.total_bytes_16bit(), 4)
            row["notes"] = [n for n in rep.notes if n.startswith("planner")]
            if fields.get("smoothing"):
                row["smoothing_folded_layers"] = sum(" folded into " in (l.notes or "") for l in rep.quantized)
                row["smoothing_no_gain_layers"] = sum(": no gain" in (l.notes or "") for l in rep.quantized)
            record(row)
            common.free(q)
            del q_sd_
        if later:  # the fp8 calibration below runs the 16-bit model
            base = common.load_stock(sd)
    if not later:
        return results
    q_sd, meta = common.calibrated_fp8(base, sd, x, sigma, kw)
    q_sd = common.on_host(q_sd)  # only the loaded model on the GPU
    common.free(base)
    del sd
    fp8_ref = None
    # what the process holds before any fp8 variant loads: the 16-bit runs' cuBLAS workspace on
    # the default stream (in the 16-bit baseline's resident memory, so outside its activation
    # peak), the inputs and references - not the fp8 variants' to count
    held_before = torch.cuda.memory_allocated() / 2**30 if common.CUDA else None
    for variant in later:
        with AllocationTrace(stacks=True) if a.trace_held and common.CUDA else contextlib.nullcontext():
            q = common.load_stock(q_sd, meta)
            if variant == EAGER_NOISE:
                make_lean(q)
                dtype = q.model.get_dtype_inference()
                q.set_model_unet_function_wrapper(
                    lambda apply_model, args: apply_model(rounding_noise(args["input"], dtype), args["timestep"],
                                                          **args["c"]))
            note = None
            if variant != STOCK_FP8 and variant != EAGER_NOISE:  # as the nodes install it
                q, note = apply_runtime(q, variant, force_attention=True)
            row, out = _run_variant(variant, q, a.runs, sample, ref, fp8_ref)
            if note:
                row["runtime_note"] = note
            if a.trace_held and common.CUDA:
                row["held_beyond_weights"] = held_allocations(q)
        if held_before is not None and "settled_over_model_gib" in row:
            row["held_before_gib"] = round(held_before, 3)
            row["settled_over_model_and_held_gib"] = round(row["settled_over_model_gib"] - held_before, 3)
        fp8_ref = out if variant == STOCK_FP8 else fp8_ref
        if a.profile:
            row["profile"] = profile_run(q, sample)
        record(row)
        common.free(q)
    return results


def _storage_ptrs(t, out: set) -> None:
    """Where a (possibly quantized, wrapper-subclass) tensor's bytes live."""
    try:
        out.add(t.untyped_storage().data_ptr())
        return
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        for name in flatten()[0]:
            _storage_ptrs(getattr(t, name), out)


def held_allocations(q, top: int = 12) -> dict:
    """The blocks allocated now that are not the model's own tensors, largest first, with where
    each was allocated (--trace-held: the allocator's history recorded since before loading)."""
    own: set = set()
    for t in q.model.state_dict().values():
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            _storage_ptrs(t, own)
    held, weights_by_site = [], {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pool = "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "private"
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in blk.get("frames", [])
                      if "/torch/" not in f["filename"] and "/threading.py" not in f["filename"]][:5]
            if blk["address"] in own:  # the model's tensors, by where they were made
                site = " | ".join(frames[:3])
                weights_by_site[site] = weights_by_site.get(site, 0) + blk["size"] / 2**20
                continue
            held.append({"mib": round(blk["size"] / 2**20, 2), "pool": pool, "stream": seg.get("stream"),
                         "frames": frames})
    held.sort(key=lambda h: -h["mib"])
    sites = sorted(weights_by_site.items(), key=lambda kv: -kv[1])[:top]
    return {"total_mib": round(sum(h["mib"] for h in held), 1), "blocks": len(held), "largest": held[:top],
            "model_tensors_mib": round(sum(weights_by_site.values()), 1),
            "model_tensors_by_site_mib": [{"site": k, "mib": round(v, 1)} for k, v in sites]}


def profile_run(q, sample, top: int = 25) -> dict:
    """One whole run under torch.profiler: wall time, GPU kernel time (busy), and the host-side
    operations and Python functions that take the most time of their own."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if common.CUDA else [])
    with torch.inference_mode(), profile(activities=acts, with_stack=False) as prof:
        common.sync()
        t0 = time.perf_counter()
        sample(q)
        common.sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if getattr(e, "self_device_time_total", 0))
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    gpu = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:top]
    return {"wall_s": round(wall, 3), "gpu_kernel_s": round(gpu_us / 1e6, 3),
            "gpu_busy_fraction": round(gpu_us / 1e6 / wall, 3) if wall else None,
            "host_self_ms": [[e.key, round(e.self_cpu_time_total / 1e3, 2), e.count] for e in host],
            "gpu_self_ms": [[e.key, round(getattr(e, "self_device_time_total", 0) / 1e3, 2), e.count] for e in gpu]}


if __name__ == "__main__":
    main()

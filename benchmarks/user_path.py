#!/usr/bin/env python3
"""The user's path on a GPU, through the project's own nodes, next to stock ComfyUI in one process.

(The team's shared probe, tools/user_path_probe.py, kept here so that docs/benchmarks.md section
0a can be rerun from the repository; --log-info adds the pack's INFO log - compilation, capture.)

Flux (bf16), SDXL (fp16) or Wan 2.1 (bf16: wan81 = the 1.3B at 81 frames of 832x480, wan14b = the 14B's
width at 33 frames), full size, random weights with channel outliers (an init of its own, not the
project's):
  1. stock 16-bit model (comfy.sd.load_diffusion_model_state_dict) -> whole KSampler runs
     (comfy.sample.sample, euler/simple, N steps): wall time per run, final latent
  2. calibrate with the project's `calibrate(module, forward_loop)` on sampling runs of that model
  3. Quantize Model node (ModelOptQuantizeUNet.execute) with the runtime under test -> KSampler runs
  4. Save Quantized Model node -> stock comfy.sd.load_diffusion_model -> KSampler runs
  5. --fresh-load: a fresh process of this script builds the same 16-bit model, then Load Quantized Model
     (its default runtime) on the saved file -> KSampler runs, both side by side in that process
  optional: --lora R applies a random rank-R LoRA (ComfyUI's load_lora_for_models) to every block Linear
  of the 16-bit, the node's and the stock-loaded model; --budget F runs the planner.
Prints wall times, speed ratios vs stock 16-bit, latent rel-L2 between variants, peak VRAM, and at the end a table
of them (with --yardstick: the 16-bit model sampled once more in another dtype or SDPA kernel, and every latent
distance in units of that); writes JSON to --out.
Usage (COMFYUI_PATH set, project importable):
  python benchmarks/user_path.py --model flux|sdxl|wan81|wan14b --out DIR [--steps 20] [--runs 4] [--runtime "..."]... [--format F]
  python benchmarks/user_path.py --model flux|wan81 --cpu-tiny --runs 2 --steps 3   (a CPU smoke run)
  COMFY_MODELOPT_CODE=DIR python benchmarks/user_path.py ...   (the comfy_modelopt package in DIR - e.g.
  another commit's, `git archive REV comfy_modelopt | tar -x -C DIR` - for an A/B on one machine)
"""
import argparse, json, math, os, sys, time, gc

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="flux", choices=("flux", "sdxl", "wan81", "wan14b"))
ap.add_argument("--out", default=os.environ.get("OUT", "verify_out"))
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--res", type=int, default=1024, help="image side (Flux, SDXL)")
ap.add_argument("--format", default="float8_e4m3fn")
ap.add_argument("--runtime", action="append", default=[],
                help="the Quantize node's runtime (default: the nodes' default, auto); repeatable: the node runs "
                     "once per runtime on the same calibration, each quantized model's runs side by side")
ap.add_argument("--smoothing", default="none")
ap.add_argument("--input-scale", action="append", default=[], metavar="METHOD",
                help="the Quantize node's input_scale (default: the recipe's); repeat to quantize and sample once per method "
                     "in one process, the 16-bit runs shared")
ap.add_argument("--lowrank", type=int, default=0)
ap.add_argument("--budget", type=float, default=0.0)
ap.add_argument("--candidates", default="", metavar="FMT,FMT", help="the planner's formats with --budget (the Quantize node's candidates)")
ap.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None, help="default: the recipe's")
ap.add_argument("--gptq-act-order", action=argparse.BooleanOptionalAction, default=None, help="default: the recipe's")
ap.add_argument("--convrot", action=argparse.BooleanOptionalAction, default=None, help="default: the recipe's")
ap.add_argument("--sensitivity", action=argparse.BooleanOptionalAction, default=None, help="default: the recipe's")
ap.add_argument("--weight-only", default="", metavar="PATTERNS",
                help="the Quantize node's weight_only input (layer patterns written without an input scale): "
                     "the speed cost of the report's weight-only advice")
ap.add_argument("--lora", type=int, default=0, help="rank of a random LoRA applied (strength 1) to every block Linear, on both the 16-bit and the quantized model")
ap.add_argument("--calib-prompts", type=int, default=2)
ap.add_argument("--calib-steps", type=int, default=8)
ap.add_argument("--calib-res", type=int, default=0, help="image side while calibrating (Flux, SDXL; default --res - Wan calibrates at its runs' frames and size): "
                     "another size than the runs' makes their first image compile")
ap.add_argument("--skip-stock-file", action="store_true")
ap.add_argument("--yardstick", nargs="?", const="auto", default=None, choices=("auto", "dtype", "backend"),
                help="also sample the 16-bit model once more in another way that should not matter, the final latent's "
                     "yardstick: 'dtype' = the same weights in the other 16-bit dtype, 'backend' = the same model with "
                     "another SDPA kernel (PyTorch's memory-efficient instead of the one it picks); auto (the bare flag) = "
                     "backend for Flux on a GPU (fp16 Flux overflows: its fp16-vs-bf16 latent differs by 0.36), dtype else")
ap.add_argument("--cpu-tiny", action="store_true", help="CPU smoke test with tiny configs")
ap.add_argument("--vram-gib", type=float, default=0.0,
                help="a smaller card: ComfyUI plans its loads for this many GiB (its --reserve-vram takes the rest) and torch "
                     "allocates no more (its per-process fraction) - models that do not fit are streamed, as on such a card; "
                     "with --fresh-load only the fresh process's (quantized elsewhere, loaded and sampled on the small card)")
ap.add_argument("--then-runtime", action="append", default=[], metavar="LABEL",
                help="after the node's runs, the same quantized model under this graph runtime too (repeatable; "
                     "its CUDA-graph runner replaced, as the CUDA Graphs node does): side-by-side first runs")
ap.add_argument("--log-info", action="store_true", help="log at INFO (the pack's compilation and capture lines)")
ap.add_argument("--inference-mode", action="store_true",
                help="run everything under torch.inference_mode(), as ComfyUI's executor runs every prompt (the "
                     "shared probe does not; compiled code guards on it - though in both modes this script's "
                     "compile cache gave a server no hits on an H200, docs/benchmarks.md)")
ap.add_argument("--fresh-load", action="store_true",
                help="after Save Quantized Model, a fresh process of this script loads the file with Load Quantized "
                     "Model (its default runtime) next to the stock 16-bit model; its rows are added here")
ap.add_argument("--keep-files", default=None, metavar="DIR",
                help="write the 16-bit model and the saved quantized file to DIR and keep them (for server_path.py)")
ap.add_argument("--profile-first", action="store_true",
                help="run each quantized variant's first image under cProfile; the top functions go to "
                     "profile_first_*.txt in --out (where a LoRA's re-quantizing load or a compilation goes)")
ap.add_argument("--load-file", default=None, help=argparse.SUPPRESS)  # the fresh process's side of --fresh-load
ap.add_argument("--profile-node", action="store_true",
                help="run the Quantize node under cProfile; the top functions go to profile_first_node_*.txt in --out (all of them to .prof)")
A = ap.parse_args()
if A.cpu_tiny and A.model == "sdxl":
    # ComfyUI recognises SDXL by its exact UNet config (320 channels, depths 2/2/10): a shrunken one
    # is no model it knows, and the full one is too large for a CPU smoke run
    ap.error("--cpu-tiny runs Flux or Wan (a tiny SDXL config is not one ComfyUI detects)")
WAN = A.model.startswith("wan")
if A.log_info:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(levelname)s %(message)s")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
if os.environ.get("COMFY_MODELOPT_CODE"):  # another version of the package, ahead of the project's
    sys.path.insert(0, os.environ["COMFY_MODELOPT_CODE"])

sys.path.insert(0, os.environ["COMFYUI_PATH"])
from comfy.cli_args import args as cargs
if A.cpu_tiny:
    cargs.cpu = True
import torch
if A.vram_gib and (A.load_file or not A.fresh_load):  # with --fresh-load: the fresh process's budget only
    _total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    cargs.reserve_vram = max(0.0, _total_gib - A.vram_gib)
    torch.cuda.set_per_process_memory_fraction(min(1.0, A.vram_gib / _total_gib))
import comfy.model_management as mm
import comfy.model_detection as md
import comfy.sd, comfy.sample, comfy.utils
import folder_paths

import comfy_modelopt
from comfy_modelopt.calibrate import calibrate, CalibrationOptions
from comfy_modelopt.comfyui import nodes as N

DEV = mm.get_torch_device()
CUDA = DEV.type == "cuda"
os.makedirs(A.out, exist_ok=True)
RES = {"args": vars(A), "env": {"torch": torch.__version__, "package": os.path.dirname(comfy_modelopt.__file__)},
       "rows": [], "notes": []}
if CUDA:
    RES["env"]["gpu"] = torch.cuda.get_device_name(0)


def log(*a):
    print("[verify]", *a, flush=True)


def save():
    tag = "".join(f"_{k}{int(v)}" for k, v in (("gptq", A.gptq), ("convrot", A.convrot), ("sensitivity", A.sensitivity))
                  if v is not None)
    with open(os.path.join(A.out, f"verify_{A.model}_{A.format}{'_b' + str(A.budget) if A.budget else ''}{'_lora' if A.lora else ''}{'_' + str(A.res) if A.res != 1024 else ''}{'_vram' + str(A.vram_gib) if A.vram_gib else ''}{tag}.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


SDXL_CFG = {'use_checkpoint': False, 'image_size': 32, 'out_channels': 4, 'use_spatial_transformer': True, 'legacy': False,
            'num_classes': 'sequential', 'adm_in_channels': 2816, 'in_channels': 4, 'model_channels': 320,
            'num_res_blocks': [2, 2, 2], 'transformer_depth': [0, 0, 2, 2, 10, 10], 'channel_mult': [1, 2, 4], 'transformer_depth_middle': 10,
            'use_linear_in_transformer': True, 'context_dim': 2048, 'num_head_channels': 64, 'transformer_depth_output': [0, 0, 0, 2, 2, 2, 10, 10, 10],
            'use_temporal_attention': False, 'use_temporal_resblock': False}


def flux_meta(h, depth, single, ctx):
    meta = lambda *s: torch.empty(s, device="meta")
    sd = {"img_in.weight": meta(h, 64), "txt_in.weight": meta(h, ctx), "vector_in.in_layer.weight": meta(h, 768),
          "guidance_in.in_layer.weight": meta(h, 256)}
    for i in range(depth):
        sd[f"double_blocks.{i}.img_attn.norm.key_norm.scale"] = meta(128)
    for i in range(single):
        sd[f"single_blocks.{i}.norm.key_norm.scale"] = meta(128)
    return sd


def random_state_dict(kind, dtype):
    if kind == "flux":
        fake = flux_meta(*( (256, 2, 2, 256) if A.cpu_tiny else (3072, 19, 38, 4096)))
        cfg = md.detect_unet_config(fake, "")
        mc = md.model_config_from_unet_config(cfg, fake)
    elif WAN:
        import architectures  # Wan 2.1's configurations (benchmarks/architectures.py)
        cfg = dict(architectures.WAN_SMALL if A.cpu_tiny else
                   architectures.WAN_14B if A.model == "wan14b" else architectures.WAN_FULL)
        mc = md.model_config_from_unet_config(cfg)
    else:
        cfg = dict(SDXL_CFG)
        if A.cpu_tiny:
            cfg.update(model_channels=64, transformer_depth=[0, 0, 1, 1, 1, 1], transformer_depth_middle=1,
                       transformer_depth_output=[0, 0, 0, 1, 1, 1, 1, 1, 1])
        mc = md.model_config_from_unet_config(cfg, None)
    mc.set_inference_dtype(dtype, None)
    dev = DEV
    with torch.device("meta"):
        bm = mc.get_model({}, "", device="meta")
    g = torch.Generator(device=dev).manual_seed(0)
    sd = {}
    for k, v in bm.diffusion_model.state_dict().items():
        if not v.is_floating_point():
            sd[k] = torch.zeros(v.shape, dtype=v.dtype)
            continue
        if k.endswith("bias"):
            t = torch.zeros(v.shape, device=dev, dtype=torch.float32)
        elif v.ndim >= 2:
            t = torch.randn(v.shape, device=dev, generator=g) / math.sqrt(v[0].numel())
        else:
            t = torch.ones(v.shape, device=dev)
        # give a few input channels of every Linear's producer real outlier structure: scale some
        # columns of the weight (mimics trained models' channel-wise outliers)
        if v.ndim == 2 and v.shape[1] >= 256 and ("mlp.0" in k or "ff.net.0" in k or "ffn.0" in k or "qkv" in k or "linear1" in k):
            idx = torch.randperm(v.shape[1], generator=g, device=dev)[: max(1, v.shape[1] // 128)]
            t[:, idx] *= 8.0
        sd[k] = t.to(dtype).cpu()
    return sd, mc


def random_lora(sd, rank):
    """A LoRA state dict in ComfyUI's plain key style for every block Linear weight of the model."""
    g = torch.Generator().manual_seed(3); out = {}
    for k, v in sd.items():
        if v.ndim != 2 or not k.endswith(".weight") or not any(b in k for b in ("double_blocks", "single_blocks", "transformer_blocks", "blocks.")):
            continue
        base = "diffusion_model." + k[: -len(".weight")]
        out[base + ".lora_down.weight"] = (torch.randn(rank, v.shape[1], generator=g) / math.sqrt(v.shape[1])).to(torch.bfloat16)
        out[base + ".lora_up.weight"] = (torch.randn(v.shape[0], rank, generator=g) * 0.01).to(torch.bfloat16)
    return out


def with_lora(model, lora):
    m, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    return m


def conds(kind, dtype):
    g = torch.Generator().manual_seed(7)
    if kind == "flux":
        ctx = torch.randn(1, 16 if A.cpu_tiny else 512, 256 if A.cpu_tiny else 4096, generator=g)
        pooled = torch.randn(1, 768, generator=g)
        pos = [[ctx, {"pooled_output": pooled, "guidance": 3.5}]]
        neg = [[torch.zeros_like(ctx), {"pooled_output": pooled, "guidance": 3.5}]]
        return pos, neg, 1.0
    if WAN:  # umT5-XXL's 4096-wide text embeddings, cfg 5 (Wan 2.1's)
        ctx = torch.randn(1, 16 if A.cpu_tiny else 512, 4096, generator=g)
        return [[ctx, {}]], [[torch.zeros_like(ctx), {}]], 5.0
    ctx = torch.randn(1, 77, 2048, generator=g)
    pooled = torch.randn(1, 1280, generator=g)
    extra = {"pooled_output": pooled, "width": A.res, "height": A.res}
    return [[ctx, dict(extra)]], [[torch.zeros_like(ctx), dict(extra)]], 7.0


def latent(kind, res=None):
    if WAN:  # the video VAE's strides: 4x in time, 8x in space
        frames, h, w = (9, 48, 80) if A.cpu_tiny else (33 if kind == "wan14b" else 81, 480, 832)
        return torch.zeros(1, 16, (frames - 1) // 4 + 1, h // 8, w // 8)
    res = res or (64 if A.cpu_tiny else A.res)
    ch = 16 if kind == "flux" else 4
    return torch.zeros(1, ch, res // 8, res // 8)


def sample(model, pos, neg, cfg, seed=42, steps=None, res=None):
    lat = latent(A.model, res)
    lat = comfy.sample.fix_empty_latent_channels(model, lat)
    noise = comfy.sample.prepare_noise(lat, seed)
    return comfy.sample.sample(model, noise, steps or A.steps, cfg, "euler", "simple", pos, neg, lat,
                               seed=seed, disable_pbar=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def profiled(label, fn):
    """fn() under cProfile; its top functions (cumulative and own time) written beside the results."""
    import cProfile, io as _io, pstats
    prof = cProfile.Profile()
    out = prof.runcall(fn)
    text = _io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
    slug = "".join(ch if ch.isalnum() else "_" for ch in label)[:80]
    with open(os.path.join(A.out, f"profile_first_{slug}.txt"), "w") as f:
        f.write(text.getvalue())
    prof.dump_stats(os.path.join(A.out, f"profile_first_{slug}.prof"))  # all of it, for pstats
    return out


def timed_runs(label, model, pos, neg, cfg, profile=False):
    times, out = [], None
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    for i in range(A.runs):
        sync(); t0 = time.perf_counter()
        run = lambda: (sample(model, pos, neg, cfg), sync())[0]
        out = profiled(label, run) if profile and i == 0 else run()
        times.append(time.perf_counter() - t0)
        log(f"{label}: run {i + 1} {times[-1]:.3f} s")
    peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else None
    steady = times[1:] or times
    row = {"variant": label, "run_s": [round(t, 3) for t in times], "steady_s": round(min(steady), 3),
           "spread": round(max(steady) / min(steady) - 1, 4),  # of the steady runs (2..n), as server_path.py's
           "peak_gib": round(peak, 2) if peak else None}
    RES["rows"].append(row); save()
    return out.float().cpu(), row


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def quantized_from_file(path, lora, row16, lat16, pos, neg, cfg):
    """The fresh process of --fresh-load: Load Quantized Model (default runtime) on the saved file."""
    folder_paths.add_model_folder_path("diffusion_models", os.path.dirname(path), is_default=True)
    t0 = time.perf_counter()
    model, report = N.ModelOptUNetLoader.execute(unet_name=os.path.basename(path)).args
    RES["load_s"] = round(time.perf_counter() - t0, 1)
    RES["runtime_note"] = next((line for line in report.splitlines() if line.startswith("runtime")), None)
    log(f"Load Quantized Model {RES['load_s']} s; {RES['runtime_note']}")
    lat, row = timed_runs(f"{A.format} file, Load Quantized Model (fresh process)" + (f" + LoRA r{A.lora}" if lora else ""),
                          with_lora(model, lora) if lora else model, pos, neg, cfg)
    row["load_s"] = RES["load_s"]
    row["vs_16bit_stock"] = round(row16["steady_s"] / row["steady_s"], 3)
    row["rel_vs_16bit"] = round(rel(lat, lat16), 5)


def fresh_load(path):
    """Runs this script again in a new process on the saved file; returns its rows."""
    import subprocess
    sub = os.path.join(A.out, "fresh")
    cmd = [sys.executable, os.path.abspath(__file__), "--load-file", path, "--out", sub, "--model", A.model,
           "--format", A.format, "--runs", str(A.runs), "--steps", str(A.steps), "--lora", str(A.lora)]
    cmd += ["--cpu-tiny"] * A.cpu_tiny + ["--log-info"] * A.log_info + ["--vram-gib", str(A.vram_gib)] * bool(A.vram_gib)
    log("fresh process: " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    with open(next(os.path.join(sub, f) for f in os.listdir(sub) if f.endswith(".json"))) as f:
        child = json.load(f)
    RES["fresh_process"] = {k: child.get(k) for k in ("load_s", "runtime_note")}
    return child["rows"]


def quantize_node(base, stats, runtime, chosen, input_scale):
    """The Quantize Model node as ComfyUI calls it; (its output, seconds)."""
    node = lambda: N.ModelOptQuantizeUNet.execute(model=base, format=A.format, weight_scale="mse", input_scale=input_scale,
                                                  smoothing=A.smoothing, static_nvfp4_input=False,
                                                  keep="", runtime=runtime, lowrank=A.lowrank, calibration=stats,
                                                  **({"weight_only": A.weight_only} if A.weight_only else {}),
                                                  **chosen, **({"budget": A.budget} if A.budget else {}),
                                                  **({"candidates": A.candidates} if A.candidates else {}))
    t0 = time.perf_counter()
    out = profiled(f"node_{A.model}_{A.format}", node) if A.profile_node else node()
    return out, time.perf_counter() - t0

def yardstick(sd, dtype, base, lat16, pos, neg, cfg):
    """The 16-bit model sampled once more in a way that should not matter; its final-latent distance from the
    16-bit run is what every other row's distance is read against (RES["yardstick"])."""
    mode = A.yardstick
    if mode == "auto":
        mode = "backend" if A.model == "flux" and CUDA else "dtype"
    if mode == "backend":
        # ComfyUI calls torch's SDPA on a GPU (on a CPU it slices attention itself: no kernel to swap)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            lat_alt, row_alt = timed_runs(f"{dtype} stock, memory-efficient SDPA (yardstick)", base, pos, neg, cfg)
    else:
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        alt = comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options={"dtype": other})
        lat_alt, row_alt = timed_runs(f"{other} stock (yardstick)", alt, pos, neg, cfg)
        del alt; gc.collect(); mm.unload_all_models(); mm.soft_empty_cache()
    RES["yardstick"] = row_alt["rel_vs_16bit"] = round(rel(lat_alt, lat16), 5)
    row_alt["vs_16bit_stock"] = round(RES["rows"][0]["steady_s"] / row_alt["steady_s"], 3)
    RES["yardstick_mode"] = mode
    if RES["yardstick"] == 0:
        RES["notes"].append(f"the {mode} yardstick changed nothing on this device (no ratio against it)")
    log(f"yardstick ({mode}): final latent {RES['yardstick']} from the 16-bit run")


def table():
    """The rows as the headline reads them: first / steady run, spread, vs 16-bit, peak VRAM, final latent."""
    ys = RES.get("yardstick") or None
    head = ["variant", "first s", "steady s", "spread", "vs 16-bit", "peak GiB", "latent vs 16-bit"] + ["x yardstick"] * bool(ys)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in RES["rows"]:
        d = r.get("rel_vs_16bit")
        cells = [r["variant"], f"{r['run_s'][0]:.2f}", f"{r['steady_s']:.3f}",
                 "-" if r.get("spread") is None else f"{100 * r['spread']:.1f}%",
                 f"{r['vs_16bit_stock']:.2f}x" if r.get("vs_16bit_stock") else "-",
                 "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}", "0" if d is None else f"{d:.4g}"]
        if ys:
            cells.append("0" if d is None else f"{d / ys:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    dtype = torch.float16 if A.model == "sdxl" else torch.bfloat16
    from comfy_modelopt.comfyui.runtime import DEFAULT_RUNTIME
    runtimes = A.runtime or [DEFAULT_RUNTIME]  # the nodes' default
    RES["runtime"] = runtimes[0] if len(runtimes) == 1 else runtimes
    tmp = A.keep_files or os.path.join(A.out, "models"); os.makedirs(tmp, exist_ok=True)
    folder_paths.add_model_folder_path("diffusion_models", tmp, is_default=True)
    t0 = time.perf_counter()
    sd, mc = random_state_dict(A.model, dtype)
    log(f"random weights built in {time.perf_counter() - t0:.1f} s, {sum(v.numel() for v in sd.values()) / 1e9:.2f} G params")
    pos, neg, cfg = conds(A.model, dtype)
    if A.keep_files:
        import safetensors.torch
        t0 = time.perf_counter()
        safetensors.torch.save_file(sd, os.path.join(tmp, f"bench-{A.model}-16bit.safetensors"))
        log(f"16-bit file written in {time.perf_counter() - t0:.1f} s")

    base = comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options={"dtype": dtype})
    lora = random_lora(sd, A.lora) if A.lora else None
    RES["lora_tensors"] = len(lora) if lora else 0
    lat16, row16 = timed_runs(f"{dtype} stock" + (f" + LoRA r{A.lora}" if lora else ""), with_lora(base, lora) if lora else base,
                              pos, neg, cfg, profile=A.profile_first)
    if A.load_file:
        del base, sd; gc.collect(); mm.unload_all_models(); mm.soft_empty_cache()
        quantized_from_file(A.load_file, lora, row16, lat16, pos, neg, cfg)
        RES["rows"][0]["vs_16bit_stock"] = 1.0
        save()
        return
    if A.yardstick:
        yardstick(sd, dtype, base, lat16, pos, neg, cfg)

    # calibration: the project's core, on whole sampling runs of the stock model
    t0 = time.perf_counter()
    def forward_loop(_m):
        for i in range(A.calib_prompts):
            sample(base, pos, neg, cfg, seed=100 + i, steps=A.calib_steps, res=A.calib_res or None)
    mm.load_models_gpu([base])
    stats = calibrate(base.model.diffusion_model, forward_loop, CalibrationOptions())
    t_cal = time.perf_counter() - t0
    log(f"calibration {t_cal:.1f} s")

    from comfy_modelopt.recipe import Recipe
    flags = ("gptq", "gptq_act_order", "convrot", "sensitivity")
    given = {k: getattr(A, k) for k in flags if getattr(A, k) is not None}
    chosen = {k: given.get(k, getattr(Recipe(), k)) for k in flags}
    RES["recipe_flags"] = chosen
    RES["calibrate_s"] = round(t_cal, 1)
    scales = A.input_scale or [Recipe().input_scale]
    RES["input_scale"] = scales[0] if len(scales) == 1 else scales
    qmodel = out = runner = None
    for runtime, input_scale in ((r, s) for r in runtimes for s in scales):
        if qmodel is not None:  # the previous model leaves before the next is made
            qmodel = out = runner = None; gc.collect(); mm.soft_empty_cache()
        out, t_q = quantize_node(base, stats, runtime, chosen, input_scale)
        qmodel, report = out.args[0], out.args[1]
        log(f"quantize node ({runtime}, input_scale {input_scale}) {t_q:.1f} s"); log(report.splitlines()[0:4])
        RES.setdefault("quantize_s", []).append(round(t_q, 1))
        RES["report_head"] = report[:2000]
        latq, rowq = timed_runs(f"{A.format} project node, {runtime}" + (f", input_scale {input_scale}" if A.input_scale else "")
                                + (f" + LoRA r{A.lora}" if lora else ""),
                                with_lora(qmodel, lora) if lora else qmodel, pos, neg, cfg, profile=A.profile_first)
        rowq["vs_16bit_stock"] = round(row16["steady_s"] / rowq["steady_s"], 3)
        rowq["rel_vs_16bit"] = round(rel(latq, lat16), 5)
        rowq["quantize_s"] = round(t_q, 1)
        from comfy_modelopt.comfyui.runtime import graph_runner
        runner = graph_runner(qmodel)
        if runner is not None and hasattr(runner, "capture_seconds"):
            rowq["graphs"] = {"captures": runner.captures, "capture_s": runner.capture_seconds,
                              "compile_check_s": runner.compile_seconds, "pool_sizing": runner.pool_sizing,
                              "compiled_checks": runner.compiled.checks if runner.compiled is not None else None}
            log(json.dumps(rowq["graphs"], default=str))
        rowq["runtime_note"] = RES["runtime_note"] = next(
            (line for line in report.splitlines() if line.startswith("runtime")), None)
        log(RES["runtime_note"])
    for label in A.then_runtime:
        from comfy_modelopt.comfyui.runtime import enable_cuda_graphs
        from comfy_modelopt.comfyui.runtime import runtime_of
        rt = runtime_of(label)
        assert rt.cuda_graphs and not rt.attention, f"--then-runtime takes a graph runtime, not {label!r}"
        other, _ = enable_cuda_graphs(qmodel, compile_blocks=rt.compiled_blocks)
        lato, rowo = timed_runs(f"{A.format} project node, then {label}", other, pos, neg, cfg)
        rowo["vs_16bit_stock"] = round(row16["steady_s"] / rowo["steady_s"], 3)
        rowo["rel_vs_16bit"] = round(rel(lato, lat16), 5)
        del other; gc.collect()

    if (A.fresh_load or A.keep_files or not A.skip_stock_file) and A.lowrank == 0:
        t0 = time.perf_counter()
        sv = N.ModelOptSaveQuantized.execute(model=qmodel, filename=f"bench-{A.model}-{A.format}", overwrite=True)
        path = sv.args[0]
        t_s = time.perf_counter() - t0
        RES["save_s"] = round(t_s, 1); RES["file_gib"] = round(os.path.getsize(path) / 2**30, 3)
        log(f"saved {RES['file_gib']} GiB in {t_s:.1f} s")
        del qmodel; gc.collect(); mm.soft_empty_cache()
        if A.fresh_load:  # its ratio and latent difference are against its own 16-bit run (same weights, inputs)
            mm.unload_all_models(); mm.soft_empty_cache()
            child = fresh_load(path)
            RES["notes"].append({"fresh process 16-bit": child[0]})
            RES["rows"].extend(child[1:]); save()
        if not A.skip_stock_file:
            stock = comfy.sd.load_diffusion_model(path)
            lats, rows = timed_runs(f"{A.format} file, stock ComfyUI loader" + (f" + LoRA r{A.lora}" if lora else ""),
                                    with_lora(stock, lora) if lora else stock, pos, neg, cfg)
            rows["vs_16bit_stock"] = round(row16["steady_s"] / rows["steady_s"], 3)
            rows["rel_vs_16bit"] = round(rel(lats, lat16), 5)
            rowq["rel_vs_stock_file"] = round(rel(latq, lats), 5)
        if not A.keep_files:
            os.remove(path)
    RES["rows"][0]["vs_16bit_stock"] = 1.0
    save()
    for r in RES["rows"]:
        log(json.dumps(r))
    print(table(), flush=True)


if __name__ == "__main__":
    if A.inference_mode:
        with torch.inference_mode():
            main()
    else:
        main()

"""Shared pieces of the benchmark scripts: environment record, timing, models built with
ComfyUI's own classes, quantized with comfy-modelopt and loaded the stock way."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import architectures  # noqa: E402
import tables  # noqa: E402

architectures.setup_comfy()

import comfy.model_management  # noqa: E402

from comfy_modelopt.fileformat import (COMFY_QUANT, QUANT_METADATA, comfy_quant_tensor,  # noqa: E402
                                       decode_quantization_metadata, encode_quantization_metadata)
from comfy_modelopt.pipeline import DictSink, quantize  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def env_info() -> dict:
    import comfy_kitchen
    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "comfy_kitchen": _dist_version("comfy-kitchen"),
            "kitchen_backends": [k for k, v in comfy_kitchen.list_backends().items() if v["available"]
                                 and not v["disabled"]],
            "comfyui": _comfy_version(), "cpus": os.cpu_count()}
    if CUDA:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["sm"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.split()
            info["driver"] = out[0] if out else "?"  # one line per GPU: the first
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = "?"
    return info


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def _comfy_version() -> str:
    ns = {}
    path = os.path.join(architectures.COMFYUI_PATH or os.path.dirname(comfy.__path__[0]), "comfyui_version.py")
    try:
        exec(open(path).read(), ns)
    except OSError:
        return "?"
    return ns.get("__version__", "?")


def sync():
    if CUDA:
        torch.cuda.synchronize()


def time_ms(fn, warmup: int = 3, iters: int = 10) -> tuple[float, list]:
    """Median milliseconds per call (CUDA events on a GPU, wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if CUDA:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def kernel_ms(fn, iters: int = 2) -> float | None:
    """GPU kernel time per call from the profiler (None on a CPU)."""
    if not CUDA:
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / 1e3 / iters


def graph_fn(patcher, x, sigma, kw, compile_blocks=False):
    """``apply_model`` on these inputs through a ``CudaGraphs`` runner (as ComfyUI's sampler calls
    the model-function wrapper); returns (call, runner)."""
    from comfy_modelopt.comfyui.cuda_graphs import CudaGraphs
    runner = CudaGraphs(patcher, compile_blocks=compile_blocks)
    topts = dict(patcher.model_options.get("transformer_options", {}))
    args = {"input": x, "timestep": sigma, "c": dict(kw, transformer_options=topts)}
    return (lambda: runner(patcher.model.apply_model, args)), runner


def allocated_gib() -> float | None:
    """GPU memory held by live tensors now (every model still loaded, not only the one measured)."""
    if not CUDA:
        return None
    sync()
    return torch.cuda.memory_allocated() / 2**30


def peak_vram_gib(fn) -> float | None:
    """Peak GPU memory allocated during ``fn()`` (called in any case; None without CUDA),
    including whatever else is resident: compare with ``allocated_gib()`` taken just before."""
    if not CUDA:
        fn()
        return None
    sync()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() / 2**30


def load_stock(sd: dict, metadata: dict | None = None):
    """The ComfyUI MODEL for a state dict, fully on the GPU: ComfyUI's own loader, or ours
    (which wraps it) for files with low-rank layers."""
    from comfy_modelopt.comfyui import ownloader
    patcher = ownloader.load_state_dict(dict(sd), dict(metadata or {}), disable_dynamic=True)
    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    return patcher


def quantize_sd(sd: dict, recipe: Recipe, stats=None) -> tuple[dict, dict, object]:
    sink = DictSink(DEVICE)
    report = quantize(sd, recipe, stats, sink=sink, refuse_unknown=False).report
    return sink.tensors, sink.metadata, report


def calibrated_fp8(base, sd: dict, x, sigma, kw, sigmas=(1.0, 0.5, 0.1)) -> tuple[dict, dict]:
    """fp8 W8A8 state dict + metadata with static input scales from a few evaluations of the
    16-bit ``base`` at ``sigmas`` (the quick calibration of the runtime benchmarks)."""
    from comfy_modelopt.calibrate import CalibrationOptions, calibrate
    with torch.inference_mode():
        stats = calibrate(base.model.diffusion_model,
                          lambda m: [base.model.apply_model(x, torch.full_like(sigma, s), **kw) for s in sigmas],
                          CalibrationOptions(reservoir_bytes=0))
        q_sd, meta, _ = quantize_sd(sd, Recipe("float8_e4m3fn", weight_scale="absmax", input_scale="max",
                                               sensitivity=False), stats)
    return q_sd, meta


def naive_w8a8(q_sd: dict, metadata: dict) -> tuple[dict, dict]:
    """fp8 as naive converters write it: W8A8 without input_scale (ComfyUI then uses 1.0)."""
    q_sd = dict(q_sd)
    layers = decode_quantization_metadata(metadata[QUANT_METADATA], QUANT_METADATA)
    for name, conf in layers.items():
        conf.pop("full_precision_matrix_mult", None)
        q_sd[name + COMFY_QUANT] = comfy_quant_tensor(conf)
    meta = dict(metadata, **{QUANT_METADATA: encode_quantization_metadata(layers)})
    return q_sd, meta


def model_bytes(patcher) -> int:
    """Resident weight bytes: the state dict, plus the own loader's per-layer buffers (low-rank
    branch, smoothing), which ComfyUI's quantized layers leave out of their state dict."""
    dm = patcher.model.diffusion_model
    sd = dm.state_dict()
    total = 0
    for t in sd.values():
        total += t.numel() * t.element_size() if not hasattr(t, "_qdata") else _qt_bytes(t)
    for name, b in dm.named_buffers():
        if name not in sd and name.rsplit(".", 1)[-1] in ("lowrank_up", "lowrank_down", "smooth_scale"):
            total += b.numel() * b.element_size()
    return total


def _qt_bytes(qt) -> int:
    return sum(v.numel() * v.element_size() for v in qt.state_dict("").values())


def on_host(sd: dict) -> dict:
    """``sd``'s tensors on the CPU.  A benchmark that keeps a state dict to load again should keep
    it there: ComfyUI's loader copies the tensors it converts (the 16-bit ones a quantized file
    keeps) instead of sharing them, so a GPU copy held by the script is counted as the runtime's
    memory (SDXL fp8 0.74 GiB, Flux 0.09 GiB beyond model_size(), measured on the H200)."""
    return {k: v.cpu() for k, v in sd.items()}


def free(*patchers):
    for p in patchers:
        if p is not None:
            comfy.model_management.unload_model_clones(p) if hasattr(comfy.model_management, "unload_model_clones") else None
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache(True)
    if CUDA:
        torch.cuda.empty_cache()


def inputs(family: str, batch: int, res, txt: int, dtype, frames: int = 1) -> tuple:
    """(x, sigma, kwargs) for one apply_model call of a real-resolution model (``res``: pixels,
    square, or (height, width); video: ``frames`` pixel frames, (frames - 1) / 4 + 1 latent ones)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=DEVICE, dtype=dtype)  # noqa: E731
    lat = res // 8 if isinstance(res, int) else res[0] // 8
    sigma = torch.full((batch,), 0.7, device=DEVICE)
    if family == "flux":
        return r(batch, 16, lat, lat), sigma, {"c_crossattn": r(batch, txt, 4096), "y": r(batch, 768),
                                              "guidance": torch.full((batch,), 3.5, device=DEVICE)}
    if family == "flux_small":
        return r(batch, 16, lat, lat), sigma, {"c_crossattn": r(batch, txt, 256), "y": r(batch, 256),
                                              "guidance": torch.full((batch,), 3.5, device=DEVICE)}
    if family == "sdxl":
        return r(batch, 4, lat, lat), sigma, {"c_crossattn": r(batch, 77, 2048), "y": r(batch, 2816)}
    if family == "sd15":
        return r(batch, 4, lat, lat), sigma, {"c_crossattn": r(batch, 77, 768)}
    if family == "wan":
        wide = lat if isinstance(res, int) else res[1] // 8
        return r(batch, 16, (frames - 1) // 4 + 1, lat, wide), sigma, {"c_crossattn": r(batch, txt, 4096)}
    raise ValueError(family)


write_json = tables.write_json

"""The runtimes a quantized MODEL can run under, as the nodes and benchmarks offer them.

Each ``Runtime`` is a combination of the concerns in their own modules: lean layers and the
dequantized-weight cache (``lean``), CUDA-graph replay (``cuda_graphs``) over optionally
compiled blocks (``compiled_blocks``), and INT8 attention (``attention``).  ``apply_runtime``
installs one; ``gpu_note`` says what this GPU does with a format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FORMATS
from .attention import enable_int8_attention
from .cuda_graphs import enable_cuda_graphs
from .lean import make_lean, native_formats
from .model import compute_device


@dataclass(frozen=True)
class Runtime:
    label: str                     # what the nodes' combo shows
    lean: bool = True              # direct kernel calls for the quantized layers
    cuda_graphs: bool = False      # capture and replay whole model evaluations
    compiled_blocks: bool = False  # ... over TorchInductor-compiled blocks
    int8_attention: bool = False   # kitchen's INT8 attention (changes attention numerics)


RUNTIMES = {r.label: r for r in (
    Runtime("lean"),
    Runtime("lean + cuda graphs", cuda_graphs=True),
    Runtime("lean + compiled blocks + cuda graphs", cuda_graphs=True, compiled_blocks=True),
    Runtime("lean + cuda graphs + int8 attention", cuda_graphs=True, int8_attention=True),
    Runtime("stock", lean=False),
)}
# graphs by default: bit-exact with stock like lean, and what a whole run is made of - SDXL's fp8
# steady run on lean alone is host-bound (2.85 s against fp16's 1.00 s on the H200), 0.82 s with
# graphs; Flux 2.70 -> 2.36 s (bf16 3.08 s).  They stay captured between runs, their pool is
# accounted to ComfyUI (which frees it to load another model), and anything they cannot replay -
# offloading, patches or wrappers inside the model, a CPU - runs eagerly with the reason logged.
# Not compiled blocks (measured through the nodes, H200, 2026-12-01): they are faster from the
# second image (Flux 2.01 vs 2.37 s, SDXL 0.64 vs 0.83 s) but the first image pays the compilation
# (Flux +3.4 s with a warm compile cache, +11 s cold; SDXL +9 / +47 s): behind until ~10 Flux / ~50
# SDXL images of one size per process
DEFAULT_RUNTIME = "lean + cuda graphs"

RUNTIME_TOOLTIP = ("lean: the same kernels as stock ComfyUI without its per-layer Python dispatch "
                   "(bit-exact for fp8/int8); + cuda graphs: replay whole model evaluations, kept between "
                   "runs while the model stays loaded (bit-exact; falls back to eager when offloading or "
                   "patched); + compiled blocks: the graphs run TorchInductor-fused norms/modulation/"
                   "activations between the GEMMs - fastest steady runs (H200, fp8, 20 steps, through the nodes: "
                   "Flux 1.57x bf16 vs 1.32x, SDXL 0.64 s vs 0.83 s per image); they compile during the first "
                   "image of each size (Flux +11 s, +3.4 s with a warm compile cache; SDXL +47 s / +9 s), are "
                   "checked against eager and turned off with a logged reason if they differ; needs Triton; + int8 attention: kitchen's SageAttention-style INT8 attention "
                   "(changes attention numerics; left off on Hopper, where it measured slower than cuDNN's "
                   "flash attention); stock: ComfyUI's own layers.")

DEQUANT_CACHE_TOOLTIP = ("GiB of VRAM for 16-bit copies of the weights this GPU cannot compute natively "
                         "(nvfp4/mxfp8 before Blackwell): those layers then skip dequantizing on every call "
                         "(same output). 0 = off. ComfyUI is told to keep that much free; the copies go "
                         "when the model leaves the GPU. Needs a lean runtime.")


def runtime_of(label: str) -> Runtime:
    try:
        return RUNTIMES[label]
    except KeyError:
        raise ValueError(f"unknown runtime {label!r}; choose one of: {', '.join(RUNTIMES)}") from None


def apply_runtime(patcher, runtime: str | Runtime, dequant_cache_gib: float = 0.0,
                  force_int8_attention: bool = False) -> tuple:
    """Install ``runtime`` on a model this pack created; returns (model, note).  The model is a
    clone where CUDA graphs or INT8 attention need one; lean layers are rebound in place.
    INT8 attention is left out where it measured slower (``attention.SLOWER_ON``) unless
    ``force_int8_attention`` (benchmarks)."""
    rt = runtime if isinstance(runtime, Runtime) else runtime_of(runtime)
    if not rt.lean:
        return patcher, "runtime: stock ComfyUI layers" + (
            " (dequant cache ignored: it needs a lean runtime)" if dequant_cache_gib > 0 else "")
    n = make_lean(patcher, dequant_cache_bytes=int(dequant_cache_gib * 2**30))
    note = f"runtime: lean ({n} quantized layers on direct kernel calls)"
    cache = getattr(patcher.model, "_modelopt_dequant_cache", None)
    if cache is not None:
        note += (f" + dequantized-weight cache of up to {cache.budget / 2**30:.2f} GiB" if cache.budget
                 else " (dequant cache unused: every layer runs natively on this GPU)")
    if rt.int8_attention:
        try:
            patcher = enable_int8_attention(patcher, force=force_int8_attention)
            note += " + INT8 attention"
        except ValueError as e:
            note += f" (INT8 attention not enabled: {e})"
    if rt.cuda_graphs:
        patcher, _ = enable_cuda_graphs(patcher, compile_blocks=rt.compiled_blocks)
        if compute_device().type == "cuda":
            note += " + CUDA graph replay" + (" over compiled blocks" if rt.compiled_blocks else "")
        else:  # installed, and it runs the model eagerly: say so rather than promise replays
            note += " (CUDA graph replay: no CUDA GPU here, the model runs eagerly)"
    return patcher, note


def gpu_note(fmt_name: str) -> str:
    """What the current GPU does with the format (ComfyUI's own gates)."""
    fmt = FORMATS[fmt_name]
    dev = compute_device()
    if dev.type != "cuda":
        return f"{fmt_name}: no CUDA GPU here; ComfyUI computes it dequantized (smaller, not faster)"
    sm = torch.cuda.get_device_capability(dev)
    if fmt_name in native_formats(dev):
        return f"{fmt_name}: runs natively on this GPU (SM {sm[0]}.{sm[1]})"
    return (f"{fmt_name}: needs SM {fmt.native_sm[0]}.{fmt.native_sm[1]}+ to run natively; on this GPU "
            f"(SM {sm[0]}.{sm[1]}) ComfyUI dequantizes it on every step: smaller, not faster")

"""kitchen's INT8 attention (SageAttention-style, Hadamard-rotated Q/K) as ComfyUI's
``optimized_attention_override`` - installed only where it was not measured slower end to end.

Measured on an H200 (``benchmarks/sampling_check.py``, 2026-11-30, whole 20-step runs at
1024x1024, fp8 W8A8 under CUDA graphs): Flux 2.60 s with it against 2.36 s without (its kernel
0.70 s per run against cuDNN's flash attention 0.49 s), SDXL 0.93 against 0.82 s.  On Hopper
cuDNN's 16-bit flash attention is the faster choice, so the runtime leaves attention alone
there (``SLOWER_ON``); elsewhere (Ada, Blackwell: not measured yet) it is installed as asked.
Per call (``benchmarks/attention8.py``, H200, 2026-12-01) kitchen's kernel is 0.57-0.79x bf16's
at every size measured, and cuDNN's FP8 SDPA - the other 8-bit candidate - is slower too at the
whole-run sizes once Q/K/V are quantized (Flux 1024x1024 0.92x, 3% error against bf16's 0.2%),
faster only at long sequences (1.35-1.41x at 17-33k tokens); not offered as a runtime.
"""
from __future__ import annotations

import comfy_kitchen as ck
import torch


def int8_attention_available(device) -> bool:
    try:
        return bool(ck.int8_attention_is_available(torch.device(device)))
    except (AttributeError, RuntimeError):
        return False


def int8_attention_override(func, *args, **kwargs):
    """``optimized_attention_override``: kitchen's INT8 attention (SageAttention-style, Hadamard-
    rotated Q/K) for unmasked 64/128/256-dim heads on CUDA; anything else goes to ComfyUI's choice."""
    q, k, v, heads = args[:4]
    mask = kwargs.get("mask", args[4] if len(args) > 4 else None)
    if mask is not None or q.device.type != "cuda" or kwargs.get("enable_gqa") or \
            q.dtype not in (torch.float16, torch.bfloat16):
        return func(*args, **kwargs)
    if kwargs.get("skip_reshape", False):
        b, _, _, d = q.shape
    else:
        b, _, hd = q.shape
        d = hd // heads
        q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    if d not in (64, 128, 256):
        return func(*args, **kwargs)
    out = ck.int8_attention(q, k, v, scale=kwargs.get("scale"))
    if not kwargs.get("skip_output_reshape", False):
        out = out.transpose(1, 2).reshape(b, -1, heads * d)
    return out


# compute capability (major) -> why INT8 attention is not installed there
SLOWER_ON = {9: "measured slower end to end on Hopper (H200, 20 steps: Flux 2.60 vs 2.36 s, SDXL 0.93 vs "
                "0.82 s; cuDNN's flash attention wins)"}


def enable_int8_attention(patcher, force: bool = False):
    """A clone of ``patcher`` whose attention runs kitchen's INT8 kernel where it applies.
    Refused (ValueError) where the kernel is missing or, unless ``force``, measured slower."""
    if not int8_attention_available(patcher.load_device):
        raise ValueError("kitchen's INT8 attention kernel is not available on this device")
    device = torch.device(patcher.load_device)
    if not force and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in SLOWER_ON:
        raise ValueError(SLOWER_ON[torch.cuda.get_device_capability(device)[0]])
    clone = patcher.clone()
    topts = clone.model_options.setdefault("transformer_options", {})
    if "optimized_attention_override" in topts:
        raise ValueError("this MODEL already overrides attention")
    topts["optimized_attention_override"] = int8_attention_override
    return clone

"""8-bit attention as ComfyUI's ``optimized_attention_override``: kitchen's INT8 attention
(SageAttention-style, Hadamard-rotated Q/K) - installed only where it was not measured slower end
to end (``SLOWER_ON``: on Hopper cuDNN's 16-bit flash attention is faster) - and FlashAttention-3's
FP8 forward (the ``fa3-fwd`` package, Hopper) for long sequences.
Design: docs/design.md, ``comfyui/attention.py``.
"""
from __future__ import annotations

import comfy_kitchen as ck
import torch

from ..formats import F8_E4M3_MAX
from .compiled_blocks import block_independent, own

# below this many query and key tokens the fp8 path leaves attention to ComfyUI: shorter, the
# quantization of Q/K/V costs more than the FP8 kernel saves (docs/benchmarks.md#attention)
FP8_MIN_TOKENS = 12288
KERNEL_DEVICES = ("cuda",)  # where the fp8 path runs (tests add "cpu", with a reference kernel)
HEAD_DIMS = (64, 96, 128, 192, 256)  # what fa3-fwd 0.0.3 is built for
# FlashAttention-3's 16-bit forward where it measured faster than torch's SDPA (docs/benchmarks.md#attention):
# 128-wide heads from Flux 1024x1024's token count up; other widths and lengths not measured
FA3_16BIT_HEAD_DIMS = (128,)
FA3_16BIT_MIN_TOKENS = 4608


def int8_attention_available(device) -> bool:
    try:
        return bool(ck.int8_attention_is_available(torch.device(device)))
    except (AttributeError, RuntimeError):
        return False


def attention_args(args, kwargs) -> tuple:
    """(q, k, v, heads, mask) of a call of ComfyUI's ``optimized_attention`` as an override receives
    it: the models pass ``heads`` (and ``mask``) by position or by keyword (Wan: ``heads=``)."""
    q, k, v = args[:3]
    heads = args[3] if len(args) > 3 else kwargs["heads"]
    mask = args[4] if len(args) > 4 else kwargs.get("mask")
    return q, k, v, heads, mask


def heads_layout(q, k, v, heads: int, kwargs) -> tuple:
    """``q``, ``k``, ``v`` of a call as [B, N, H, D] views: ComfyUI passes [B, N, H*D], or
    [B, H, N, D] with ``skip_reshape``."""
    if kwargs.get("skip_reshape", False):
        return tuple(t.transpose(1, 2) for t in (q, k, v))
    b, _, hd = q.shape
    return tuple(t.view(b, -1, heads, hd // heads) for t in (q, k, v))


def comfy_layout(out: torch.Tensor, kwargs) -> torch.Tensor:
    """An attention output [B, N, H, D] as ComfyUI's caller takes it: [B, N, H*D], or
    [B, H, N, D] with ``skip_output_reshape``."""
    if kwargs.get("skip_output_reshape", False):
        return out.transpose(1, 2)
    b, n, h, d = out.shape
    return out.reshape(b, n, h * d)


@own
@block_independent
def int8_attention_override(func, *args, **kwargs):
    """``optimized_attention_override``: kitchen's INT8 attention (SageAttention-style, Hadamard-
    rotated Q/K) for unmasked 64/128/256-dim heads on CUDA; anything else goes to ComfyUI's choice."""
    q, k, v, heads, mask = attention_args(args, kwargs)
    if mask is not None or q.device.type != "cuda" or kwargs.get("enable_gqa") or \
            q.dtype not in (torch.float16, torch.bfloat16):
        return func(*args, **kwargs)
    q, k, v = heads_layout(q, k, v, heads, kwargs)
    if q.shape[-1] not in (64, 128, 256):
        return func(*args, **kwargs)
    out = ck.int8_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=kwargs.get("scale"))  # [B, H, N, D]
    return comfy_layout(out.transpose(1, 2), kwargs)


_FA3: list = []  # (flash_attn_func or None, why not), looked up once


def fa3_kernel():
    """FlashAttention-3's forward (``fa3-fwd``: ``pip install fa3-fwd``), or None and why not."""
    if not _FA3:
        try:
            from fa3_fwd_interface import flash_attn_func
            _FA3.append((flash_attn_func, ""))
        except Exception as e:  # noqa: BLE001 - not installed, or built for another torch: not offered
            _FA3.append((None, f"FlashAttention-3 is not importable ({type(e).__name__}: {str(e)[:120]}; "
                               f"pip install fa3-fwd)"))
    return _FA3[0]


def e4m3_heads(t: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [B, N, H, D] in e4m3 with one float32 scale per batch and head [B, H] (its absmax /
    448: the kernel's descale factor); ``amax``: that absmax [B, H] where the caller has it."""
    # the scale in t's dtype, the one divided by, is the descale handed over (a float32 one would
    # differ from it by the 16-bit rounding: up to 0.4% per head)
    amax = t.abs().amax(dim=(1, 3)) if amax is None else amax
    scale = (amax.float() / F8_E4M3_MAX).clamp_min(1e-12).to(t.dtype)
    q = (t / scale[:, None, :, None]).clamp(-F8_E4M3_MAX, F8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


def centred(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` [B, N, H, D] less each channel's mean over the tokens, its absmax per batch and head
    [B, H], and the mean [B, 1, H, D].  The absmax comes from the same pass as the mean - the
    larger distance from the mean to the channel's max or min (rounding is monotonic, so it is the
    rounded centred tensor's absmax too) - instead of a second pass over the centred copy."""
    mean = t.mean(dim=1, keepdim=True)
    amax = torch.maximum(t.amax(dim=1, keepdim=True) - mean, mean - t.amin(dim=1, keepdim=True)).amax(dim=(1, 3))
    return t - mean, amax, mean


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  kernel=None) -> torch.Tensor:
    """Attention of ``q`` [B, Nq, H, D] over ``k``, ``v`` [B, Nk, H, D] (16-bit) on e4m3 inputs,
    keys and values centred per channel first (module docstring); [B, Nq, H, D] in ``q``'s dtype.
    ``kernel``: FlashAttention-3's ``flash_attn_func`` (its signature, for a reference)."""
    (kc, k_amax, _), (vc, v_amax, v_mean) = centred(k), centred(v)
    (q8, qs), (k8, ks), (v8, vs) = e4m3_heads(q), e4m3_heads(kc, k_amax), e4m3_heads(vc, v_amax)
    out = fa3_forward(q8, k8, v8, scale, kernel, q_descale=qs, k_descale=ks, v_descale=vs)
    return (out + v_mean).to(q.dtype)


def fa3_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, kernel=None,
                **descales) -> torch.Tensor:
    """FlashAttention-3's forward (``kernel``, default ``fa3_kernel``'s) of ``q`` [B, N, H, D] over
    ``k``, ``v``: 16-bit inputs as they are, or e4m3 ones with their ``q_descale``/``k_descale``/
    ``v_descale`` [B, H]; the output [B, N, H, D] 16-bit (without the log-sum-exp some builds add)."""
    out = (kernel or fa3_kernel()[0])(q, k, v, softmax_scale=scale, causal=False, **descales)
    return out[0] if isinstance(out, tuple) else out


@own
@block_independent
def fp8_attention_override(func, *args, **kwargs):
    """``optimized_attention_override``: ``fp8_attention`` for unmasked self-attention of at least
    ``FP8_MIN_TOKENS`` tokens with ``HEAD_DIMS`` heads on CUDA, ``fa3_forward`` for shorter 16-bit
    self-attention of ``FA3_16BIT_MIN_TOKENS``+ tokens with ``FA3_16BIT_HEAD_DIMS`` heads; anything
    else goes to ComfyUI's choice."""
    q, k, v, heads, mask = attention_args(args, kwargs)
    if mask is not None or q.device.type not in KERNEL_DEVICES or kwargs.get("enable_gqa") or \
            not q.dtype.is_floating_point:
        return func(*args, **kwargs)
    q, k, v = heads_layout(q, k, v, heads, kwargs)
    if q.shape[-1] not in HEAD_DIMS or k.shape != q.shape:
        return func(*args, **kwargs)
    if q.shape[1] >= FP8_MIN_TOKENS:
        return comfy_layout(fp8_attention(q, k, v, scale=kwargs.get("scale")), kwargs)
    if q.shape[-1] in FA3_16BIT_HEAD_DIMS and q.shape[1] >= FA3_16BIT_MIN_TOKENS and \
            q.dtype in (torch.float16, torch.bfloat16) and kwargs.get("attn_precision") in (None, q.dtype):
        return comfy_layout(fa3_forward(q, k, v, kwargs.get("scale")), kwargs)
    return func(*args, **kwargs)


def enable_fp8_attention(patcher, force: bool = False):
    """A clone of ``patcher`` whose long self-attention runs FlashAttention-3's FP8 forward.
    Refused (ValueError) where the kernel is missing or the GPU is not a Hopper (FA3's fp8 path
    is SM 9.0 only)."""
    device = torch.device(patcher.load_device)
    if device.type not in KERNEL_DEVICES or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9):
        raise ValueError("FlashAttention-3's FP8 forward runs on Hopper GPUs (SM 9.0) only")
    kernel, why = fa3_kernel()
    if kernel is None:
        raise ValueError(why)
    return _with_override(patcher, fp8_attention_override)


def _with_override(patcher, override):
    clone = patcher.clone()
    topts = clone.model_options.setdefault("transformer_options", {})
    if "optimized_attention_override" in topts:
        raise ValueError("this MODEL already overrides attention")
    topts["optimized_attention_override"] = override
    return clone


# compute capability (major) -> why INT8 attention is not installed there
SLOWER_ON = {9: "measured slower end to end on Hopper (cuDNN's flash attention wins: docs/benchmarks.md#attention)"}


def enable_int8_attention(patcher, force: bool = False):
    """A clone of ``patcher`` whose attention runs kitchen's INT8 kernel where it applies.
    Refused (ValueError) where the kernel is missing or, unless ``force``, measured slower."""
    if not int8_attention_available(patcher.load_device):
        raise ValueError("kitchen's INT8 attention kernel is not available on this device")
    device = torch.device(patcher.load_device)
    if not force and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in SLOWER_ON:
        raise ValueError(SLOWER_ON[torch.cuda.get_device_capability(device)[0]])
    return _with_override(patcher, int8_attention_override)


# name -> (what the runtime note calls it, installer, where it acts)
ATTENTIONS = {"int8": ("INT8 attention", enable_int8_attention, ""),
              "fp8": ("FP8 attention", enable_fp8_attention,
                      f" on self-attention of {FP8_MIN_TOKENS:,}+ tokens (FlashAttention-3's 16-bit forward from "
                      f"{FA3_16BIT_MIN_TOKENS:,} tokens)")}

"""FP8 attention's quantization around FlashAttention-3 (comfy_modelopt/comfyui/attention.py):
per-head e4m3 scales, key and value channels centred, the override's layouts and fallbacks.  The
kernel itself needs a Hopper GPU (tests/comfyui/test_capture.py runs it there); here a torch
re-statement of what it computes from its inputs stands in: attention on the dequantized e4m3
inputs, exact softmax."""
from __future__ import annotations

import pytest
import torch

from comfy_modelopt.comfyui import attention as att


def reference_kernel(q8, k8, v8, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None):
    """flash_attn_func's contract on inputs [B, N, H, D] - e4m3 with descales [B, H], or 16-bit
    without: attention of the dequantized inputs, output 16-bit [B, N, H, D] (the inputs' dtype
    where they are 16-bit)."""
    deq = [t.float() if s is None else t.float() * s[:, None, :, None]
           for t, s in ((q8, q_descale), (k8, k_descale), (v8, v_descale))]
    q, k, v = (t.transpose(1, 2) for t in deq)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=softmax_scale)
    return out.transpose(1, 2).to(q8.dtype if q8.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)


def fp8_attention_on_cpu(monkeypatch, attention, kernel=reference_kernel):
    """``attention`` (the module as the caller imported it) taking every self-attention call of a
    small model on the CPU: any token count, any head width, ``kernel`` in FlashAttention-3's place."""
    monkeypatch.setattr(attention, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(attention, "FP8_MIN_TOKENS", 1)
    monkeypatch.setattr(attention, "HEAD_DIMS", range(1, 513))  # the small configurations' heads
    monkeypatch.setattr(attention, "fa3_kernel", lambda: (kernel, ""))


def _qkv(b=1, n=256, h=4, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, generator=g) for _ in range(3))
    k[..., 3] += 40.0   # a key channel far off zero (every token): what K smoothing removes
    v[..., 7] += 25.0   # a value channel likewise
    v[..., 9] *= 30.0   # an outlier value channel
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _exact(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_e4m3_heads_scale_each_head_to_the_grid():
    q, _, _ = _qkv()
    q8, scale = att.e4m3_heads(q)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape and scale.shape == (1, 4)
    back = q8.float() * scale[:, None, :, None]
    assert torch.isfinite(back).all()
    assert torch.allclose(q8.float().abs().amax(dim=(1, 3)), torch.full((1, 4), 448.0))
    assert _rel(back, q) < 0.04  # e4m3: 3 mantissa bits


def test_centred_keys_and_values_keep_attention_and_its_error_small():
    q, k, v = _qkv()
    exact = _exact(q, k, v)
    out = att.fp8_attention(q, k, v, kernel=reference_kernel)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = _rel(out, exact)
    # without centring, the offset channels set each head's scale and the rest rounds coarsely
    plain = [att.e4m3_heads(t) for t in (q, k, v)]
    uncentred = reference_kernel(*(t for t, _ in plain), q_descale=plain[0][1], k_descale=plain[1][1],
                                 v_descale=plain[2][1])
    assert err < 0.05 and err < 0.5 * _rel(uncentred, exact), (err, _rel(uncentred, exact))
    # a constant added to every key moves each query's logits by one constant: nothing changes
    shifted = att.fp8_attention(q, k + torch.linspace(-5, 5, 64).bfloat16(), v, kernel=reference_kernel)
    assert _rel(shifted, out) < 0.02


def test_the_override_takes_comfyui_layouts_and_leaves_the_rest_to_comfyui(monkeypatch):
    calls = []

    def comfy_func(*args, **kwargs):
        calls.append(kwargs)
        return "comfy"
    monkeypatch.setattr(att, "fa3_kernel", lambda: (reference_kernel, ""))
    monkeypatch.setattr(att, "FP8_MIN_TOKENS", 128)
    q, k, v = _qkv(b=2, n=256, h=4, d=64)
    # on a CPU tensor: ComfyUI's own attention
    assert att.fp8_attention_override(comfy_func, *(t.reshape(2, 256, 256) for t in (q, k, v)), 4) == "comfy"

    monkeypatch.setattr(att, "KERNEL_DEVICES", ("cuda", "cpu"))
    flat = [t.reshape(2, 256, 256) for t in (q, k, v)]
    out = att.fp8_attention_override(comfy_func, *flat, 4)
    assert out.shape == (2, 256, 256) and _rel(out, _exact(q, k, v).reshape(2, 256, 256)) < 0.05
    heads = [t.transpose(1, 2) for t in (q, k, v)]  # skip_reshape: [B, H, N, D]
    out = att.fp8_attention_override(comfy_func, *heads, 4, skip_reshape=True, skip_output_reshape=True)
    assert out.shape == (2, 4, 256, 64) and _rel(out.transpose(1, 2), _exact(q, k, v)) < 0.05
    assert len(calls) == 1
    short = [t[:, :64].reshape(2, 64, 256) for t in (q, k, v)]   # below FP8_MIN_TOKENS
    cross = [flat[0], *(t[:, :200].reshape(2, 200, 256) for t in (k, v))]  # keys of another length
    masked = dict(mask=torch.zeros(256, 256))
    for args, kw in ((short, {}), (cross, {}), (flat, masked)):
        assert att.fp8_attention_override(comfy_func, *args, 4, **kw) == "comfy"
    assert att.fp8_attention_override(comfy_func, *flat, heads=4).shape == (2, 256, 256)  # Wan: heads=
    assert len(calls) == 4


def test_shorter_self_attention_takes_flashattention3s_16bit_forward(monkeypatch):
    """Below ``FP8_MIN_TOKENS``, 128-wide heads' self-attention of ``FA3_16BIT_MIN_TOKENS``+ tokens
    runs FlashAttention-3's 16-bit forward on Q/K/V as they are (no descales; the re-statement
    here); shorter calls, other head widths, cross-attention, masks, fp32 inputs and an fp32
    ``attn_precision`` stay ComfyUI's."""
    ran = []

    def kernel(q, k, v, softmax_scale=None, causal=False, **descales):
        ran.append((q.dtype, descales))
        return reference_kernel(q, k, v, softmax_scale=softmax_scale)
    monkeypatch.setattr(att, "fa3_kernel", lambda: (kernel, ""))
    monkeypatch.setattr(att, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(att, "FP8_MIN_TOKENS", 512)
    monkeypatch.setattr(att, "FA3_16BIT_MIN_TOKENS", 128)

    def comfy_func(*args, **kwargs):
        return "comfy"
    q, k, v = _qkv(b=2, n=256, h=2, d=128)
    flat = [t.reshape(2, 256, 256) for t in (q, k, v)]
    out = att.fp8_attention_override(comfy_func, *flat, 2)
    assert out.shape == (2, 256, 256) and out.dtype == torch.bfloat16
    assert _rel(out, _exact(q, k, v).reshape(2, 256, 256)) < 0.01
    heads = [t.transpose(1, 2) for t in (q, k, v)]  # skip_reshape: [B, H, N, D]
    out = att.fp8_attention_override(comfy_func, *heads, 2, skip_reshape=True, skip_output_reshape=True)
    assert out.shape == (2, 2, 256, 128) and _rel(out.transpose(1, 2), _exact(q, k, v)) < 0.01
    assert ran == [(torch.bfloat16, {})] * 2  # 16-bit inputs, no descales
    q64, k64, v64 = _qkv(b=2, n=256, h=4, d=64)
    others = [([t[:, :64].reshape(2, 64, 256) for t in (q, k, v)], 2, {}),     # below FA3_16BIT_MIN_TOKENS
              ([t.reshape(2, 256, 256) for t in (q64, k64, v64)], 4, {}),    # 64-wide heads
              ([flat[0], *(t[:, :200].reshape(2, 200, 256) for t in (k, v))], 2, {}),  # keys of another length
              (flat, 2, dict(mask=torch.zeros(256, 256))),
              ([t.float() for t in flat], 2, {}),
              (flat, 2, dict(attn_precision=torch.float32))]
    for args, n_heads, kw in others:
        assert att.fp8_attention_override(comfy_func, *args, n_heads, **kw) == "comfy"
    assert len(ran) == 2


def test_without_the_package_the_runtime_says_why():
    kernel, why = att.fa3_kernel()
    if kernel is not None:
        pytest.skip("fa3-fwd is installed here")
    assert "fa3-fwd" in why


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="FlashAttention-3's FP8 forward needs a Hopper GPU (the GPU machine runs this)")
def test_flashattention3_computes_what_the_reference_does():
    """The kernel against its re-statement on the same e4m3 inputs, at a video length: what it
    adds is its own rounding of the softmax probabilities to e4m3 (FA3's FP8 path)."""
    kernel, why = att.fa3_kernel()
    if kernel is None:
        pytest.skip(why)
    q, k, v = (t.cuda() for t in _qkv(n=16384, h=12, d=128))
    exact = _exact(q, k, v)
    fa3, ref = att.fp8_attention(q, k, v), att.fp8_attention(q, k, v, kernel=reference_kernel)
    assert fa3.dtype == torch.bfloat16 and fa3.shape == q.shape
    assert _rel(fa3, exact) < 0.05 and _rel(fa3, ref) < 0.05, (_rel(fa3, exact), _rel(ref, exact))


def test_centred_absmax_from_the_channel_statistics_is_the_centred_tensors():
    """``centred`` reads each head's absmax off per-channel max, min and mean (one pass): exactly
    the absmax of the centred tensor it returns, in bf16 as in float32."""
    _, k, v = _qkv(b=2, n=300)
    for t in (k, v, k.float()):
        c, amax, mean = att.centred(t)
        assert torch.equal(c, t - mean) and torch.equal(amax, c.abs().amax(dim=(1, 3))), (amax, c.abs().amax(dim=(1, 3)))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="FlashAttention-3 needs a Hopper GPU (the GPU machine runs this)")
def test_flashattention3_16bit_forward_is_as_exact_as_torchs():
    """FlashAttention-3's 16-bit forward (``fa3_forward`` on 16-bit inputs) at Flux 1024x1024's length: the 16-bit
    output's rounding, as torch's SDPA (both ~0.2% from the fp32 reference)."""
    kernel, why = att.fa3_kernel()
    if kernel is None:
        pytest.skip(why)
    q, k, v = (t.cuda() for t in _qkv(n=4608, h=4, d=128))
    exact = _exact(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    out = att.fa3_forward(q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert _rel(out, exact) < 2 * _rel(sdpa, exact) + 1e-3, (_rel(out, exact), _rel(sdpa, exact))

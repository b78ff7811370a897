"""W4A8 (comfy_modelopt/w4a8.py): nvfp4 weights as stored, computed on 8-bit tensor cores.

kitchen is the oracle for the layout: its encoder writes the weights, its ``dequantize_nvfp4`` says
what they are.  On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, numpy
arithmetic) on weights and inputs whose every product is exact in E4M3 (the interpreter rounds ties
away from zero where a GPU rounds them to even, and misrounds some values just under a power of
two); on a CUDA GPU with fp8 tensor cores they run on kitchen's own encodings against
``reference``.
"""
import os
import subprocess
import sys
import textwrap

import comfy_kitchen as ck
import pytest
import torch

from comfy_modelopt import w4a8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kitchen_nvfp4(n, k, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if outliers:
        w[:, 5] *= 30.0
        w[3, :16] *= 50.0
    scale = (w.abs().max() / (448.0 * 6.0)).float()
    qdata, block_scale = ck.quantize_nvfp4(w, scale)
    return w, qdata, scale, block_scale


def test_weights_are_kitchens_dequantization_rounded_to_e4m3():
    """The E4M3 weight the kernel multiplies is kitchen's dequantized nvfp4 weight (with the
    second-level scale left out) times ``MULT``, rounded to E4M3 - value for value, for shapes
    whose block scales pad cuBLAS's tiles in both directions."""
    for n, k in ((208, 80), (256, 512)):
        _w, qdata, _scale, block_scale = _kitchen_nvfp4(n, k)
        one = torch.ones((), dtype=torch.float32)
        dequant = ck.dequantize_nvfp4(qdata, one, block_scale, torch.float32)  # value x block scale: exact
        want = (dequant * w4a8.MULT).to(w4a8.E4M3)
        got = w4a8.weight_e4m3(qdata, block_scale)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, k)
        assert float(dequant.abs().max()) * w4a8.MULT <= 448.0
        # the int8 way's weight (no fp8 tensor cores): within half its unit of the same products
        q8, unit = w4a8.weight_int8(qdata, block_scale)
        assert ((q8.float() * unit[:, None] - dequant).abs() <= unit[:, None] * (0.5 + 1e-4)).all(), (n, k)
        # each row's largest product uses the whole range (a row of zero codes stays zero)
        assert torch.equal(q8.abs().amax(dim=1) == 127, dequant.abs().amax(dim=1) * unit.reciprocal() > 126), (n, k)


def test_error_stays_near_the_dequantized_path():
    """Against the dequantized path stock ComfyUI runs (16-bit input, the nvfp4 weight), W4A8 adds
    the input's and the products' E4M3 roundings - a few percent of the output, not a scale
    factor off (each row at its own scale)."""
    n, k, m = 256, 512, 64
    w, qdata, scale, block_scale = _kitchen_nvfp4(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[:, 7] *= 20.0  # an outlier channel: every row's scale follows it
    bias = torch.randn(n) * 0.1
    dense = ck.dequantize_nvfp4(qdata, scale, block_scale, torch.float32)
    stock = x @ dense.t() + bias
    xq, sx = w4a8.rows_reference(x)
    out = w4a8.reference(xq, sx, qdata, scale, block_scale, bias, torch.float32)
    rel = float((out - stock).norm() / stock.norm())
    assert 0 < rel < 0.05, rel
    # both roundings matter and neither dominates wrongly: the input's alone is smaller
    exact_w = (xq.float() * sx[:, None]) @ dense.t() + bias
    assert float((exact_w - stock).norm() / stock.norm()) < rel


def test_usable_only_where_8bit_tensor_cores_meet_no_native_nvfp4(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not w4a8.usable(torch.device("cpu"))
    assert not w4a8.usable(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: sm)
    for sm, want in (((7, 0), None), ((7, 5), "int8"), ((8, 0), "int8"), ((8, 6), "int8"), ((8, 9), "fp8"),
                     ((9, 0), "fp8"), ((10, 0), None), ((12, 0), None)):
        assert w4a8.kind(torch.device("cuda")) == (want if w4a8.triton is not None else None), sm


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's check (the GPU test below runs the compiled kernel)")
def test_kernels_compute_the_reference_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (requirements-test.txt pins it)")
    script = textwrap.dedent("""
        import torch
        import comfy_kitchen as ck
        from comfy_kitchen.float_utils import to_blocked
        from comfy_modelopt import w4a8
        torch.manual_seed(0)
        for n, k, m in ((208, 80, 37), (128, 256, 5)):
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            qdata = (codes[:, ::2] << 4) | codes[:, 1::2]
            # power-of-two block scales from 2^-3: every product exact in E4M3 (no ties to round)
            scales = torch.exp2(torch.randint(-3, 9, (n, k // 16)).float()).to(torch.float8_e4m3fn)
            block_scale = to_blocked(scales, flatten=False)
            s2 = torch.tensor([0.013])
            # rows of E4M3 values times a power of two, each with 448 x it: every value's rounding is
            # exact (the interpreter's float32 -> E4M3 conversion misrounds some inexact ones)
            x = torch.randint(0, 256, (m, k), dtype=torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0)
            x[:, 3] = 448.0
            x = (x * torch.exp2(torch.randint(-8, 8, (m, 1)).float())).bfloat16()
            x[-1] = 0  # an all-zero row
            xq, sx = w4a8.quantize_rows(x)
            want_q, want_s = w4a8.rows_reference(x)
            assert torch.equal(sx, want_s) and torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
            # the whole weight expanded to E4M3 (the expanded way's first step) is weight_e4m3's, and
            # to int8 (the int8 way's) weight_int8's
            got_w, want_w = w4a8.expand(qdata, block_scale), w4a8.weight_e4m3(qdata, block_scale)
            assert torch.equal(got_w.view(torch.uint8), want_w.view(torch.uint8)), (n, k)
            (got_8, got_u), (want_8, want_u) = w4a8.expand_int8(qdata, block_scale), w4a8.weight_int8(qdata, block_scale)
            assert torch.equal(got_8, want_8) and torch.equal(got_u, want_u), (n, k)
            x = (torch.randn(m, k) * torch.rand(m, 1) * 3).bfloat16()
            xq, sx = w4a8.rows_reference(x)
            for bias in (torch.randn(n).bfloat16(), None):
                ref = w4a8.reference(xq, sx, qdata, s2, block_scale, bias, torch.float32)
                for config in ((16, 32, 32, 4, 1), (32, 64, 64, 4, 1), (64, 16, 128, 4, 1)):
                    out = w4a8.linear(xq, sx, qdata, s2, block_scale, bias, torch.float32, config=config)
                    err = float((out - ref).abs().max() / ref.abs().max())
                    assert err < 1e-5, (n, k, m, config, err)
                for dtype in (torch.bfloat16, torch.float16):  # torch's row-scaled GEMM writes bf16
                    out = w4a8.linear_expanded(xq, sx, qdata, s2, block_scale, bias, dtype)
                    err = float((out.float() - ref).abs().max() / ref.abs().max())
                    assert out.dtype == dtype and err < 4e-3, (n, k, m, dtype, err)
                # the int8 way: kitchen's int8 linear on weight_int8 (its own rounding of the rows)
                w8, unit = w4a8.weight_int8(qdata, block_scale)
                want = ck.int8_linear(x, w8, torch.ones(()), None, torch.float32) * (unit * s2)
                want = (want + (bias.float() if bias is not None else 0)).to(x.dtype)
                assert torch.equal(w4a8.linear_int8(x, qdata, s2, block_scale, bias), want)
                ref = x.float() @ ck.dequantize_nvfp4(qdata, s2, block_scale, torch.float32).t()
                ref = ref + (bias.float() if bias is not None else 0)
                err = float((w4a8.linear_int8(x, qdata, s2, block_scale, bias).float() - ref).norm() / ref.norm())
                assert err < 0.03, err  # the rows' and the weights' int8 roundings
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.skipif(not (torch.cuda.is_available() and w4a8.usable(torch.device("cuda"))),
                    reason="the kernel runs on a CUDA GPU with fp8 tensor cores before Blackwell (the GPU machine)")
@pytest.mark.parametrize("m", [1, 77, 4096])
def test_kernels_compute_the_reference_on_a_gpu(m):
    n, k = 3072, 3072
    _w, qdata, scale, block_scale = _kitchen_nvfp4(n, k)
    dev = torch.device("cuda")
    qdata, scale, block_scale = qdata.to(dev), scale.reshape(1).to(dev), block_scale.to(dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * torch.rand(m, 1, device=dev, dtype=torch.bfloat16)
    xq, sx = w4a8.quantize_rows(x)
    want_q, want_s = w4a8.rows_reference(x)
    assert torch.equal(sx, want_s) and torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    ref = w4a8.reference(xq, sx, qdata, scale, block_scale, bias, torch.float32)
    out = w4a8.linear(xq, sx, qdata, scale, block_scale, bias, torch.bfloat16).float()
    assert float((out - ref).norm() / ref.norm()) < 4e-3  # bf16 output rounding; the sums' order
    assert torch.equal(w4a8.expand(qdata, block_scale).view(torch.uint8),
                       w4a8.weight_e4m3(qdata, block_scale).view(torch.uint8))
    for dtype in (torch.bfloat16, torch.float16):
        out = w4a8.linear_expanded(xq, sx, qdata, scale, block_scale, bias, dtype)
        assert out.dtype == dtype and float((out.float() - ref).norm() / ref.norm()) < 4e-3, dtype
    # the int8 way's expansion (Turing/Ampere's) runs on any CUDA GPU: bit for bit its reference
    (got_8, got_u), (want_8, want_u) = w4a8.expand_int8(qdata, block_scale), w4a8.weight_int8(qdata, block_scale)
    assert torch.equal(got_8, want_8) and torch.equal(got_u, want_u)

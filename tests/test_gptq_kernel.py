"""GPTQ's block kernel (comfy_modelopt.gptq_kernel) rounds as the eager column loop does.

On a CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, numpy arithmetic):
the integer and E2M1 rounders (int8 per row, ConvRot int8 and convrot_w4a4's anchored rows,
nvfp4's anchored blocks) must match the eager loop bit for bit there - every index, mask and
stride of the kernel is exercised (rows not a multiple of the tile, a last partial block,
act-order's permuted block scales).  fp8's cast cannot be checked there (the interpreter's float32 -> e4m3 conversion
misrounds some values: Triton's, not ours), so fp8 is checked on a GPU.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from comfy_modelopt import gptq as gptq_mod
from comfy_modelopt import gptq_kernel
from comfy_modelopt.formats import get_format

from helpers import gptq_problem, gptq_without

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernel_rounds_bit_for_bit_as_the_eager_loop_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (requirements-test.txt pins it)")
    script = textwrap.dedent("""
        import torch
        from comfy_modelopt import gptq, gptq_kernel
        from comfy_modelopt.formats import get_format
        from helpers import gptq_without
        g = torch.Generator().manual_seed(3)
        for name, opts in (("int8_tensorwise", {"convrot": False}),
                           ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 64}),
                           ("convrot_w4a4", {"convrot_groupsize": 64}), ("nvfp4", {})):
            fmt = get_format(name)
            w = torch.randn(45, 320, generator=g) / 16  # 45 rows: a partial tile; 320: a partial block
            x = torch.randn(200, 320, generator=g)
            x[:, ::40] *= 25.0
            ws, xs = fmt.search_space(w, **opts), fmt.search_space(x, **opts)
            quant, _scale = fmt.gptq_rounding(ws, None, **opts)
            assert gptq_kernel.usable(ws, quant) and gptq.kernel_trusted(ws.device, quant)
            h = gptq.gram(xs)
            for act_order in (False, True):
                fused = gptq.gptq(ws, h, quant, act_order=act_order, damp=gptq.DAMPING)
                with gptq_without():
                    eager = gptq.gptq(ws, h, quant, act_order=act_order, damp=gptq.DAMPING)
                assert torch.equal(fused, eager), (name, opts, act_order, int((fused != eager).sum()))
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_kernel_is_only_for_rounders_that_say_how():
    """mxfp8's rounder rounds its anchors up on the e4m3 grid: it keeps the eager loop; so does
    everything on a CPU outside the interpreter."""
    w = torch.randn(32, 256)
    fp8, _ = get_format("float8_e4m3fn").gptq_rounding(w, None)
    nvfp4, _ = get_format("nvfp4").gptq_rounding(w, None)
    mxfp8, _ = get_format("mxfp8").gptq_rounding(w, None)
    assert getattr(mxfp8, "fused", None) is None
    assert fp8.fused.kind == "fp8" and nvfp4.fused.kind == "grid"
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not gptq_kernel.usable(w, fp8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on a CUDA GPU (the GPU machine runs this)")
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name,opts", [("float8_e4m3fn", {}), ("int8_tensorwise", {"convrot": False}),
                                       ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 64}), ("nvfp4", {})])
def test_kernel_rounds_as_the_eager_loop_on_a_gpu(name, opts, act_order):
    """On a GPU the kernel's results are the eager loop's but where the eager update's cuBLAS
    product rounded a sum differently and a value on a rounding boundary went the other way."""
    pytest.importorskip("triton")
    _fmt, ws, quant, h = gptq_problem(name, opts, 200, 640, "cuda")
    assert gptq_kernel.usable(ws, quant) and gptq_mod.kernel_trusted(ws.device, quant)
    fused = gptq_mod.gptq(ws, h, quant, act_order=act_order, damp=0.1)
    with gptq_without(graph=True):
        eager = gptq_mod.gptq(ws, h, quant, act_order=act_order, damp=0.1)
    differ = fused != eager
    assert float(differ.float().mean()) < 2e-3, float(differ.float().mean())
    assert float((fused - eager).norm() / eager.norm()) < 5e-3
    if quant.fused.kind != "grid":  # one scale per tensor or row: the rounded weights are on its grid
        assert torch.equal(quant(fused, slice(0, fused.shape[1])), fused)


def test_a_kernel_that_cannot_build_leaves_the_loop_eager(monkeypatch, caplog):
    """Where Triton cannot build or run the kernel for a rounder (no fp8 casts before Ada, no
    compiler), GPTQ must still run: a test block is checked once per device and kind, the reason
    logged, and the eager loop rounds - the same weights as without the kernel."""
    pytest.importorskip("triton", reason="Triton is not installed (requirements-test.txt pins it)")
    monkeypatch.setattr(gptq_mod, "_TRUSTED", {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a CPU device counts as the kernel's here

    def broken(*_a, **_k):
        raise RuntimeError("type fp8e4nv not supported in this architecture")
    monkeypatch.setattr(gptq_kernel, "run_block", broken)
    _fmt, ws, quant, h = gptq_problem("float8_e4m3fn", {}, 40, 256)
    with caplog.at_level("WARNING"):
        assert not (gptq_kernel.usable(ws, quant) and gptq_mod.kernel_trusted(ws.device, quant))
    assert "not used for fp8" in caplog.text and "fp8e4nv" in caplog.text
    eager = gptq_mod.gptq(ws, h, quant, act_order=True, damp=gptq_mod.DAMPING)
    with gptq_without():
        assert torch.equal(eager, gptq_mod.gptq(ws, h, quant, act_order=True, damp=gptq_mod.DAMPING))

"""GPTQ's column loop for a block of 128 columns as one Triton kernel (a CUDA GPU with Triton).
Design: docs/design.md, ``gptq_kernel.py``.
"""
from __future__ import annotations

import os

import torch

try:  # Triton comes with CUDA builds of torch on Linux; without it the eager loop runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

TILE_ROWS = 32  # rows of W per program: 128 x 32 float32 in registers (32 per thread at 4 warps)
_FP8 = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_INT8, _GRID_INT, _GRID_E2M1 = 2, 3, 4


def usable(w: torch.Tensor, quantize_columns) -> bool:
    """Whether the block kernel can be asked to run GPTQ's loop for this rounder on ``w``'s device
    (Triton is there, the rounder says how to round in it).  Whether it builds and rounds as the
    eager loop does here is ``gptq.kernel_trusted``'s to check."""
    if triton is None or getattr(quantize_columns, "fused", None) is None:
        return False
    return w.is_cuda or (w.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def run_block(w1: torch.Tensor, hinv1: torch.Tensor, q1: torch.Tensor, err1: torch.Tensor, quantize_columns,
              places: torch.Tensor) -> None:
    """One block's column loop: ``w1`` [D, B, N] (read only), ``hinv1`` [D, B, B] (the block of
    the inverse-Hessian factor), rounded columns into ``q1`` [D, B, N] and the columns' scaled
    errors into ``err1`` [D, B, N] (contiguous); ``places`` [B] (int32, on the device): each
    column's index in the weight (act-order permutes them), where per-block scales are read."""
    spec = quantize_columns.fused  # gptq.KernelRounding
    d, b, n = w1.shape
    scale, anchor, inv, mul, fmax, blk = err1, err1, 1.0, 1.0, 0.0, 1
    if spec.kind == "fp8":
        mode, inv, mul = _FP8[spec.dtype], 1.0 / float(spec.scale), float(spec.scale)
        fmax = float(torch.finfo(spec.dtype).max)
    elif spec.kind == "int8":
        mode, scale = _INT8, spec.scale
    else:  # "grid": per-(row, block) scales, anchored elements at +-qmax; integer or E2M1 values
        scale, blk, anchor, fmax = spec.scale, spec.block, spec.anchor, spec.qmax
        mode = _GRID_INT if spec.grid == "int" else _GRID_E2M1
    grid_ = (triton.cdiv(n, TILE_ROWS), d)
    _block[grid_](w1, hinv1, q1, err1, scale, anchor, places, n,
                  *w1.stride(), *hinv1.stride(), *q1.stride(), *err1.stride(), scale.stride(0), anchor.stride(0),
                  inv, mul, fmax, blk, MODE=mode, B=b, TN=TILE_ROWS, enable_fp_fusion=False)


if triton is not None:
    @triton.jit
    def _rne(v):
        """Round half to even of |v| < 2^22 (float32 arithmetic, no fused operations)."""
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def _block(W, H, Q, E, S, A, P, n, swd, swb, swn, shd, shr, shc, sqd, sqb, sqn, sed, seb, sen, ssn, san,
               inv, mul, fmax, blk, MODE: tl.constexpr, B: tl.constexpr, TN: tl.constexpr):
        d = tl.program_id(1)
        rows = tl.program_id(0) * TN + tl.arange(0, TN)
        live = rows < n
        cols = tl.arange(0, B)
        w = tl.load(W + d * swd + cols[:, None] * swb + rows[None, :] * swn, mask=live[None, :], other=0.0)
        if MODE == 2:
            s = tl.load(S + rows * ssn, mask=live, other=1.0)
        for i in range(B):
            wi = tl.sum(tl.where(cols[:, None] == i, w, 0.0), axis=0)  # column i as it stands now
            if MODE == 0:  # fp8 e4m3: (w * (1 / scale)).clamp(-fmax, fmax) -> fp8 -> float32 * scale
                q = tl.clamp(wi * inv, -fmax, fmax).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32) * mul
            elif MODE == 1:
                q = tl.clamp(wi * inv, -fmax, fmax).to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.float32) * mul
            elif MODE == 2:  # int8 per row: (w / s).round().clamp(-128, 127) * s (clamping first commutes)
                q = tl.clamp(_rne(tl.clamp(tl.div_rn(wi, s), -129.0, 128.0)), -128.0, 127.0) * s
            else:  # gptq.grid_column_quantizer: the column's block scale, anchors at +-qmax
                j = tl.load(P + i)
                sj = tl.load(S + rows * ssn + j // blk, mask=live, other=0.0)
                safe = tl.where(sj == 0.0, 1.0, sj)
                v = tl.clamp(tl.div_rn(wi, safe), -fmax, fmax)
                if MODE == 3:
                    r = _rne(v)
                else:  # E2M1: the step is 0.5 below 2, 1 below 4, 2 above; ties to even steps
                    mag = tl.abs(v)
                    step = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
                    r = _rne(tl.div_rn(mag, step)) * step
                    r = tl.where(v < 0.0, -r, r)
                a = tl.load(A + rows * san + j, mask=live, other=0) != 0
                r = tl.where(a, tl.where(wi < 0.0, -fmax, fmax), r)
                q = tl.where(sj == 0.0, 0.0, r * sj)
            h = tl.load(H + d * shd + i * shr + cols * shc)  # row i of the block's factor
            hii = tl.sum(tl.where(cols == i, h, 0.0), axis=0)
            e = tl.div_rn(wi - q, hii)
            tl.store(Q + d * sqd + i * sqb + rows * sqn, q, mask=live)
            tl.store(E + d * sed + i * seb + rows * sen, e, mask=live)
            # the error spread over the later columns (the factor is upper triangular: the earlier
            # columns get 0 * e, column i itself becomes q - it is not read again)
            w = tl.where(cols[:, None] > i, w - h[:, None] * e[None, :], w)

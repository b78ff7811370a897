"""W4A8: an nvfp4 layer computed on 8-bit tensor cores, its weight resident in 4 bits.
Design: docs/design.md, ``w4a8.py``.
"""
from __future__ import annotations

import os

import comfy_kitchen as ck
import torch
from comfy_kitchen.float_utils import fp4_x2_to_f32, from_blocked

try:  # Triton comes with CUDA builds of torch on Linux; without it nvfp4 stays dequantized
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
# the int8 way takes calls of at least this many rows: a per-sample layer's (one row a sample: the
# time and class embeddings) int8-rounded input adds its error to every pixel of the sample, where
# fp8's stays small (docs/benchmarks.md, "Turing and Ampere: the int8 way")
INT8_MIN_ROWS = 64
TINY = 2.0 ** -100  # the scale of an all-zero row (any positive number: its values round to zero)
BLOCK = 16  # nvfp4's block: one E4M3 scale per 16 weights along K


# nvfp4's encoders keep every block scale within E4M3 (at most 448: kitchen's clamps there), so
# 6 x 448 / 8 = 336 keeps every product in E4M3's range: one factor for every file, nothing to
# read from the weight first.  It costs precision only to products under 2^-3 (E4M3's smallest
# normal is 2^-6), i.e. below 1/20,000 of the layer's largest weight.
MULT = 0.125


def _products_reference(qdata: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """Each E2M1 value of ``qdata`` [N, K/2] (decoded by kitchen: the even element in the high
    nibble) times its block's scale (``block_scale``, cuBLAS's tiled layout, unswizzled with
    kitchen's ``from_blocked``): [N, K] float32, exact."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    value = fp4_x2_to_f32(qdata.contiguous())
    scales = from_blocked(block_scale.view(E4M3), num_rows=n, num_cols=k // BLOCK).float()
    return (value.reshape(n, k // BLOCK, BLOCK) * scales.unsqueeze(-1)).reshape(n, k)


def weight_e4m3(qdata: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """The E4M3 weight [N, K] the fp8 ways multiply, in torch operations: each E2M1 value times its
    block's scale times ``MULT``, rounded to E4M3."""
    return (_products_reference(qdata, block_scale) * MULT).to(E4M3)


def int8_inverse(block_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Per output channel, 127 over the largest product its row can hold (6, E2M1's largest value,
    times the row's largest block scale): [N] float32, on the weight's device."""
    top = from_blocked(block_scale.view(E4M3), num_rows=n, num_cols=k // BLOCK).float().amax(dim=1)
    return (INT8_MAX / 6.0) / top.clamp_min(TINY)


def weight_int8(qdata: torch.Tensor, block_scale: torch.Tensor) -> tuple:
    """The int8 weight [N, K] the int8 way multiplies (GPUs with int8 tensor cores and no fp8 ones),
    in torch operations, and its scale per output channel [N]: each product times its row's
    ``int8_inverse``, rounded half away from zero."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    inverse = int8_inverse(block_scale, n, k)
    p = _products_reference(qdata, block_scale) * inverse[:, None]
    return torch.where(p >= 0, p + 0.5, p - 0.5).trunc().clamp(-127, 127).to(torch.int8), 1.0 / inverse


def rows_reference(x: torch.Tensor) -> tuple:
    """``quantize_rows``'s arithmetic in torch operations."""
    # times the reciprocal: what torch's CUDA kernels do for a division by a number
    scale = (x.abs().amax(dim=1).float() * (1.0 / E4M3_MAX)).clamp_min(TINY)
    return (x.float() * (1.0 / scale)[:, None]).to(E4M3), scale


def reference(xq, scale_x, qdata, scale_2, block_scale, bias=None, out_dtype=torch.bfloat16):
    """``linear``'s arithmetic in torch operations."""
    acc = xq.float() @ weight_e4m3(qdata, block_scale).float().t()
    out = acc * (scale_x.float()[:, None] * scale_2.float() / MULT)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def kind(device: torch.device) -> str | None:
    """The 8-bit tensor cores W4A8 computes on, on ``device`` before native nvfp4: "fp8" (SM 8.9 - 9.x:
    Ada, Hopper), "int8" (SM 7.5 - 8.8: Turing, Ampere), None (none, no Triton, or Blackwell); on a
    CPU "fp8" only in Triton's interpreter (tests)."""
    if triton is None or device.type not in ("cpu", "cuda"):
        return None
    if device.type == "cpu":
        return "fp8" if os.environ.get("TRITON_INTERPRET") == "1" else None
    sm = torch.cuda.get_device_capability(device)
    return "fp8" if (8, 9) <= sm < (10, 0) else "int8" if (7, 5) <= sm < (8, 9) else None


def usable(device: torch.device) -> bool:
    """W4A8 runs on ``device`` (``kind``)."""
    return kind(device) is not None


def linear(xq, scale_x, qdata, scale_2, block_scale, bias=None, out_dtype=torch.bfloat16,
           config: tuple | None = None) -> torch.Tensor:
    """``xq`` [M, K] (E4M3, row i at ``scale_x[i]``: ``quantize_rows``) times the nvfp4 weight (``qdata``
    [N, K/2] uint8, ``scale_2`` its second-level scale, ``block_scale`` as stored), + ``bias``:
    [M, N] ``out_dtype``.  ``config``: (BM, BN, BK, warps, stages); by default ``pick_config``'s."""
    m, k = xq.shape
    n = qdata.shape[0]
    if k != qdata.shape[1] * 2:
        raise ValueError(f"W4A8: the input has {k} columns, the weight {qdata.shape[1] * 2}")
    out = torch.empty(m, n, device=xq.device, dtype=out_dtype)
    if m == 0:
        return out
    bm, bn, bk, warps, stages = config or pick_config(m, n, k)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _kernel[grid](xq, qdata, block_scale.view(torch.uint8), out, bias if bias is not None else out, scale_x, scale_2,
                  m, n, k, triton.cdiv(k // BLOCK, 4), xq.stride(0), qdata.stride(0), out.stride(0),
                  HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def expand(qdata: torch.Tensor, block_scale: torch.Tensor, config: tuple = (64, 256, 4)) -> torch.Tensor:
    """``weight_e4m3`` in one kernel: the E4M3 weight [N, K] (1 byte a weight, read from the 4-bit
    one as stored).  ``config``: (rows, columns, warps) of a program's tile."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    out = torch.empty(n, k, device=qdata.device, dtype=E4M3)
    bn, bk, warps = config
    _expand_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        qdata, block_scale.view(torch.uint8), out, n, k, triton.cdiv(k // BLOCK, 4), qdata.stride(0), out.stride(0),
        BN=bn, BK=bk, num_warps=warps)
    return out


def linear_expanded(xq, scale_x, qdata, scale_2, block_scale, bias=None, out_dtype=torch.bfloat16,
                    fast_accum: bool = True):
    """``linear``'s product another way, for many rows: the weight expanded to E4M3 by ``expand``
    into a buffer that lives for the call (half the 16-bit weight's bytes: the dequantized path's
    holds all of them), then torch's fp8 GEMM with a scale per row of the input and one for the
    weight.  The expansion is paid once per call, not once per tile of rows as in ``linear``.
    Torch's row-scaled fp8 GEMM writes bf16 (its CUTLASS kernel): another ``out_dtype`` is a cast.
    ``fast_accum``: Hopper's fast fp8 accumulation (its error is a small fraction of the E4M3
    roundings' - docs/benchmarks.md, "4-bit weights on 8-bit tensor cores")."""
    n = qdata.shape[0]
    scale_b = (scale_2.float().reshape(1, 1) * (1.0 / MULT)).expand(1, n).contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16)
    out = torch._scaled_mm(xq, expand(qdata, block_scale).t(), scale_a=scale_x.float().reshape(-1, 1),
                           scale_b=scale_b, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def expand_int8(qdata: torch.Tensor, block_scale: torch.Tensor, config: tuple = (64, 256, 4)) -> tuple:
    """``weight_int8`` in one kernel (and one reduction for the scales): (the int8 weight [N, K], its
    scale per output channel [N])."""
    n, k = qdata.shape[0], qdata.shape[1] * 2
    out = torch.empty(n, k, device=qdata.device, dtype=torch.int8)
    inverse = int8_inverse(block_scale, n, k)
    bn, bk, warps = config
    _expand_int8_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        qdata, block_scale.view(torch.uint8), inverse, out, n, k, triton.cdiv(k // BLOCK, 4), qdata.stride(0),
        out.stride(0), BN=bn, BK=bk, num_warps=warps)
    return out, 1.0 / inverse


def linear_int8(x, qdata, scale_2, block_scale, bias=None, out_dtype=None, expand=expand_int8) -> torch.Tensor:
    """``x`` [M, K] (16-bit) times the nvfp4 weight on int8 tensor cores: the weight expanded to int8
    for the call (``expand``: ``expand_int8``, or ``weight_int8`` where Triton cannot run), kitchen's
    int8 linear (the input rounded to int8 per row, as the int8 format runs) summing to float32,
    then each output channel's scale (kitchen's takes one for the tensor, which 127 levels cannot
    stretch over nvfp4's block scales - docs/benchmarks.md, "Turing and Ampere: the int8 way")."""
    w, unit = expand(qdata, block_scale)
    acc = ck.int8_linear(x, w, torch.ones((), device=x.device), None, torch.float32)
    out = acc * (unit * scale_2.float())
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype or x.dtype)


def quantize_rows(x: torch.Tensor) -> tuple:
    """``x`` [M, K] (16-bit, contiguous) rounded to E4M3 with one scale per row (its largest
    magnitude / 448): (xq [M, K], scale [M] float32), in one kernel (each row read twice, the
    second time from L2)."""
    m, k = x.shape
    xq = torch.empty(m, k, device=x.device, dtype=E4M3)
    scale = torch.empty(m, device=x.device, dtype=torch.float32)
    if m:
        _rows_kernel[(m,)](x, xq, scale, k, x.stride(0), xq.stride(0), BK=min(4096, triton.next_power_of_2(k)))
    return xq, scale


def pick_config(m: int, n: int, k: int) -> tuple:
    """Tile shape for an [M, K] x [K, N] product: the fastest of ``benchmarks/speed.py --w4a8``'s
    candidates on Flux's shapes on Hopper (docs/benchmarks.md, "4-bit weights on 8-bit tensor
    cores")."""
    if m <= 64:
        return 16, 64, 256, 4, 3
    if m <= 1024 and n <= 3072:
        return 64, 64, 128, 4, 4
    return 128, 128, 128, 8, 3


if triton is not None:
    @triton.jit
    def _products(w_ptr, s_ptr, offs_n, k0, N, K, NCB, stride_w, BN: tl.constexpr, BK: tl.constexpr):
        """The tile [BN, BK] from column ``k0`` of E2M1 value x block scale (exact in float32), read
        from the weight as stored."""
        offs_h = tl.arange(0, BK // 2)
        offs_s = tl.arange(0, BK // 16)
        # a block scale's place in cuBLAS's tiled layout (kitchen's to_blocked): tiles of 128 rows x
        # 4 blocks, 512 bytes each, row r at (r % 32) * 16 + (r // 32 % 4) * 4 within its tile
        row_part = (offs_n // 128) * NCB * 512 + (offs_n % 32) * 16 + (offs_n // 32 % 4) * 4
        packed = tl.load(w_ptr + offs_n[:, None] * stride_w + (k0 // 2 + offs_h)[None, :],
                         mask=(offs_n[:, None] < N) & ((k0 // 2 + offs_h)[None, :] < K // 2), other=0)
        kb = k0 // 16 + offs_s
        sb = tl.load(s_ptr + row_part[:, None] + ((kb // 4) * 512 + kb % 4)[None, :],
                     mask=(offs_n[:, None] < N) & (kb[None, :] < K // 16), other=0)
        codes = tl.interleave(packed >> 4, packed & 15).to(tl.uint16)  # even elements: high nibble
        # an E2M1 code's bits placed in a float16's (sign 15, exponent+mantissa 11..9) are its
        # value x 2^-14 exactly, subnormal codes included
        half = (((codes & 7) << 9) | ((codes & 8) << 12)).to(tl.float16, bitcast=True)
        block = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0  # 2^14
        w = tl.reshape(half.to(tl.float32), (BN, BK // 16, 16)) * block[:, :, None]
        return tl.reshape(w, (BN, BK))

    @triton.jit
    def _expand_kernel(w_ptr, s_ptr, out_ptr, N, K, NCB, stride_w, stride_o, BN: tl.constexpr, BK: tl.constexpr):
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        k0 = tl.program_id(1) * BK
        offs_k = k0 + tl.arange(0, BK)
        w = (_products(w_ptr, s_ptr, offs_n, k0, N, K, NCB, stride_w, BN, BK) * 0.125).to(tl.float8e4nv)  # MULT
        tl.store(out_ptr + offs_n[:, None] * stride_o + offs_k[None, :], w,
                 mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))

    @triton.jit
    def _expand_int8_kernel(w_ptr, s_ptr, inv_ptr, out_ptr, N, K, NCB, stride_w, stride_o, BN: tl.constexpr,
                            BK: tl.constexpr):
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        k0 = tl.program_id(1) * BK
        offs_k = k0 + tl.arange(0, BK)
        inverse = tl.load(inv_ptr + offs_n, mask=offs_n < N, other=0.0)
        p = _products(w_ptr, s_ptr, offs_n, k0, N, K, NCB, stride_w, BN, BK) * inverse[:, None]
        q = tl.minimum(tl.maximum(tl.where(p >= 0, p + 0.5, p - 0.5).to(tl.int32), -127), 127)  # half away
        tl.store(out_ptr + offs_n[:, None] * stride_o + offs_k[None, :], q.to(tl.int8),
                 mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))

    @triton.jit
    def _kernel(x_ptr, w_ptr, s_ptr, out_ptr, bias_ptr, sx_ptr, s2_ptr, M, N, K, NCB, stride_x, stride_w, stride_o,
                HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        per_group = GROUP_M * tiles_n  # grouped order: neighbouring programs share weight tiles in L2
        first_m = (pid // per_group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows
        pid_n = (pid % per_group) // rows
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :],
                        mask=(offs_m[:, None] < M) & ((k0 + offs_k)[None, :] < K), other=0.0)
            w = (_products(w_ptr, s_ptr, offs_n, k0, N, K, NCB, stride_w, BN, BK) * 0.125).to(tl.float8e4nv)  # MULT
            acc = tl.dot(x, tl.trans(w), acc)
        sx = tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)
        acc = acc * (sx[:, None] * (tl.load(s2_ptr) * 8.0))  # 1 / MULT
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def _rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BK)
        top = tl.zeros((BK,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            top = tl.maximum(top, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(top, axis=0) * (1.0 / 448.0), 7.888609052210118e-31)  # TINY
        inverse = tl.math.div_rn(1.0, scale)  # IEEE, as torch's
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BK):  # the row again, from L2
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            tl.store(q_ptr + row * stride_q + k0 + offs, (x.to(tl.float32) * inverse).to(tl.float8e4nv),
                     mask=k0 + offs < K)

"""GPTQ: error-compensated rounding (Frantar et al., 2022), for formats whose scales are fixed
before rounding and that kitchen re-encodes exactly from the rounded values.
Design: docs/design.md, ``gptq.py``.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from . import gptq_kernel

# the damping (a fraction of the mean diagonal added to H): one pass per layer at 0.1 - choosing it
# per layer on held-out prompts gained nothing measurable at twice the time (docs/algorithms.md,
# "Defaults")
DAMPING = 0.1


def gram(x: torch.Tensor) -> torch.Tensor:
    """X^T X / m in float32 (undamped).  float32 throughout, as GPTQ's reference code: the damped
    Hessian is well conditioned, and float64 made a CPU's GPTQ slower for no gain (docs/algorithms.md,
    "Defaults")."""
    x = x.float()
    with full_float32():
        return x.T @ x / max(x.shape[0], 1)


@contextmanager
def full_float32():
    """float32 products in full float32 while GPTQ runs, whatever the process set (TF32 keeps 10
    mantissa bits: too few for the Hessian and the error propagation)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    """``h`` + damp * mean(diag(h)) * I (a new tensor)."""
    d = torch.diagonal(h)
    return h + torch.eye(h.shape[0], dtype=h.dtype, device=h.device) * (damp * float(d.mean()) + 1e-12)


def gptq(w: torch.Tensor, h: torch.Tensor, quantize_columns: Callable[[torch.Tensor, slice], torch.Tensor],
         block: int = 128, act_order: bool = False, damp: float = 0.0) -> torch.Tensor:
    """Rounded weight (on the quantization grid) of w [N, K] given H [K, K] (``damped`` by
    ``damp`` first where it is given).

    ``quantize_columns(cols, index)`` rounds a [N, c] slice of columns (``index`` their position
    in ``w``), with scales that are already fixed.  ``act_order``: round the columns in order of
    decreasing H diagonal (the inputs with the most energy first, while the most columns are
    left to absorb their error); the scales stay those of the columns' own blocks."""
    with full_float32():
        return _gptq_batch(w, [damped(h, damp) if damp else h], quantize_columns, block, _order(h, act_order))[0]


def _order(h: torch.Tensor, act_order: bool) -> torch.Tensor | None:
    """act-order's column order: decreasing input energy, read on the undamped H (a damping adds
    the same to every diagonal entry - in float32 it can round near-ties apart differently)."""
    return torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None


def _gptq_batch(w: torch.Tensor, hs: list[torch.Tensor], quantize_columns, block: int,
                order: torch.Tensor | None) -> list[torch.Tensor]:
    k, d = w.shape[1], len(hs)
    # column-major, [D, K, N]: each column's step updates whole contiguous rows of the block
    wb = w.T.float().to(memory_format=torch.contiguous_format).expand(d, -1, -1).clone()
    hinv = torch.empty(d, k, k, dtype=torch.float32, device=w.device)
    for b, h in enumerate(hs):
        dead = torch.diagonal(h) == 0
        h = h.float().clone()
        h[dead, dead] = 1.0
        wb[b, dead] = 0.0
        if order is not None:
            h = h[order][:, order]
        # one factorisation per Hessian: batched Cholesky of large matrices is far slower on a
        # GPU than one call each (benchmarks/cost.py gptq)
        hinv[b] = _upper_inverse_factor(h)
        del h
    if order is not None:
        wb = wb[:, order]
    places = order.tolist() if order is not None else None  # on the host once: no sync per column
    q = torch.empty_like(wb)
    fused = block == 128 and gptq_kernel.usable(wb, quantize_columns) and kernel_trusted(wb.device, quantize_columns)
    graph = _BlockGraph.make(wb, block, quantize_columns) if k >= 2 * block and not fused else None
    err_block = torch.empty(d, block, w.shape[0], dtype=torch.float32, device=w.device) if fused else None
    if fused:  # each column's place in w, where the kernel reads its block scale and anchors
        places_at = (order if order is not None else torch.arange(k, device=w.device)).to(torch.int32)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        if fused and i2 - i1 == block:
            err1 = err_block
            gptq_kernel.run_block(wb[:, i1:i2], hinv[:, i1:i2, i1:i2], q[:, i1:i2], err1, quantize_columns,
                                  places_at[i1:i2])
        elif graph is not None and i2 - i1 == block:
            err1 = graph.run(wb[:, i1:i2], hinv[:, i1:i2, i1:i2], q[:, i1:i2])
        else:
            w1 = wb[:, i1:i2].clone()  # [D, B, N]
            err1 = torch.empty_like(w1)
            _columns(w1, hinv[:, i1:i2, i1:i2], err1, q[:, i1:i2], quantize_columns, i1, places)
        wb[:, i2:].baddbmm_(hinv[:, i1:i2, i2:].transpose(1, 2), err1, alpha=-1)
    del graph
    if order is not None:
        q = q[:, torch.argsort(order)]
    # row-major again: a transposed view would reach the encoder, and fp8 scaled_mm refuses its
    # qdata (cuBLASLt multiplies only row- by column-major)
    return list(q.transpose(1, 2).contiguous())


@dataclass(frozen=True)
class KernelRounding:
    """How a column rounder rounds, for GPTQ's block kernel (``gptq_kernel``; a rounder without
    one keeps the eager loop): fp8 - one ``scale`` (float) and the fp8 ``dtype``; int8 - a
    ``scale`` per row; grid - a ``scale`` per (row, ``block`` of columns), ``anchor`` elements at
    +-``qmax``, values on the ``grid`` ("int": integers; "e2m1": nvfp4's) ``round_fn`` rounds to."""
    kind: str  # "fp8" | "int8" | "grid"
    scale: object
    dtype: torch.dtype | None = None
    block: int = 1
    anchor: torch.Tensor | None = None
    qmax: float = 0.0
    grid: str | None = None
    round_fn: Callable | None = None

    @property
    def variant(self):
        """What makes the kernel's code differ within a kind (checked once per device and variant)."""
        return self.dtype if self.kind == "fp8" else self.grid


_TRUSTED: dict = {}  # (device, rounder kind and variant) -> None where the block kernel works, else why not


def kernel_trusted(device: torch.device, quantize_columns) -> bool:
    """Whether the block kernel rounds as the eager loop does for rounders of this kind on
    ``device``: checked once per device and kind on a test block (Triton cannot cast to fp8
    before Ada, say); where not, the reason is logged and the loop runs without the kernel."""
    spec = quantize_columns.fused
    key = (str(device), spec.kind, spec.variant)
    if key not in _TRUSTED:
        _TRUSTED[key] = _kernel_check(device, spec)
        if _TRUSTED[key] is not None:
            logging.warning(f"[comfy-modelopt] GPTQ's block kernel is not used for {key[1]} on {key[0]}: "
                            f"{_TRUSTED[key]}; the column loop runs without it")
    return _TRUSTED[key] is None


def _kernel_check(device: torch.device, spec: KernelRounding) -> str | None:
    """One block of a small problem with a rounder of ``spec``'s kind through the kernel and
    through the eager loop: None where they agree, else the reason not to use the kernel."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g).to(device)
    hinv = _upper_inverse_factor(damped(gram(torch.randn(256, 128, generator=g)), 0.1)).to(device)
    if spec.kind == "fp8":
        quant = fp8_column_quantizer(float(w.abs().max()) / float(torch.finfo(spec.dtype).max), spec.dtype)
    elif spec.kind == "int8":
        quant = int8_column_quantizer(w.abs().amax(dim=1) / 127.0)
    else:
        scale = w.abs().reshape(64, 8, 16).amax(dim=-1) / spec.qmax
        quant = grid_column_quantizer(scale, 16, anchors(w, 16), spec.qmax, spec.round_fn, grid=spec.grid)
    wb = w.T.contiguous()[None]  # [1, B, N], as the layer's loop holds it
    try:
        q1, e1 = torch.empty_like(wb), torch.empty_like(wb)
        gptq_kernel.run_block(wb, hinv[None], q1, e1, quant, torch.arange(128, dtype=torch.int32, device=device))
        q2, e2 = torch.empty_like(wb), torch.empty_like(wb)
        _columns(wb.clone(), hinv[None], e2, q2, quant, 0, None)
    except Exception as e:  # noqa: BLE001 - a compiler or driver that cannot build it: the loop stays eager
        return f"{type(e).__name__}: {str(e)[:200]}"
    differ = float((q1 != q2).float().mean())
    return None if differ < 0.01 else f"it rounded {differ:.1%} of a test block apart from the eager loop"


def _columns(w1, hinv1, err1, q1, quantize_columns, i1: int, places) -> None:
    """One block's column loop: each column rounded (into ``q1``), its error (into ``err1``)
    spread over the block's later columns of ``w1`` in place."""
    for i in range(w1.shape[1]):
        col = w1[:, i]  # [D, N]: the batch's copies of one column, rounded as [N, D] columns
        j = i1 + i if places is None else places[i1 + i]  # the column's place in w
        qc = quantize_columns(col.T, slice(j, j + 1)).T
        q1[:, i] = qc
        e = err1[:, i]
        torch.div(col - qc, hinv1[:, i, i, None], out=e)
        # the error spread over the block's later columns: a batched outer product, in place
        w1[:, i + 1:].baddbmm_(hinv1[:, i, i + 1:, None], e[:, None, :], alpha=-1)


class _BlockGraph:
    """A block's column loop captured once as a CUDA graph and replayed for every full block of
    the layer: on a GPU the loop is a few tiny kernels per column, launch-bound eagerly.  Only for column rounders that ignore the column's index
    (``index_free``: fp8's per-tensor, int8's per-row scales) - the others read per-block scales
    and anchors by index and stay eager; so does any layer whose capture fails.  The replays run
    the eager loop's kernels, but captured cuBLAS may sum a block's products in another order, so
    a value on a rounding boundary can round the other way (tests/test_lowrank_gptq.py bounds the
    differences)."""

    @classmethod
    def make(cls, wb: torch.Tensor, block: int, quantize_columns) -> "_BlockGraph | None":
        if not (wb.is_cuda and getattr(quantize_columns, "index_free", False)):
            return None
        try:
            return cls(wb, block, quantize_columns)
        except Exception as e:  # noqa: BLE001 - the eager loop is always there
            from .cuda_streams import keep_forever
            keep_forever(e)  # a failed capture's memory must never be freed (cuda_streams.keep_forever)
            return None

    def __init__(self, wb: torch.Tensor, block: int, quantize_columns):
        from .cuda_streams import on_side_stream, shared_graph_pool
        d, _k, n = wb.shape
        self.w1 = torch.zeros(d, block, n, device=wb.device)
        self.hinv1 = torch.eye(block, device=wb.device).expand(d, -1, -1).clone()
        self.err1, self.q1 = torch.empty_like(self.w1), torch.empty_like(self.w1)

        def body():
            _columns(self.w1, self.hinv1, self.err1, self.q1, quantize_columns, 0, None)
        on_side_stream(body, wb.device)  # warm-up outside the capture
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=shared_graph_pool(), capture_error_mode="thread_local"):
            body()

    def run(self, w1: torch.Tensor, hinv1: torch.Tensor, q1: torch.Tensor) -> torch.Tensor:
        """The block's loop on ``w1`` / ``hinv1`` (views of the layer's), rounded columns into
        ``q1``; returns the block's errors (valid until the next ``run``)."""
        self.w1.copy_(w1)
        self.hinv1.copy_(hinv1)
        self.graph.replay()
        q1.copy_(self.q1)
        return self.err1


def _upper_inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H^-1 (U^T U = H^-1; GPTQ's per-column weights), from one
    factorisation: with P the reversal permutation and P H P = L L^T, U = P L^-1 P (then
    U^T U = P L^-T L^-1 P = (P H P)^-1 reversed = H^-1, and U is upper triangular) - a Cholesky
    and a triangular inverse instead of GPTQ's Cholesky, inverse and second Cholesky."""
    # on a CPU in float64: LAPACK's blocked float32 factorisation rounds differently with the
    # thread count, and GPTQ's rounding followed it - the same file differed between machines;
    # float64's differences vanish in the cast back (GPUs keep float32)
    dtype = h.dtype
    if h.device.type == "cpu":
        h = h.double()
    lo = torch.linalg.cholesky(h.flip(0, 1))
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.solve_triangular(lo, eye, upper=False).flip(0, 1).to(dtype)


def fp8_column_quantizer(scale: float, dtype: torch.dtype):
    fmax = float(torch.finfo(dtype).max)

    def quant(cols, _index):
        return (cols * (1.0 / scale)).clamp(-fmax, fmax).to(dtype).float() * scale
    quant.index_free = True  # one scale for every column: a block's loop can be a CUDA graph
    quant.fused = KernelRounding("fp8", scale, dtype)  # ... or one Triton kernel (gptq_kernel)
    return quant


def int8_column_quantizer(row_scale: torch.Tensor):
    s = row_scale.reshape(-1, 1).float()

    def quant(cols, _index):
        return (cols / s).round().clamp(-128, 127) * s
    quant.index_free = True  # per-row scales, the same for every column
    quant.fused = KernelRounding("int8", s)
    return quant


def anchors(w: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] mask of the largest |w| of each row's blocks of ``block`` columns (K % block == 0)."""
    n, k = w.shape
    idx = w.abs().reshape(n, k // block, block).argmax(dim=-1)
    mask = torch.zeros(n, k // block, block, dtype=torch.bool, device=w.device)
    mask.scatter_(-1, idx.unsqueeze(-1), True)
    return mask.reshape(n, k)


def grid_column_quantizer(scale: torch.Tensor, block: int, anchor: torch.Tensor, qmax: float,
                          round_fn: Callable[[torch.Tensor], torch.Tensor],
                          anchor_to: Callable[[torch.Tensor], torch.Tensor] | None = None, grid: str | None = None):
    """Columns rounded on a grid ``round_fn`` (values in [-qmax, qmax]) with one fixed scale per
    row and block of ``block`` columns (``scale`` [N, K / block]); anchored elements go to
    +-qmax, or to +-``anchor_to(|v|)`` of their scaled magnitude.  A zero scale (an all-zero
    block) rounds to zero.  ``grid``: which grid ``round_fn`` rounds to, for the block kernel
    ("int": integers, half to even; "e2m1": nvfp4's values) - None keeps the eager loop."""
    scale = scale.float()

    def quant(cols, index):
        b = index.start // block
        s = scale[:, b:b + 1]
        safe = torch.where(s == 0, torch.ones_like(s), s)
        v = (cols / safe).clamp(-qmax, qmax)
        q = round_fn(v)
        a = anchor[:, index]
        to = qmax if anchor_to is None else anchor_to(v.abs())
        q = torch.where(a, torch.where(cols < 0, -to, to), q)
        return torch.where(s == 0, torch.zeros_like(q), q * s)
    if grid is not None and anchor_to is None:
        quant.fused = KernelRounding("grid", scale.contiguous(), block=block, qmax=float(qmax), grid=grid,
                                     anchor=anchor.to(torch.uint8).contiguous(), round_fn=round_fn)
    return quant


def e4m3_up(mag: torch.Tensor, floor: float = 240.0) -> torch.Tensor:
    """``max(mag, floor)`` rounded up (away from zero) on the e4m3 grid: an mxfp8 anchor at 240 or
    above keeps its block's maximum in (224, 448] scales, the binade kitchen derives the scale from."""
    mag = mag.clamp(min=floor)
    up = mag.to(torch.float8_e4m3fn)
    below = up.float() < mag  # nearest went down: the next grid value (bit pattern + 1)
    return torch.where(below, (up.view(torch.uint8) + 1).view(torch.float8_e4m3fn), up).float()


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float8_e4m3fn).float()

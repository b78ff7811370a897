"""nvfp4 layers on 8-bit tensor cores before Blackwell (``w4a8``): the lean forward that rounds
the input to E4M3 at one scale per row and multiplies it on fp8 tensor cores with the weight as
ComfyUI holds it - in one kernel that expands the 4-bit weight tile by tile (``w4a8.linear``: for
few rows), or by expanding the whole weight to E4M3 for the call and running torch's fp8 GEMM
(``w4a8.linear_expanded``: for many) - or, on a GPU with int8 tensor cores and no fp8 ones
(Turing, Ampere), with the weight expanded to int8 for the call (``w4a8.linear_int8``) - or the
dequantized path (kitchen's dequantization + one 16-bit GEMM, what stock ComfyUI runs), whichever
measured fastest for the call's shape on this GPU.  Design: docs/design.md, ``comfyui/fourbit.py``.
"""
from __future__ import annotations

import logging

import torch

from .. import w4a8

_CHOICE: dict = {}  # (rows, N, K, dtype, device) -> the way that measured fastest
# the one-kernel way is timed up to this many rows: it re-expands the weight for every tile of rows,
# and from a few thousand rows on it measured slower than both others on every Flux shape
# (docs/benchmarks.md, "4-bit weights on 8-bit tensor cores") - no kernel to compile for them
MAX_ROWS = 1024


def usable(module, device) -> bool:
    """W4A8 can run ``module`` (an nvfp4 layer ComfyUI holds) on ``device``: fp8 tensor cores without
    native nvfp4, Triton, and a weight stored unpadded (its 16-padding would have to be cut from
    every output) and untransposed."""
    w = getattr(module, "weight", None)
    p = getattr(w, "_params", None)
    if not (w4a8.usable(device) and p is not None and hasattr(p, "block_scale")):
        return False
    return (not getattr(p, "transposed", False) and tuple(p.orig_shape) == (w._qdata.shape[0], w._qdata.shape[1] * 2)
            and w._qdata.dtype == torch.uint8)


def bias_of(module, x):
    b = module.bias
    return b if b is None or (b.dtype == x.dtype and b.device == x.device) else b.to(device=x.device, dtype=x.dtype)


_LINEAR = {"one kernel": w4a8.linear, "expanded": w4a8.linear_expanded}


def _product(module, x2, way: str):
    w = module.weight
    if way == "int8":
        return w4a8.linear_int8(x2, w._qdata, w._params.scale, w._params.block_scale, bias_of(module, x2))
    xq, scale = w4a8.quantize_rows(x2)
    return _LINEAR[way](xq, scale, w._qdata, w._params.scale, w._params.block_scale, bias_of(module, x2), x2.dtype)


def _ways(module, x2, dequantized) -> dict:
    ways = {"dequantized": lambda: dequantized(module, x2)}
    if w4a8.kind(x2.device) == "int8":  # no fp8 tensor cores: the weight expanded to int8
        return {"int8": lambda: _product(module, x2, "int8"), **ways} if x2.shape[0] >= w4a8.INT8_MIN_ROWS else ways
    ways["expanded"] = lambda: _product(module, x2, "expanded")
    if x2.shape[0] <= MAX_ROWS:
        ways["one kernel"] = lambda: _product(module, x2, "one kernel")
    return ways


def untimed(rows: int, device) -> str:
    """The way of a shape that was not timed (a CUDA-graph capture; Triton's interpreter on a CPU)."""
    if w4a8.kind(device) == "int8":
        return "int8" if rows >= w4a8.INT8_MIN_ROWS else "dequantized"
    return "one kernel" if rows <= MAX_ROWS else "expanded"


def forward(module, x, dequantized):
    """The lean forward of an nvfp4 layer ``usable`` found W4A8 for; ``dequantized(module, x)``:
    stock ComfyUI's computation of the layer before Blackwell (``lean``'s)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    key = (x2.shape[0], module.weight._qdata.shape[0], x2.shape[1], x2.dtype, x2.device)
    way = _CHOICE.get(key)
    if way is None:
        if not x2.is_cuda or torch.cuda.is_current_stream_capturing():
            way = untimed(x2.shape[0], x2.device)  # on a CPU only Triton's interpreter gets here (tests)
        else:
            took = _timed(_ways(module, x2, dequantized))
            way = _CHOICE[key] = min(took, key=took.get)
            logging.info(f"[comfy-modelopt] W4A8: {key[0]} rows x {key[2]} -> {key[1]} runs {way} ("
                         + ", ".join(f"{name} {ms:.3f} ms" for name, ms in took.items()) + ")")
    if way == "dequantized":
        return dequantized(module, x)
    out = _product(module, x2, way)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _timed(ways: dict, reps: int = 3) -> dict:
    """Milliseconds a call of each of ``ways`` (name -> call) on the current CUDA stream (``reps``
    calls after a warm one); a way that raises is left out (the dequantized one is stock ComfyUI's)."""
    took = {}
    for name, fn in ways.items():
        try:
            fn()  # warm: Triton's compilation, cuBLAS's heuristics
        except RuntimeError as e:
            logging.info(f"[comfy-modelopt] W4A8: the {name} way cannot run here ({e})")
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        took[name] = start.elapsed_time(end) / reps
    return took

"""nvfp4 layers on 8-bit tensor cores before Blackwell (``w4a8``): the lean forward that rounds
the input to E4M3 at one scale per row and runs the W4A8 kernel on the weight as
ComfyUI holds it - or the dequantized path (kitchen's dequantization + one 16-bit GEMM, what stock
ComfyUI runs), whichever measured faster for the call's shape on this GPU; calls of more than
``MAX_ROWS`` rows take the dequantized path untimed.

The choice is made by timing both on the first eager call of each shape (CUDA events, a warm call
then three each); a call inside a CUDA-graph capture never times - it takes W4A8
where no choice was made yet (the graph runtime warms up eagerly first, so it rarely has to).
Compiled blocks leave these layers opaque (their forward decides per call, as here).
"""
from __future__ import annotations

import torch

from .. import w4a8
from .records import ATTR

_CHOICE: dict = {}  # (rows, N, K, dtype, device) -> True where W4A8 measured faster
# more rows than this go the dequantized way untimed: W4A8 measured slower from a few thousand rows
# on every Flux shape (docs/benchmarks.md, "4-bit weights on 8-bit tensor cores") - no kernel to
# compile, nothing to time
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


def _w4a8(module, x2):
    w = module.weight
    xq, scale = w4a8.quantize_rows(x2)
    return w4a8.linear(xq, scale, w._qdata, w._params.scale, w._params.block_scale, bias_of(module, x2), x2.dtype)


def forward(module, x, dequantized):
    """The lean forward of an nvfp4 layer ``usable`` found W4A8 for; ``dequantized(module, x)``:
    stock ComfyUI's computation of the layer before Blackwell (``lean``'s)."""
    if x.numel() > MAX_ROWS * x.shape[-1]:
        return dequantized(module, x)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    key = (x2.shape[0], module.weight._qdata.shape[0], x2.shape[1], x2.dtype, x2.device)
    use = _CHOICE.get(key)
    if use is None:
        if x2.is_cuda and torch.cuda.is_current_stream_capturing():
            use = True
        else:
            # on a CPU only Triton's interpreter gets here (tests): nothing to time
            use = _CHOICE[key] = not x2.is_cuda or _faster(lambda: _w4a8(module, x2), lambda: dequantized(module, x2))
    if not use:
        return dequantized(module, x)
    out = _w4a8(module, x2)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _faster(a, b, reps: int = 3) -> bool:
    """Whether ``a()`` runs faster than ``b()`` on the current CUDA stream (``reps`` calls each)."""
    def took(fn):
        fn()  # warm: Triton's compilation, cuBLAS's heuristics
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    return took(a) < took(b)


def count(diffusion_model) -> int:
    """How many layers of ``diffusion_model`` run ``forward``."""
    return sum(1 for m in diffusion_model.modules()
               if getattr(m.__dict__.get(ATTR), "lean_kernel", None) == ("w4a8",))

"""One layer: its ``steps`` (smoothing, low-rank branch, input scale, weight clip, GPTQ, ...),
kitchen's encoding, and ``measure`` (the layer's report).  Design: docs/design.md, ``layer.py``.
"""
from __future__ import annotations

import torch

from .errors import QuantizeError
from .fileformat import (COMFY_QUANT, INPUT_SCALE, LOWRANK_DOWN, LOWRANK_UP, SMOOTH_SCALE, SUFFIX_KEYS,
                         comfy_quant_tensor)
from .formats import FORMATS, kitchen_reference
from .formats.conv_fp8 import CONV_FP8
from .heldout import rel
from .plan import LayerPlan, Plan
from .planner import format_errors
from .report import LayerReport
from .safetensors_io import entries_nbytes
from .steps import Work, run_steps

SENSITIVITY_ROWS = 64


def check_finite(name: str, w: torch.Tensor) -> None:
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        raise QuantizeError(f"{name}: {int(bad.sum())} NaN/Inf values in the weight; refusing to "
                            f"quantize a broken layer (fix the source, or --keep this layer)")


def quantize_layer(w: torch.Tensor, layer: LayerPlan, plan: Plan, layer_stats=None,
                   smooth: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], LayerReport]:
    """Output tensors (by output key) and the report for one planned, quantized layer: its
    ``steps``, a plain encoding where none encoded, its measurement.

    ``smooth`` [K]: smoothing scales already folded into the producer of this layer's input;
    the stored weight is ``w * smooth``."""
    w = w.to(torch.float32)
    check_finite(layer.name, w)
    x = layer_stats.sample().to(w.device) if (layer_stats is not None and layer_stats.has_sample()) else None
    engine = plan.engine.layers.get(layer.rel) if plan.engine is not None else None
    given = plan.recipe.format_options(layer.fmt)
    notes = [f"{k}={v}" for k, v in layer.opts.items() if given.get(k) != v]  # shape-fitted
    if layer.format != plan.recipe.format:
        notes.insert(0, f"planner: {layer.format} (predicted {layer.predicted:.4f})")
    work = run_steps(Work(layer, plan, layer_stats, w, x, smooth=smooth, engine=engine, notes=notes))
    encoded, qt = work.encoded or work.encode_plain()
    with kitchen_reference():
        deq = qt.dequantize().to(torch.float32)
    tensors = {layer.name + SUFFIX_KEYS[s]: t for s, t in encoded.items()}
    if work.branch is not None:
        tensors[layer.name + LOWRANK_UP], tensors[layer.name + LOWRANK_DOWN] = work.branch
        if work.pre_scale is not None:
            tensors[layer.name + SMOOTH_SCALE] = work.pre_scale.float().cpu()
        elif layer.name + SMOOTH_SCALE in layer.tensors:  # planned, but no statistics for this layer: no smoothing
            tensors[layer.name + SMOOTH_SCALE] = torch.ones(layer.k, dtype=torch.float32)
            work.notes.append("no smoothing (no statistics for this layer)")
    if work.input_scale is not None:
        tensors[layer.name + INPUT_SCALE] = torch.tensor(work.input_scale, dtype=torch.float32)
    tensors[layer.name + COMFY_QUANT] = comfy_quant_tensor(layer.conf)
    return tensors, measure(w, x, deq, work, layer_stats)


# ---------------------------------------------------------------------- measure
def measure(w: torch.Tensor, x: torch.Tensor | None, deq: torch.Tensor, work: Work, layer_stats) -> LayerReport:
    """The layer's report: weight error, and with sampled inputs ``x`` (unsmoothed, as ``w``)
    the output error of what ComfyUI will compute, and the per-format sensitivity."""
    layer, fmt, opts = work.layer, work.fmt, work.opts
    lowrank = None
    if work.branch is not None:
        up, down = work.branch
        lowrank = up.float() @ down.float()
        deq = deq + lowrank
    report = LayerReport(layer.name, layer.conf["format"], entries_nbytes(layer.tensors), layer.n * layer.k * 2,
                         reason=layer.reason, weight_only=layer.weight_only,
                         rel_err=rel(deq - work.smoothed, work.smoothed), alpha=work.clip.mean_alpha)
    if x is not None:
        scale = work.input_scale if not layer.weight_only else None

        def out_err(xs: torch.Tensor, scale=scale, rounded: bool = True) -> float:
            # rows in the smoothed basis: xs @ smoothed^T == x @ w^T; not ``rounded``: 16-bit inputs
            act = fmt.fake_act(xs, scale, **opts) if rounded else fmt.search_space(xs, **opts)
            if lowrank is None:
                q_out = act @ fmt.search_space(deq, **opts).T
            else:  # the branch sees the (smoothed) 16-bit input; only the residual GEMM is quantized
                q_out = act @ fmt.search_space(deq - lowrank, **opts).T + xs @ lowrank.T
            ref = xs @ work.smoothed.T
            return rel(q_out - ref, ref)
        report.out_err = out_err(work.x)
        if work.split is not None:
            report.held_err = out_err(work.split.held)
            if scale is not None or not (fmt.needs_input_scale or layer.weight_only):
                # what rounding the activations adds to the weight's error (held out; >= 0)
                report.act_err = max(report.held_err - out_err(work.split.held, rounded=False), 0.0)
        if work.recipe.sensitivity:
            report.sensitivity = sensitivity(w, x[:SENSITIVITY_ROWS], layer_stats)
    if work.input_scale is not None:
        report.input_scale = work.input_scale
    report.notes = ", ".join(work.notes)
    return report


def sensitivity(w: torch.Tensor, x: torch.Tensor, layer_stats) -> dict[str, float]:
    """Relative output error of this layer on sampled inputs, per candidate format (absmax
    scales; fp8 with its calibrated static input scale)."""
    return {name: round(err, 6) for name, _fmt, _opts, err in
            format_errors(w, x, layer_stats.amax_value(), {n: (f, {}) for n, f in FORMATS.items()})}


def quantize_conv(w: torch.Tensor, conv) -> tuple[dict, LayerReport]:
    """A Conv2d weight [O, I, kh, kw] as float8_e4m3fn [O, I*kh*kw] with one float32 scale per
    output channel (``ConvFp8.encode``): weight-only, dequantized in the own loader's forward."""
    w2 = w.reshape(w.shape[0], -1).float()
    q, scale = CONV_FP8.encode(w2)
    deq = CONV_FP8.decode(q, scale)
    tensors = {conv.name + ".weight": q, conv.name + ".weight_scale": scale,
               conv.name + COMFY_QUANT: comfy_quant_tensor(conv.conf)}
    report = LayerReport(conv.name, conv.conf["format"], entries_nbytes(conv.tensors), w2.numel() * 2,
                         weight_only=True, rel_err=rel(deq - w2, w2),
                         notes=f"conv {'x'.join(str(d) for d in w.shape[2:])}, fp8 per output channel")
    return tensors, report


def kept_report(layer: LayerPlan) -> LayerReport:
    return LayerReport(layer.name, layer.src_dtype.lower(), entries_nbytes(layer.tensors),
                       layer.n * layer.k * 2, reason=layer.reason)

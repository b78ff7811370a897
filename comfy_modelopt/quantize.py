"""One layer: choose (smoothing, clip, rounding) then encode with kitchen; and the report.

``quantize_layer`` turns one float weight into its output tensors and a LayerReport.  The
whole-model pipeline that streams a source through it lives in ``pipeline``.
"""
from __future__ import annotations

import torch

from . import gptq as gptq_mod
from .formats import FORMATS, Format, get_format, kitchen_reference
from .errors import QuantizeError
from .fileformat import (COMFY_QUANT, INPUT_SCALE, LOWRANK_DOWN, LOWRANK_UP, SMOOTH_SCALE, SUFFIX_KEYS,
                         comfy_quant_tensor)
from .plan import LayerPlan
from .recipe import Recipe
from .report import LayerReport
from .safetensors_io import ITEMSIZE
from .lowrank import lowrank_split
from .scales import choose_input_scale, choose_weight_clip, input_fmax
from .smoothing import output_error, search_smoothing

SENSITIVITY_ROWS = 64


def check_finite(name: str, w: torch.Tensor) -> None:
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        raise QuantizeError(f"{name}: {int(bad.sum())} NaN/Inf values in the weight; refusing to "
                            f"quantize a broken layer (fix the source, or --keep this layer)")


def quantize_layer(w: torch.Tensor, layer: LayerPlan, recipe: Recipe, layer_stats=None,
                   smooth: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], LayerReport]:
    """Output tensors (by output key) and the report for one planned, quantized layer.

    ``smooth`` [K]: smoothing scales already folded into the producer of this layer's input;
    the stored weight is ``w * smooth``."""
    fmt = get_format(layer.format)
    opts = recipe.format_options()
    w = w.to(torch.float32)
    check_finite(layer.name, w)
    x = layer_stats.sample().to(w.device) if (layer_stats is not None and layer_stats.has_sample()) else None
    notes = []
    w_ref, x_ref = w, x
    pre_scale = None
    if recipe.lowrank and recipe.smoothing != "none" and x is not None:
        # own-loader files carry smoothing per layer (smooth_scale multiplies the input)
        found = search_smoothing(w, x, layer_stats.channel_absmax.float().to(w.device),
                                 layer_stats.channel_mean_abs().to(w.device), fmt, recipe.smoothing, **opts)
        smooth = found.scales if found.scales is not None else torch.ones(layer.k, device=w.device)
        pre_scale = 1.0 / smooth
        notes.append(f"{recipe.smoothing} a={found.alpha:.1f} (smooth_scale)")
    if smooth is not None:
        smooth = smooth.to(w.device)
        w = w * smooth
        x = x / smooth if x is not None else None
    branch = None
    if recipe.lowrank:
        parts = lowrank_split(w, min(recipe.lowrank, layer.n, layer.k))
        # contiguous, as a reloaded file holds them: the same strides give bit-identical matmuls
        branch = (parts.l1.to(torch.bfloat16).contiguous(), parts.l2.to(torch.bfloat16).contiguous())
        w_full, w = w, parts.residual
        notes.append(f"low-rank r={parts.l1.shape[1]}")

    input_scale = None
    if layer.static_input:
        input_scale = _input_scale(layer_stats, fmt, recipe, smooth)

    # output-aware clipping for per-tensor scales; per-row scales chosen on a few hundred sampled
    # rows overfit them (measured: worse on fresh inputs), so rows use the weight objective
    clip = choose_weight_clip(w, fmt, recipe.weight_scale, xs=x if fmt.free_scale == "tensor" else None, **opts)
    if recipe.gptq and x is not None and fmt.name in gptq_mod.SUPPORTED and not opts.get("convrot"):
        encoded, qt = _gptq_encode(w, fmt, clip.alpha, x, opts)
        notes.append("gptq")
    else:
        encoded, qt = fmt.encode(w, clip.alpha, **opts)
        if recipe.gptq and x is not None:
            notes.append(f"gptq n/a for {fmt.name}{'+convrot' if opts.get('convrot') else ''}")
    with kitchen_reference():
        deq = qt.dequantize().to(torch.float32)

    tensors = {layer.name + SUFFIX_KEYS[s]: t for s, t in encoded.items()}
    lowrank = None
    if branch is not None:
        up, down = branch
        tensors[layer.name + LOWRANK_UP], tensors[layer.name + LOWRANK_DOWN] = up, down
        if pre_scale is not None:
            tensors[layer.name + SMOOTH_SCALE] = pre_scale.float().cpu()
        lowrank = up.float() @ down.float()
        deq, w = deq + lowrank, w_full
    report = LayerReport(layer.name, layer.conf["format"], _nbytes(layer.tensors), layer.n * layer.k * 2,
                         reason=layer.reason, weight_only=layer.weight_only,
                         rel_err=_rel(deq - w, w), alpha=clip.mean_alpha)
    if x is not None:
        act = fmt.fake_act(x, input_scale if not layer.weight_only else None, **opts)
        if lowrank is None:
            q_out = act @ fmt.search_space(deq, **opts).T
        else:  # the branch sees the (smoothed) 16-bit input; only the residual GEMM is quantized
            q_out = act @ fmt.search_space(deq - lowrank, **opts).T + x @ lowrank.T
        report.out_err = _rel(q_out - x_ref @ w_ref.T, x_ref @ w_ref.T)
        if recipe.sensitivity:
            report.sensitivity = sensitivity(w_ref, x_ref[:SENSITIVITY_ROWS], layer_stats, recipe)
    if input_scale is not None:
        tensors[layer.name + INPUT_SCALE] = torch.tensor(input_scale, dtype=torch.float32)
        report.input_scale = input_scale
    tensors[layer.name + COMFY_QUANT] = comfy_quant_tensor(layer.conf)
    report.notes = ", ".join(notes)
    return tensors, report


def _input_scale(layer_stats, fmt: Format, recipe: Recipe, smooth) -> float:
    if smooth is None:
        return choose_input_scale(layer_stats, fmt, recipe)
    # the histogram describes the unsmoothed input: after smoothing use its exact amax
    amax = float((layer_stats.channel_absmax.float().cpu() / smooth.cpu()).max())
    return max(amax, 1e-12) / input_fmax(fmt)


def _gptq_encode(w, fmt: Format, alpha, x, opts):
    h = gptq_mod.hessian(x)
    if fmt.name.startswith("float8"):
        scale = float(fmt.weight_scale(w, alpha))
        q = gptq_mod.gptq(w, h, gptq_mod.fp8_column_quantizer(scale, _fp8(fmt)))
        return fmt.encode(q, scale=torch.tensor(scale), **opts)
    absmax = w.abs().amax(dim=1)
    if alpha is not None:
        absmax = absmax * alpha.to(w.device)
    row_scale = (absmax / 127.0).clamp(min=1e-30)
    q = gptq_mod.gptq(w, h, gptq_mod.int8_column_quantizer(row_scale))
    return fmt.encode(q, scale=row_scale, **opts)


def _fp8(fmt: Format) -> torch.dtype:
    return torch.float8_e5m2 if fmt.name == "float8_e5m2" else torch.float8_e4m3fn


def sensitivity(w: torch.Tensor, x: torch.Tensor, layer_stats, recipe: Recipe) -> dict[str, float]:
    """Relative output error of this layer on sampled inputs, per candidate format (absmax
    scales; fp8 with its calibrated static input scale)."""
    out = {}
    for name, fmt in FORMATS.items():
        if fmt.shape_problem(w.shape[0], w.shape[1]):
            continue
        amax = layer_stats.amax_value() if fmt.needs_input_scale else None
        out[name] = round(output_error(fmt, w, x, None, amax), 6)
    return out


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    denom = float(ref.norm())
    return float(diff.norm()) / denom if denom > 0 else 0.0


def _nbytes(entries: dict) -> int:
    total = 0
    for dtype, shape in entries.values():
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        total += n
    return total


FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
# A channel's absmax is stored at 224, not 448: ComfyUI applies a LoRA to a plain fp8 weight by
# adding the (mapped) delta and rounding back to fp8, which saturates at 448, so the headroom
# lets a delta as large as the channel's own largest weight through unclipped.  e4m3's relative
# precision is the same one binade lower (measured: identical weight error on UNet-like weights).
CONV_STORED_MAX = FP8_MAX / 2


def quantize_conv(w: torch.Tensor, conv) -> tuple[dict, LayerReport]:
    """A Conv2d weight [O, I, kh, kw] as float8_e4m3fn [O, I*kh*kw] with one float32 scale per
    output channel (absmax / 224): weight-only, dequantized in the own loader's forward.
    Per-channel, not per-tensor: a UNet's output channels differ in norm by 10x and more."""
    o = w.shape[0]
    w2 = w.reshape(o, -1).float()
    scale = (w2.abs().amax(dim=1) / CONV_STORED_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w2 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = q.float() * scale[:, None]
    tensors = {conv.name + ".weight": q, conv.name + ".weight_scale": scale,
               conv.name + COMFY_QUANT: comfy_quant_tensor(conv.conf)}
    report = LayerReport(conv.name, conv.conf["format"], _nbytes(conv.tensors), w2.numel() * 2,
                         weight_only=True, rel_err=_rel(deq - w2, w2),
                         notes=f"conv {'x'.join(str(d) for d in w.shape[2:])}, fp8 per output channel")
    return tensors, report


def kept_report(layer: LayerPlan) -> LayerReport:
    return LayerReport(layer.name, layer.src_dtype.lower(), _nbytes(layer.tensors),
                       layer.n * layer.k * 2, reason=layer.reason)

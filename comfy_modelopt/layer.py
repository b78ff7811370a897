"""One layer in three steps: ``choose`` (smoothing, low-rank branch, input scale, weight clip),
``encode`` (GPTQ rounding where it applies, then kitchen), ``measure`` (the layer's report).

``quantize_layer`` runs them on one float weight of a plan.  The whole-model pipeline that
streams a source through it lives in ``pipeline``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from comfy_kitchen.tensor import QuantizedTensor

from . import gptq
from .formats import FORMATS, Format, kitchen_reference
from .errors import QuantizeError
from .fileformat import (COMFY_QUANT, INPUT_SCALE, LOWRANK_DOWN, LOWRANK_UP, SMOOTH_SCALE, SUFFIX_KEYS,
                         comfy_quant_tensor)
from .plan import LayerPlan, Plan
from .planner import format_errors
from .recipe import Recipe
from .report import LayerReport
from .safetensors_io import entries_nbytes
from .heldout import Split, rel, split_rows
from .lowrank import LowRank, lowrank_split
from .scales import (ClipChoice, choose_input_scale, choose_weight_clip, search_block_clip,
                     squared_error)
from .smoothing import choose_smoothing
from .stats import histogram

SENSITIVITY_ROWS = 64


def check_finite(name: str, w: torch.Tensor) -> None:
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        raise QuantizeError(f"{name}: {int(bad.sum())} NaN/Inf values in the weight; refusing to "
                            f"quantize a broken layer (fix the source, or --keep this layer)")


@dataclass
class LayerChoice:
    """What was chosen for one layer before encoding it."""
    w: torch.Tensor                     # what is encoded: smoothed, minus the low-rank branch
    x: torch.Tensor | None              # sampled inputs in the same (smoothed) basis
    smoothed: torch.Tensor              # the whole smoothed weight (the branch included)
    clip: ClipChoice
    input_scale: float | None = None    # static input_scale
    pre_scale: torch.Tensor | None = None   # own-loader smooth_scale (1/s) [K]
    branch: tuple | None = None         # (up [N, r], down [r, K]) bf16 low-rank branch
    split: Split | None = None          # sampled rows by prompt (smoothed basis): fit / held out
    notes: list = field(default_factory=list)


def quantize_layer(w: torch.Tensor, layer: LayerPlan, plan: Plan, layer_stats=None,
                   smooth: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], LayerReport]:
    """Output tensors (by output key) and the report for one planned, quantized layer.

    ``smooth`` [K]: smoothing scales already folded into the producer of this layer's input;
    the stored weight is ``w * smooth``."""
    w = w.to(torch.float32)
    check_finite(layer.name, w)
    x = layer_stats.sample().to(w.device) if (layer_stats is not None and layer_stats.has_sample()) else None
    choice = choose(w, x, layer, plan, layer_stats, smooth)
    encoded, qt = encode(choice, layer, plan)
    with kitchen_reference():
        deq = qt.dequantize().to(torch.float32)
    tensors = {layer.name + SUFFIX_KEYS[s]: t for s, t in encoded.items()}
    if choice.branch is not None:
        tensors[layer.name + LOWRANK_UP], tensors[layer.name + LOWRANK_DOWN] = choice.branch
        if choice.pre_scale is not None:
            tensors[layer.name + SMOOTH_SCALE] = choice.pre_scale.float().cpu()
    if choice.input_scale is not None:
        tensors[layer.name + INPUT_SCALE] = torch.tensor(choice.input_scale, dtype=torch.float32)
    tensors[layer.name + COMFY_QUANT] = comfy_quant_tensor(layer.conf)
    return tensors, measure(w, x, deq, choice, layer, plan, layer_stats)


# ---------------------------------------------------------------------- choose
def choose(w: torch.Tensor, x: torch.Tensor | None, layer: LayerPlan, plan: Plan, layer_stats,
           smooth: torch.Tensor | None) -> LayerChoice:
    """Smoothing, low-rank branch, static input scale and weight clip for float32 ``w`` [N, K]
    with sampled inputs ``x`` [m, K] (or None)."""
    fmt, opts, recipe = FORMATS[layer.format], layer.opts, plan.recipe
    given = recipe.format_options(layer.format)
    notes, pre_scale = [f"{k}={v}" for k, v in opts.items() if given.get(k) != v], None  # shape-fitted
    if layer.format != recipe.format:
        notes.insert(0, f"planner: {layer.format} (predicted {layer.predicted:.4f})")
    engine = plan.engine.layers.get(layer.rel) if plan.engine is not None else None
    if layer.rank and engine is not None:
        if engine.smooth is not None:  # ModelOpt's AWQ/SVDQuant scales, per layer in an own-loader file
            smooth = engine.smooth.to(w.device)
            pre_scale = 1.0 / smooth
            notes.append(f"ModelOpt {plan.engine.algorithm} smoothing (smooth_scale)")
    elif layer.rank and recipe.smoothing != "none" and x is not None:
        # own-loader files carry smoothing per layer (smooth_scale multiplies the input)
        found = choose_smoothing(w, layer_stats, fmt, recipe.smoothing, x=x, **opts)
        smooth = found.scales if found.scales is not None else torch.ones(layer.k, device=w.device)
        pre_scale = 1.0 / smooth
        notes.append(f"{recipe.smoothing} a={found.alpha:.1f} (smooth_scale)")
    if smooth is not None:
        smooth = smooth.to(w.device)
        w = w * smooth
        x = x / smooth if x is not None else None
    split = split_rows(x, layer_stats)
    branch, smoothed = None, w
    if layer.rank:
        if engine is not None and engine.lowrank is not None:  # ModelOpt SVDQuant's branch
            up, down = (t.to(w.device, torch.float32) for t in engine.lowrank)
            if up.shape != (layer.n, layer.rank) or down.shape != (layer.rank, layer.k):
                raise QuantizeError(f"{layer.name}: ModelOpt's SVDQuant branch is {tuple(up.shape)} x "
                                f"{tuple(down.shape)}, the file plans rank {layer.rank} of {layer.n}x{layer.k}")
            parts = LowRank(up, down, w - up @ down)
            notes.append(f"ModelOpt SVDQuant low-rank r={layer.rank}")
        else:
            parts = lowrank_split(w, layer.rank)
            notes.append(f"low-rank r={parts.l1.shape[1]}")
        # contiguous, as a reloaded file holds them: the same strides give bit-identical matmuls
        branch = (parts.l1.to(torch.bfloat16).contiguous(), parts.l2.to(torch.bfloat16).contiguous())
        w = parts.residual
    if engine is not None:  # ModelOpt's choices: its input range, absmax weights (its max calibrator)
        input_scale = None
        if layer.static_input:
            input_scale = (engine.input_amax / fmt.input_fmax() if smooth is None and engine.input_amax
                           else _input_scale(layer_stats, fmt, Recipe(fmt.name, input_scale="max"), smooth))
        clip = ClipChoice(None, 1.0, "weight")
        if plan.engine.algorithm == "awq_full" and not layer.rank:
            ratio = engine.weight_clip
            if ratio is not None and (smooth is not None or engine.smooth is None):
                clip = ClipChoice(torch.tensor(ratio), ratio, "weight")
                notes.append(f"ModelOpt awq_clip ratio {ratio:.2f}")
            elif ratio is not None:
                notes.append(f"ModelOpt awq_clip ratio {ratio:.2f} dropped with its smoothing")
        return LayerChoice(w, x, smoothed, clip, input_scale, pre_scale, branch, split, notes)
    input_scale = None
    if layer.static_input:
        input_scale = _input_scale(layer_stats, fmt, recipe, smooth) if split is None else \
            _held_out_input_scale(layer_stats, fmt, recipe, smooth, split, smoothed, notes)
    clip = _weight_clip(w, fmt, recipe, x, split, opts, notes)
    return LayerChoice(w, x, smoothed, clip, input_scale, pre_scale, branch, split, notes)


def _weight_clip(w, fmt: Format, recipe: Recipe, x, split: Split | None, opts: dict, notes: list) -> ClipChoice:
    """Output-aware clipping for per-tensor scales (chosen on the fit prompts, kept only if it
    beats absmax on the held-out ones); per-row scales chosen on a few hundred sampled rows
    overfit them (measured: worse on fresh inputs), so rows use the weight objective."""
    if fmt.free_scale != "tensor":
        return choose_weight_clip(w, fmt, recipe.weight_scale, **opts)
    clip = choose_weight_clip(w, fmt, recipe.weight_scale, xs=split.fit if split else x, **opts)
    if split is not None and clip.alpha is not None:
        ws, held = fmt.search_space(w, **opts), fmt.search_space(split.held.to(w.device), **opts)
        if float(squared_error(fmt, ws, clip.alpha, xs=held).sum()) >= float(squared_error(fmt, ws, None, xs=held).sum()):
            notes.append(f"weight clip {clip.mean_alpha:.2f} worse on held-out prompts: absmax")
            clip = ClipChoice(None, 1.0, clip.objective)
    if fmt.block_clip and recipe.weight_scale == "mse" and w.shape[1] % 16 == 0:
        return _block_clip(w, fmt, x, split, clip, notes)
    return clip


def _block_clip(w, fmt: Format, x, split: Split | None, clip: ClipChoice, notes: list) -> ClipChoice:
    """nvfp4's per-block clip (``search_block_clip``, weighted by the fit prompts' input energy)
    instead of the per-tensor ``clip`` where its error is lower - on the held-out prompts'
    outputs (the fit rows' without held-out prompts; the weight's without statistics).  On the
    real-weights model the per-tensor search took 25 of 36 layers for no gain (0.2576 vs naive
    0.2578); the blocks' clip, tried after it only, 0.2485 - chosen by error, 0.23."""
    fit = split.fit if split is not None else x
    found = search_block_clip(fmt, w, fit.to(w.device) if fit is not None else None)
    if found is None:
        return clip
    blocks = found.fake
    tensor = found.fake_absmax if clip.alpha is None else fmt.fake_rows(w, clip.alpha)
    check = split.held if split is not None else x
    if check is not None:
        check = check.to(w.device)
        ref = check @ w.T
        block_err, tensor_err = rel(check @ (blocks - w).T, ref), rel(check @ (tensor - w).T, ref)
    else:
        block_err, tensor_err = rel(blocks - w, w), rel(tensor - w, w)
    if block_err >= tensor_err:
        if split is not None:
            notes.append("block clip worse on held-out prompts")
        return clip
    parts = [f"{share:.0%} {what}" for share, what in ((found.share - found.raised, "clipped"),
                                                        (found.raised, "raised")) if share > 0]
    notes.append(f"block scales ({', '.join(parts)})")
    return ClipChoice(None, 1.0, clip.objective, found.bound)


def _held_out_input_scale(layer_stats, fmt: Format, recipe: Recipe, smooth, split: Split, w: torch.Tensor,
                          notes: list) -> float:
    """The static input scale searched on all calibration data (max, percentile or MSE), if the
    same search run on the fit prompts alone beats no clipping on the held-out prompts
    (activation rounding seen through the layer's weight).  Where it does not, clipping hurts
    inputs the search has not seen: no clip, and the headroom the held-out prompts showed past
    the fit prompts' max (``split.growth``), which new prompts may show past ours."""
    chosen = _input_scale(layer_stats, fmt, recipe, smooth)
    no_clip = _input_scale(layer_stats, fmt, Recipe(fmt.name, input_scale="max"), smooth)
    fit, held, fmax = split.fit, split.held, fmt.input_fmax()
    amax_fit = float(fit.abs().max())
    if amax_fit <= 0.0:
        return chosen
    searched = choose_input_scale(fmt, recipe.input_scale, amax_fit, histogram(fit).cpu(), fit, recipe.percentile)
    noop = amax_fit / fmax
    ref = held @ w.T

    def err(scale: float) -> float:
        return rel(fmt.fake_act(held, scale) @ w.T - ref, ref)
    if searched < noop and err(searched) < err(noop):
        return chosen
    if chosen < no_clip:
        notes.append(f"input clip {chosen / no_clip:.2f} worse on held-out prompts: max")
    growth = split.growth
    if growth > 1.0:
        notes.append(f"input headroom x{growth:.2f} (held-out prompts past the calibration max)")
    return no_clip * growth


def _input_scale(layer_stats, fmt: Format, recipe: Recipe, smooth) -> float:
    if smooth is None:
        sample = layer_stats.sample() if recipe.input_scale == "mse" and layer_stats.has_sample() else None
        return choose_input_scale(fmt, recipe.input_scale, layer_stats.amax_value(), layer_stats.hist,
                                  sample, recipe.percentile)
    # the histogram describes the unsmoothed input: after smoothing use its exact amax
    amax = float((layer_stats.channel_absmax.float().cpu() / smooth.cpu()).max())
    return max(amax, 1e-12) / fmt.input_fmax()


# ---------------------------------------------------------------------- encode
def encode(choice: LayerChoice, layer: LayerPlan, plan: Plan) -> tuple[dict[str, torch.Tensor], QuantizedTensor]:
    """kitchen's encoding of the chosen weight (GPTQ-rounded first where the recipe asks and the
    format can): on-disk tensors by key suffix, and the QuantizedTensor."""
    fmt, opts, w, x = FORMATS[layer.format], layer.opts, choice.w, choice.x
    if plan.recipe.gptq and x is not None:
        ws = fmt.search_space(w, **opts)  # where the format rounds (rotated for ConvRot)
        bound = _bound(choice)
        rounding = fmt.gptq_rounding(ws, choice.clip.alpha, **bound, **opts)
        if rounding is not None:
            quantize_columns, scale = rounding
            split = choice.split
            xs = fmt.search_space((split.fit if split else x).to(w.device), **opts)
            h = gptq.gram(xs)

            def encoded(q):  # rotated back
                return fmt.encode(fmt.search_space(q, **opts), scale=scale, **bound, **opts)
            q = encoded(gptq.gptq(ws, h, quantize_columns, act_order=plan.recipe.gptq_act_order, damp=gptq.DAMPING))
            if split is None:
                choice.notes.append("gptq" + _few_rows(xs))
                return q
            # GPTQ minimises the error on the rows it saw: it is kept only where prompts it did
            # not see agree
            plain = _encode_plain(fmt, w, choice, opts)
            err, base = _weight_out_err(q[1], w, split.held), _weight_out_err(plain[1], w, split.held)
            if err < base:
                choice.notes.append(f"gptq (held-out {base:.4f}->{err:.4f})" + _few_rows(xs))
                return q
            choice.notes.append(f"gptq worse on held-out prompts ({err:.4f} vs {base:.4f}): plain rounding")
            return plain
        choice.notes.append(f"gptq n/a for {fmt.name}{'+convrot' if opts.get('convrot') else ''}")
    return _encode_plain(fmt, w, choice, opts)


# what a layer's GPTQ note says when its Hessian X^T X came from fewer sampled rows than the layer
# has inputs (rank-deficient: the damping stands in for what was never sampled); the report counts
# these layers (pipeline.gptq_rows_note).  A 2 MiB reservoir holds 341 rows of a 3072-wide layer,
# 85 of a 12288-wide one; on the real-weights benchmark GPTQ's gain grew with the calibration
# rows (16 -> 160 prompts, docs/benchmarks.md 3a)
FEW_ROWS = "fewer rows than inputs"


def _few_rows(x: torch.Tensor) -> str:
    return f" [{FEW_ROWS}: {x.shape[0]} < {x.shape[1]}]" if x.shape[0] < x.shape[1] else ""


def _bound(choice: LayerChoice) -> dict:
    """The chosen nvfp4 block scale bounds as the encoder's keyword (none: empty)."""
    return {} if choice.clip.block_bound is None else {"block_bound": choice.clip.block_bound}


def _encode_plain(fmt: Format, w: torch.Tensor, choice: LayerChoice, opts: dict):
    """Round-to-nearest encoding of the chosen clip (nvfp4: with its blocks' scale bounds)."""
    return fmt.encode(w, choice.clip.alpha, **_bound(choice), **opts)


def _weight_out_err(qt: QuantizedTensor, w: torch.Tensor, x: torch.Tensor) -> float:
    with kitchen_reference():
        deq = qt.dequantize().to(torch.float32)
    return rel(x @ (deq - w).T, x @ w.T)


# ---------------------------------------------------------------------- measure
def measure(w: torch.Tensor, x: torch.Tensor | None, deq: torch.Tensor, choice: LayerChoice,
            layer: LayerPlan, plan: Plan, layer_stats) -> LayerReport:
    """The layer's report: weight error, and with sampled inputs ``x`` (unsmoothed, as ``w``)
    the output error of what ComfyUI will compute, and the per-format sensitivity."""
    fmt, opts = FORMATS[layer.format], layer.opts
    lowrank = None
    if choice.branch is not None:
        up, down = choice.branch
        lowrank = up.float() @ down.float()
        deq = deq + lowrank
    report = LayerReport(layer.name, layer.conf["format"], entries_nbytes(layer.tensors), layer.n * layer.k * 2,
                         reason=layer.reason, weight_only=layer.weight_only,
                         rel_err=rel(deq - choice.smoothed, choice.smoothed), alpha=choice.clip.mean_alpha)
    if x is not None:
        scale = choice.input_scale if not layer.weight_only else None

        def out_err(xs: torch.Tensor, scale=scale) -> float:  # rows in the smoothed basis: xs @ smoothed^T == x @ w^T
            act = fmt.fake_act(xs, scale, **opts)
            if lowrank is None:
                q_out = act @ fmt.search_space(deq, **opts).T
            else:  # the branch sees the (smoothed) 16-bit input; only the residual GEMM is quantized
                q_out = act @ fmt.search_space(deq - lowrank, **opts).T + xs @ lowrank.T
            ref = xs @ choice.smoothed.T
            return rel(q_out - ref, ref)
        report.out_err = out_err(choice.x)
        if choice.split is not None:
            report.held_err = out_err(choice.split.held)
            if scale is not None:  # what rounding the activations adds to the weight's error (held out; >= 0)
                report.act_err = max(report.held_err - out_err(choice.split.held, None), 0.0)
        if plan.recipe.sensitivity:
            report.sensitivity = sensitivity(w, x[:SENSITIVITY_ROWS], layer_stats)
    if choice.input_scale is not None:
        report.input_scale = choice.input_scale
    report.notes = ", ".join(choice.notes)
    return report


def sensitivity(w: torch.Tensor, x: torch.Tensor, layer_stats) -> dict[str, float]:
    """Relative output error of this layer on sampled inputs, per candidate format (absmax
    scales; fp8 with its calibrated static input scale)."""
    return {name: round(err, 6) for name, _fmt, _opts, err in
            format_errors(w, x, layer_stats.amax_value(), {n: (f, {}) for n, f in FORMATS.items()})}


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
    report = LayerReport(conv.name, conv.conf["format"], entries_nbytes(conv.tensors), w2.numel() * 2,
                         weight_only=True, rel_err=rel(deq - w2, w2),
                         notes=f"conv {'x'.join(str(d) for d in w.shape[2:])}, fp8 per output channel")
    return tensors, report


def kept_report(layer: LayerPlan) -> LayerReport:
    return LayerReport(layer.name, layer.src_dtype.lower(), entries_nbytes(layer.tensors),
                       layer.n * layer.k * 2, reason=layer.reason)

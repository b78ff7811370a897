"""Choices checked on the whole model's output: ``quantize_module`` has the model, so where
layer errors do not add up to the model's it runs the quantized model on a few calibration
calls (``CalibrationOptions.check_calls``: drawn over the whole sampling) against the source's
outputs, and keeps an alternative only where the model's output error there goes down.
Design: docs/design.md, ``model_checks.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .heldout import rel
from .formats.conv_fp8 import CONV_FP8

PER_SAMPLE_ROWS = 8   # rows per call at most: a batch of samples (cfg x images), never a token grid


@dataclass
class Alternative:
    what: str                       # "per-sample layers", "fp8 convolutions"
    current: str                    # what the pipeline wrote
    other: str                      # what ``apply`` switches to
    apply: Callable[[], None]
    undo: Callable[[], None]


def _per_sample(layer_stats) -> bool:
    return bool(layer_stats.calls) and layer_stats.rows / layer_stats.calls <= PER_SAMPLE_ROWS


def wanted(stats, recipe) -> bool:
    """Whether any alternative can apply: a per-sample layer, or convolutions to quantize."""
    return recipe.conv != "none" or any(_per_sample(s) for s in stats.layers.values())


def outputs(out) -> list[torch.Tensor]:
    """A call's floating-point output tensors, as float32."""
    from torch.utils._pytree import tree_leaves
    return [t.detach().float() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def device_of(module: torch.nn.Module) -> torch.device:
    return next(iter(module.parameters()), torch.empty(0)).device


def output_error(model: torch.nn.Module, calls: list, refs: list) -> float:
    """Relative L2 error of ``model``'s outputs on the recorded ``calls`` against ``refs``."""
    num = den = 0.0
    with torch.no_grad():
        for call, ref in zip(calls, refs):
            for o, r in zip(outputs(call.replay(model, device_of(model))), ref):
                num, den = num + float((o - r.to(o.device)).pow(2).sum()), den + float(r.pow(2).sum())
    return math.sqrt(num / den) if den > 0 else 0.0


def choose(model: torch.nn.Module, calls: list, refs: list, alternatives: list[Alternative], notes: list[str]) -> None:
    """Each alternative in turn, kept where the model's output error on ``calls`` goes down (given
    the choices before it); one note each, with both errors."""
    if not alternatives:
        return
    error = output_error(model, calls, refs)
    for alt in alternatives:
        alt.apply()
        other = output_error(model, calls, refs)
        kept = other < error
        if not kept:
            alt.undo()
        notes.append(f"{alt.what}: {alt.other if kept else alt.current}, chosen by the model's output error on "
                     f"{len(calls)} calibration calls ({other:.4g} {alt.other}, {error:.4g} {alt.current})")
        error = min(error, other)


def compute_weight_only(layer) -> None:
    """A quantized Linear (``modules.QuantLinear``) computed weight-only from now on, as ComfyUI
    computes a layer whose config says ``full_precision_matrix_mult``; the stored weight is kept.
    Only for formats whose activations ComfyUI quantizes before the GEMM (``quantize_input``):
    int8's and ConvRot's layouts quantize them inside their own linear, whatever the flag says."""
    layer.conf["full_precision_matrix_mult"] = layer.full_precision = True
    layer.input_scale = None


def per_sample(linears: dict, stats, reports: dict, confs: dict) -> Alternative | None:
    """The quantized Linear layers (``linears``: name -> QuantLinear) whose calibration saw at
    most ``PER_SAMPLE_ROWS`` rows per call, computed weight-only (``compute_weight_only``); their ``reports`` (name ->
    LayerReport) and ``confs`` (name -> the file's layer config) follow."""
    chosen = {n: m for n, m in linears.items() if m.fmt.quantize_input and not m.full_precision
              and n in stats.layers and _per_sample(stats.layers[n])}
    if not chosen:
        return None
    before = {n: (m.input_scale, dict(m.conf), reports[n].weight_only, reports[n].reason) for n, m in chosen.items()}
    reason = f"one input row per sample (at most {PER_SAMPLE_ROWS} per call): weight-only, by the model's output"

    def apply():
        for n, m in chosen.items():
            compute_weight_only(m)
            confs[n], reports[n].weight_only, reports[n].reason = dict(m.conf), True, reason

    def undo():
        for n, m in chosen.items():
            m.input_scale, m.conf, reports[n].weight_only, reports[n].reason = before[n][0], dict(before[n][1]), *before[n][2:]
            m.full_precision, confs[n] = False, dict(m.conf)
    return Alternative(f"{len(chosen)} per-sample layers", "quantized inputs", "weight-only (16-bit inputs)", apply, undo)


def conv_per_tensor(convs: dict, originals: dict, reports: dict) -> Alternative | None:
    """The fp8 convolutions (``convs``: name -> QuantConv2d) with one scale per weight tensor,
    rounded again from ``originals`` (name -> source weight)."""
    if not convs:
        return None
    before = {n: (m.weight, m.weight_scale, reports[n].rel_err, reports[n].notes) for n, m in convs.items()}

    def apply():
        for n, m in convs.items():
            w = originals[n].detach()
            q, scale = CONV_FP8.encode(w, per_tensor=True)
            m.weight = torch.nn.Parameter(q.view(m.conf["shape"]).to(m.weight.device), requires_grad=False)
            m.weight_scale = scale.to(m.weight_scale.device)
            w2 = w.float().reshape(q.shape).cpu()
            reports[n].rel_err = rel(CONV_FP8.decode(q.cpu(), scale) - w2, w2)
            reports[n].notes = reports[n].notes.replace("per output channel", "one scale per tensor")

    def undo():
        for n, m in convs.items():
            m.weight, m.weight_scale, reports[n].rel_err, reports[n].notes = before[n]
    return Alternative("fp8 convolutions", "one scale per output channel", "one scale per weight tensor", apply, undo)

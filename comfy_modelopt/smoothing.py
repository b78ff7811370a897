"""SmoothQuant and AWQ: per-input-channel scales that move quantization difficulty from
activations to weights, searched to minimise the layer's output error.
Design: docs/design.md, ``smoothing.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Format
from .heldout import split_rows

ALPHAS = tuple(i / 10 for i in range(11))


@dataclass
class Smoothing:
    scales: torch.Tensor | None   # s [K] (weights times s, inputs divided by s); None: no gain
    method: str
    alpha: float
    error: float                  # relative output error with the chosen scales
    base_error: float             # ... without smoothing
    held_error: float = -1.0      # on held-out prompts (-1: no split)
    held_base: float = -1.0       # ... without smoothing


def candidate_scales(method: str, alpha: float, x_absmax: torch.Tensor, x_meanabs: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
    eps = 1e-6
    if method == "smoothquant":
        wmax = w.abs().amax(dim=0).clamp(min=eps)
        s = x_absmax.clamp(min=eps) ** alpha / wmax ** (1 - alpha)
    elif method == "awq":
        s = x_meanabs.clamp(min=eps) ** alpha
    else:
        raise ValueError(f"unknown smoothing method {method!r} (smoothquant or awq)")
    # geometric normalisation keeps W*s and x/s in a sane range; the product is unchanged
    s = s / torch.exp(torch.log(s).mean())
    return s.clamp(1e-4, 1e4)


def output_error(fmt: Format, w: torch.Tensor, x: torch.Tensor, s: torch.Tensor | None,
                 input_amax: float | None = None, **opts) -> float:
    """Relative error of the quantized layer's output on inputs x (x [m, K], w [N, K]).

    ``input_amax`` (the smoothed input's amax over all calibration data) gives fp8 its static
    input scale; without it the activation rounding is the format's dynamic one."""
    ref = x @ w.T
    ws, xs = (w, x) if s is None else (w * s, x / s)
    scale = None
    if input_amax is not None and fmt.needs_input_scale:
        scale = max(input_amax, 1e-12) / fmt.input_fmax()
    q_out = fmt.fake_act(xs, scale, **opts) @ fmt.fake_rows(fmt.search_space(ws, **opts)).T
    denom = float(ref.norm())
    return float((q_out - ref).norm()) / denom if denom > 0 else 0.0


def search_smoothing(w: torch.Tensor, x: torch.Tensor, x_absmax: torch.Tensor, x_meanabs: torch.Tensor,
                     fmt: Format, method: str, alphas=ALPHAS, static_input: bool = False,
                     **opts) -> Smoothing:
    """Best smoothing scales for weight w [N, K] given sampled inputs x [m, K] and per-channel
    input statistics over all calibration data (``static_input``: fp8 with a static scale)."""
    def amax(s):
        if not static_input:
            return None
        return float((x_absmax if s is None else x_absmax / s).max())
    base = output_error(fmt, w, x, None, amax(None), **opts)
    best = Smoothing(None, method, 0.0, base, base)
    for a in alphas:
        if a == 0:
            continue
        s = candidate_scales(method, a, x_absmax, x_meanabs, w)
        err = output_error(fmt, w, x, s, amax(s), **opts)
        if err < best.error:
            best = Smoothing(s, method, a, err, base)
    return best


def choose_smoothing(w: torch.Tensor, layer_stats, fmt: Format, method: str, static_input: bool = False,
                     x: torch.Tensor | None = None, **opts) -> Smoothing:
    """``search_smoothing`` on a layer's statistics, held out by prompt where the statistics
    know their prompts: the strength is chosen on the fit rows (with their own channel
    statistics) and kept only if also better than no smoothing on the held-out rows
    (heldout.py); the scales then come from all calibration data at that strength.  ``x``: the
    layer's sampled rows on ``w``'s device, where the caller has them already."""
    dev = w.device
    x = layer_stats.sample().to(dev) if x is None else x
    split = split_rows(x, layer_stats)
    if split is None:
        return search_smoothing(w, x, layer_stats.channel_absmax.float().to(dev),
                                layer_stats.channel_mean_abs().to(dev), fmt, method,
                                static_input=static_input, **opts)
    absmax, meanabs = split.channel_stats()
    found = search_smoothing(w, split.fit, absmax, meanabs, fmt, method, static_input=static_input, **opts)

    def held(s):
        amax = float((absmax if s is None else absmax / s).max()) if static_input else None
        return output_error(fmt, w, split.held, s, amax, **opts)
    found.held_base = held(None)
    if found.scales is None:
        found.held_error = found.held_base
        return found
    found.held_error = held(found.scales)
    if found.held_error >= found.held_base:  # better only on the prompts it was chosen on
        return Smoothing(None, method, 0.0, found.base_error, found.base_error, found.held_base, found.held_base)
    # the strength held up on new prompts: its scales from all calibration data
    found.scales = candidate_scales(method, found.alpha, layer_stats.channel_absmax.float().to(dev),
                                    layer_stats.channel_mean_abs().to(dev), w)
    return found

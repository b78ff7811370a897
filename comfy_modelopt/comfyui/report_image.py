"""The quantization report as a picture, for Quantize Model's ``report_image`` output (a Preview
Image node shows it): one bar per Linear layer in model order, its height the layer's measured
error (output error on held-out calibration prompts where measured, else on all calibration
prompts, else the weight's own error), its colour the format chosen; layers kept 16-bit are grey
ticks under the axis, their reasons counted in the legend.  Below, the file's bytes by format
against the 16-bit model, with the planner's budget where one was set.

Drawn with Pillow (which ComfyUI ships); no plotting library is needed.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..fileformat import own_base
from ..formats import FORMATS
from ..report import QuantReport, kept_by_kind

WIDTH, HEIGHT = 1024, 560
OTHER, KEPT, INK, GRID, PAPER = (150, 110, 60), (170, 170, 170), (30, 30, 30), (225, 225, 225), (255, 255, 255)


def _colour(name: str):
    fmt = FORMATS.get(own_base(name) or name)  # a low-rank layer in its residual's colour
    return fmt.colour if fmt is not None else OTHER


def _error(layer) -> tuple[float, str]:
    for value, what in ((layer.held_err, "held-out output error"), (layer.out_err, "output error"),
                        (layer.rel_err, "weight error")):
        if value is not None and value >= 0:
            return float(value), what
    return 0.0, "weight error"


def render(report: QuantReport, budget: float = 0.0) -> np.ndarray:
    """The chart as a [H, W, 3] uint8 array."""
    img = Image.new("RGB", (WIDTH, HEIGHT), PAPER)
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    q, kept = report.quantized, report.kept
    total, base = report.total_bytes(), report.total_bytes_16bit()
    fmt = report.recipe.get("format", "?")
    d.text((16, 10), f"{report.family} · {fmt}{' (planner)' if budget else ''} · {len(q)} layers quantized, "
                     f"{len(kept)} kept 16-bit · file {total / 2**20:.1f} MiB = {total / base if base else 0:.3f}x "
                     f"16-bit · mean weight error {report.mean_rel_err():.4f}", fill=INK, font=font)
    # --- per-layer bars
    left, top, right, bottom = 64, 40, WIDTH - 16, 380
    layers = [l for l in report.layers]
    errs = [_error(l) for l in layers]
    what = Counter(w for (_, w), l in zip(errs, layers) if l in q).most_common(1)
    ymax = max([e for (e, _), l in zip(errs, layers) if l in q] + [1e-6]) * 1.1
    d.rectangle([left, top, right, bottom], outline=GRID)
    for i in range(1, 5):
        y = bottom - (bottom - top) * i / 4
        d.line([left, y, right, y], fill=GRID)
        d.text((8, y - 6), f"{ymax * i / 4:.3g}", fill=INK, font=font)
    d.text((left, bottom + 4), f"bar: {what[0][0] if what else 'error'} per layer, in model order", fill=INK,
           font=font)
    step = (right - left) / max(len(layers), 1)
    for i, (layer, (err, _)) in enumerate(zip(layers, errs)):
        x0, x1 = left + i * step, left + (i + 1) * step - (1 if step > 3 else 0)
        if layer in q:
            d.rectangle([x0, bottom - (bottom - top) * min(err / ymax, 1.0), max(x1, x0), bottom],
                        fill=_colour(layer.format))
        else:
            d.rectangle([x0, bottom + 18, max(x1, x0), bottom + 26], fill=KEPT)
    # --- legend: formats, then why layers stayed 16-bit
    counts = Counter(l.format for l in q)
    x = left
    for name, n in counts.most_common():
        d.rectangle([x, 412, x + 12, 424], fill=_colour(name))
        label = f"{name}: {n}"
        d.text((x + 16, 412), label, fill=INK, font=font)
        x += 16 + 7 * len(label) + 18
    if kept:
        d.rectangle([left, 432, left + 12, 444], fill=KEPT)
        d.text((left + 16, 432), f"kept 16-bit ({kept_by_kind([l.reason for l in kept])})"[:150], fill=INK, font=font)
    # --- bytes by format against the 16-bit model (and the planner's budget)
    y0, y1 = 470, 500
    d.text((left, y0 - 16), "file bytes by format (grey: 16-bit tensors); full width = the 16-bit model"
                            + (f"; line: budget {budget:g} of the Linear bytes" if budget else ""), fill=INK, font=font)
    d.rectangle([left, y0, right, y1], outline=GRID)
    by_fmt = Counter()
    for layer in report.layers:
        by_fmt[layer.format if layer in q else "16-bit"] += layer.bytes
    by_fmt["16-bit"] += report.passthrough_bytes
    x = float(left)
    for name, nbytes in sorted(by_fmt.items(), key=lambda kv: kv[0] == "16-bit"):
        w = (right - left) * nbytes / base if base else 0
        d.rectangle([x, y0, x + w, y1], fill=KEPT if name == "16-bit" else _colour(name))
        x += w
    if budget:
        linear16 = sum(l.bytes_16bit for l in report.layers)
        bx = left + (right - left) * (report.passthrough_bytes_16bit + budget * linear16) / base if base else left
        d.line([bx, y0 - 6, bx, y1 + 6], fill=INK, width=2)
    d.text((left, y1 + 8), f"{total / 2**20:.1f} MiB of {base / 2**20:.1f} MiB at 16-bit", fill=INK, font=font)
    return np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy warns on a read-only view

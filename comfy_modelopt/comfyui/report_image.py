"""Pictures a user looks at: the quantization report (Quantize Model's ``report_image``) and the
quantized model's images beside the 16-bit model's (Compare Images).
Design: docs/design.md, ``comfyui/report_image.py``.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..fileformat import own_base
from ..formats import FORMATS
from ..report import QuantReport, kept_by_kind

WIDTH, HEIGHT = 1024, 600
FONT_PX = 17  # shown at ~half size in a Preview Image node: ~9 px on screen
OTHER, KEPT, INK, GRID, PAPER = (150, 110, 60), (170, 170, 170), (30, 30, 30), (225, 225, 225), (255, 255, 255)


def _colour(name: str):
    fmt = FORMATS.get(own_base(name) or name)  # a low-rank layer in its residual's colour
    return fmt.colour if fmt is not None else OTHER


def _font(px: int = FONT_PX):
    try:
        return ImageFont.load_default(size=px)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font only
        return ImageFont.load_default()


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
    font = _font()
    q, kept = report.quantized, report.kept
    total, base = report.total_bytes(), report.total_bytes_16bit()
    fmt = report.recipe.get("format", "?")
    d.text((16, 8), f"{report.family}, {fmt}{' (planner)' if budget else ''}: {len(q)} layers quantized, "
                    f"{len(kept)} kept 16-bit", fill=INK, font=font)
    d.text((16, 30), f"file {total / 2**20:.1f} MiB = {total / base if base else 0:.3f}x the 16-bit model; "
                     f"mean weight error {report.mean_rel_err():.4f}", fill=INK, font=font)
    # --- per-layer bars
    left, top, right, bottom = 72, 60, WIDTH - 24, 380
    layers = [l for l in report.layers]
    errs = [_error(l) for l in layers]
    what = Counter(w for (_, w), l in zip(errs, layers) if l in q).most_common(1)
    ymax = max([e for (e, _), l in zip(errs, layers) if l in q] + [1e-6]) * 1.1
    d.rectangle([left, top, right, bottom], outline=GRID)
    for i in range(1, 5):
        y = bottom - (bottom - top) * i / 4
        d.line([left, y, right, y], fill=GRID)
        d.text((8, y - 9), f"{ymax * i / 4:.3g}", fill=INK, font=font)
    d.text((left, bottom + 30), f"bar: {what[0][0] if what else 'error'} per layer, in model order", fill=INK,
           font=font)
    step = (right - left) / max(len(layers), 1)
    for i, (layer, (err, _)) in enumerate(zip(layers, errs)):
        x0, x1 = left + i * step, left + (i + 1) * step - (1 if step > 3 else 0)
        if layer in q:
            d.rectangle([x0, bottom - (bottom - top) * min(err / ymax, 1.0), max(x1, x0), bottom],
                        fill=_colour(layer.format))
        else:
            d.rectangle([x0, bottom + 6, max(x1, x0), bottom + 14], fill=KEPT)
    # --- legend: formats, then why layers stayed 16-bit
    counts = Counter(l.format for l in q)
    x = left
    for name, n in counts.most_common():
        d.rectangle([x, 436, x + 14, 450], fill=_colour(name))
        label = f"{name}: {n}"
        d.text((x + 20, 434), label, fill=INK, font=font)
        x += 20 + d.textlength(label, font=font) + 24
    if kept:
        d.rectangle([left, 462, left + 14, 476], fill=KEPT)
        d.text((left + 20, 460), f"kept 16-bit ({kept_by_kind([l.reason for l in kept])})"[:100], fill=INK, font=font)
    # --- bytes by format against the 16-bit model (and the planner's budget)
    y0, y1 = 520, 548
    d.text((left, y0 - 24), "file bytes by format (grey: 16-bit tensors); full width = the 16-bit model"
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


def compare(quantized: np.ndarray, reference: np.ndarray, gain: float = 0.0) -> tuple[np.ndarray, dict]:
    """One picture from two [H, W, C] float images in [0, 1]: the 16-bit image, the quantized one
    and |quantized - 16-bit| (mean over channels) times ``gain`` (0: the gain that takes the
    99.5th percentile of the difference to full scale, at most 64x), over a header with the
    error - PSNR, mean and largest absolute difference, the share of pixels changed by more than
    4/255.  Returns the [H', W', 3] uint8 picture and those numbers."""
    if quantized.shape != reference.shape:
        raise ValueError(f"the images differ in size: quantized {tuple(quantized.shape)}, 16-bit "
                         f"{tuple(reference.shape)} (sample both at the same size and batch)")
    q, r = quantized.astype(np.float64), reference.astype(np.float64)
    diff = np.abs(q - r).mean(axis=-1)
    mse = float(((q - r) ** 2).mean())
    p995 = float(np.percentile(diff, 99.5))
    if gain <= 0:
        gain = min(64.0, 1.0 / p995) if p995 > 0 else 1.0
    numbers = {"psnr_db": 10 * np.log10(1.0 / mse) if mse > 0 else float("inf"), "mean_abs": float(diff.mean()),
               "max_abs": float(np.abs(q - r).max()), "changed": float((diff > 4 / 255).mean()), "gain": gain}
    h, w = diff.shape
    heat = np.clip(diff * gain, 0, 1)  # black -> red -> yellow -> white
    heat = np.stack([np.clip(heat * 3, 0, 1), np.clip(heat * 3 - 1, 0, 1), np.clip(heat * 3 - 2, 0, 1)], -1)
    panels = [r, q, heat]
    # the text scales with the picture, which a Preview Image node shows at its own width
    font = _font(max(14, min(48, 3 * w // 40)))
    px = getattr(font, "size", 11)
    gap, head = 8, int(px * 4.6)
    img = Image.new("RGB", (3 * w + 2 * gap, h + head), PAPER)
    for i, panel in enumerate(panels):
        rgb = panel if panel.shape[-1] == 3 else np.repeat(panel[..., :1], 3, -1)
        img.paste(Image.fromarray((np.clip(rgb, 0, 1) * 255 + 0.5).astype(np.uint8)), (i * (w + gap), head))
    d = ImageDraw.Draw(img)
    psnr = f"{numbers['psnr_db']:.1f} dB" if np.isfinite(numbers["psnr_db"]) else "identical"
    d.text((4, 2), f"PSNR {psnr}, mean |diff| {numbers['mean_abs'] * 255:.2f}/255, largest "
                   f"{numbers['max_abs'] * 255:.0f}/255", fill=INK, font=font)
    d.text((4, 2 + int(px * 1.3)), f"{numbers['changed']:.1%} of pixels changed by more than 4/255", fill=INK,
           font=font)
    for i, label in enumerate(("16-bit", "quantized", f"difference x{gain:.3g}")):
        d.text((i * (w + gap) + 4, head - int(px * 1.35)), label, fill=INK, font=font)
    return np.array(img, dtype=np.uint8), numbers

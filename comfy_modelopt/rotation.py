"""ConvRot per layer: the Hadamard rotation (int8_tensorwise's ``convrot``) stays on a layer only
where it lowers that layer's output error - its weight and its activations rounded as ComfyUI
computes the layer (per-row int8 of both, rotated or not) - on the calibration's sampled inputs.
Design: docs/design.md, ``rotation.py``.
"""
from __future__ import annotations

import torch

from .heldout import rel


def output_error(fmt, w: torch.Tensor, x: torch.Tensor, opts: dict) -> float:
    """Relative L2 of the layer's output with weight and input rounded (round to nearest, dynamic
    per-row activations) against the float layer, on rows ``x``."""
    act = fmt.fake_act(x, None, **opts)  # in the format's space (rotated with ConvRot)
    q_out = act @ fmt.search_space(fmt.fake_quant(w, **opts), **opts).T
    ref = x @ w.T
    return rel(q_out - ref, ref)


def choose_rotations(plan, read, stats, progress=None) -> dict | None:
    """Turn ConvRot off on the planned layers where it raises the output error (``read(key)``: a
    weight of the source); the layers are laid out again.  Returns what was chosen (None where the
    recipe asks no rotation or nothing could be measured): layers kept rotated, turned off, and
    the mean output error of the rotated and of the chosen encodings."""
    from .plan import lay_out
    layers = [l for l in plan.quantized if l.opts.get("convrot") and "convrot" in l.fmt.options
              and stats is not None and stats.has(l.rel) and stats.layer(l.rel).has_sample()]
    if not layers:
        return None
    kept, off, rotated_err, chosen_err = 0, [], [], []
    for i, layer in enumerate(layers):
        if progress:
            progress(i, len(layers), f"ConvRot per layer: {layer.name}")
        w = read(layer.name + ".weight").to(torch.float32)
        x = stats.layer(layer.rel).sample().to(device=w.device, dtype=torch.float32)
        plain = dict(layer.opts, convrot=False)
        errs = {True: output_error(layer.fmt, w, x, layer.opts), False: output_error(layer.fmt, w, x, plain)}
        rotated_err.append(errs[True])
        if errs[False] < errs[True]:
            layer.opts = plain
            lay_out(layer, layer.fmt, plan.recipe)
            off.append(layer.name)
        else:
            kept += 1
        chosen_err.append(min(errs.values()))
    return {"rotated": kept, "off": len(off), "off_layers": off[:8],
            "mean_err_rotated": sum(rotated_err) / len(layers), "mean_err_chosen": sum(chosen_err) / len(layers)}


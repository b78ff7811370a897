"""Collect ActivationStats from real forward passes: hooks on every Linear input, and the
module's first call kept (``calls.RecordedCall``: the shapes sampling uses, for a runtime to
compile ahead).  Design: docs/design.md, ``calibrate.py``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from .calls import RecordedCall
from .stats import INF_NAN_BIN, ActivationStats, CalibrationError, LayerStats, UpdateGraphs, rows_for_budget


@dataclass(frozen=True)
class CalibrationOptions:
    """How statistics are collected (the defaults suit every model; memory is bounded)."""
    reservoir_bytes: int = 2 << 20     # sampled input rows kept per layer (bf16)
    seed: int = 0
    nonfinite: str = "error"           # "error": refuse NaN/Inf activations; "ignore": count them only
    cuda_graphs: bool = True           # replay the per-call statistics of CUDA inputs (same values)
    check_calls: int = 4               # calls kept whole (host copies) for quantize_module's model-wide checks


def is_linear(module: torch.nn.Module) -> bool:
    """torch Linear layers, and ComfyUI's quantized Linear (not an nn.Linear subclass)."""
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Linear" and hasattr(module, "in_features") and hasattr(module, "weight")


def linear_layers(module: torch.nn.Module, predicate: Callable = is_linear) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in module.named_modules() if name and predicate(m)}


def calibrate(module: torch.nn.Module, forward_loop: Callable[[torch.nn.Module], object],
              options: CalibrationOptions = CalibrationOptions(), stats: ActivationStats | None = None,
              info: dict | None = None, group: Callable[[], int] | None = None) -> ActivationStats:
    """Run ``forward_loop(module)`` with input statistics collected on every Linear layer.

    The hooks live on ``module``'s Linear layers, so ``forward_loop`` must run *that* module (or a
    model that calls it) on representative inputs - for a diffusion model, real prompts over the
    whole denoising trajectory; what it returns is ignored.  ``options`` bounds the memory (rows
    sampled per layer), seeds the sampling and says what to do with NaN/Inf activations.  Pass
    ``stats`` from an earlier call to keep accumulating (more prompts later); ``info`` is stored
    with the statistics (shown by the quantized file's report).  ``group()`` names the prompt
    the loop is running (an int): searches choose on some prompts and check on the others; by
    default every call of ``module`` is its own group.  Raises ``CalibrationError`` when
    the loop never ran the module.  Example (runs as a test, tests/test_docs_examples.py)::

        import torch
        from comfy_modelopt import Recipe, quantize, save_stats
        from comfy_modelopt.calibrate import calibrate

        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
        batches = [torch.randn(16, 64) for _ in range(8)]
        with torch.inference_mode():
            stats = calibrate(model, lambda m: [m(x) for x in batches])
            save_stats(stats, "stats.safetensors")          # or keep it in memory
            sd = {k: v.bfloat16() for k, v in model.state_dict().items()}
            q_sd, metadata, report = quantize(sd, Recipe(), stats, family="generic")
        print(report.summary())                        # W8A8: static input scales from the stats
    """
    layers = linear_layers(module)
    if not layers:
        raise CalibrationError(f"{type(module).__name__} has no Linear layers to calibrate")
    fingerprint = {n: [int(m.out_features), int(m.in_features)] for n, m in layers.items()}
    if stats is None:
        stats = ActivationStats(fingerprint=fingerprint)
        for i, (name, m) in enumerate(layers.items()):
            k = int(m.in_features)
            stats.layers[name] = LayerStats(k, rows_for_budget(k, options.reservoir_bytes), seed=options.seed + i,
                                            sanitize=options.nonfinite == "ignore")
    else:
        stats.check_model({n: tuple(v) for n, v in fingerprint.items()})
    if info:
        stats.info.update(info)

    graphs = UpdateGraphs() if options.cuda_graphs else None

    # Statistics are updated in place, always under inference mode, whichever mode the caller's
    # loop runs in: tensors created there are inference tensors, which only inference mode may
    # update in place (and normal tensors loaded from a file may be updated there too).
    calls = [0]
    calls_before = stats.forward_calls
    current = group if group is not None else (lambda: calls_before + calls[0] - 1)

    def make_hook(layer_stats: LayerStats):
        def hook(_module, args, kwargs=None):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                with torch.inference_mode():
                    layer_stats.update(x.detach(), graphs, int(current()))
        return hook


    draw = random.Random(options.seed)

    def count(_module, args, kwargs):
        calls[0] += 1
        if stats.first_call is None:
            stats.first_call = RecordedCall.of(args, kwargs)
        # a reservoir of whole calls: each call of the calibration equally likely to be kept
        seen, kept = stats.forward_calls + calls[0], stats.check_calls
        if len(kept) < options.check_calls:
            kept.append(RecordedCall.of(args, kwargs))
        elif options.check_calls and draw.random() < options.check_calls / seen:
            kept[draw.randrange(options.check_calls)] = RecordedCall.of(args, kwargs)
        if calls[0] == 2 and options.nonfinite == "error":  # the first evaluation done: one read of its counts
            _first_nonfinite(stats, layers)

    handles = [module.register_forward_pre_hook(count, with_kwargs=True)]
    try:
        for name, m in layers.items():
            handles.append(m.register_forward_pre_hook(make_hook(stats.layers[name])))
        forward_loop(module)
    finally:
        for h in handles:
            h.remove()
        if graphs is not None:
            graphs.release()
        with torch.inference_mode():
            for s in stats.layers.values():
                s.finish()
    stats.forward_calls += calls[0]
    _check(stats, options)
    return stats


_SOURCES = ("if that layer takes the model's inputs, the conditioning (the text encoder's output: a broken or "
            "mismatched CLIP, an empty prompt) or the latent; deeper in the model, 16-bit overflow - sample it in "
            "bf16 or fp32")


def _first_nonfinite(stats: ActivationStats, layers: dict) -> None:
    """After the model's first evaluation: stop at once where it fed a layer NaN/Inf (the rest of
    the calibration would only repeat it), naming the first such layer in the model's order."""
    for name in layers:
        hist = stats.layers[name].hist
        bad = int(hist[INF_NAN_BIN:].sum()) if hist is not None else 0
        if bad:
            raise CalibrationError(f"NaN/Inf activations at the model's first evaluation, first in {name} ({bad} "
                                   f"values): {_SOURCES}")


def _check(stats: ActivationStats, options: CalibrationOptions) -> None:
    if stats.forward_calls == 0 or not any(s.rows for s in stats.layers.values()):
        raise CalibrationError("calibration saw no forward calls: forward_loop never ran the model "
                               "(check the prompts, steps and that sampling actually ran)")
    bad = sorted((n for n, s in stats.layers.items() if s.nonfinite), key=lambda n: -stats.layers[n].nonfinite)
    if bad and options.nonfinite == "error":
        worst = stats.layers[bad[0]]
        raise CalibrationError(
            f"NaN/Inf activations in {len(bad)} layers (e.g. {bad[0]}: {worst.nonfinite} values): {_SOURCES}")

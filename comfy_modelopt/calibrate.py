"""Collect ActivationStats from real forward passes: hooks on every Linear input, and the
module's first call kept (``RecordedCall``: the shapes sampling uses, for a runtime to compile ahead).

``calibrate(module, forward_loop)`` hooks the input of every Linear layer of any torch module
(ComfyUI's ``comfy.ops`` Linear classes are ``torch.nn.Linear`` subclasses), runs
``forward_loop(module)`` - which owns the data: prompts, sampler, steps - and returns the
statistics.  Hooks are always removed, also when the loop raises or is interrupted.
"""
from __future__ import annotations

import logging
import math
import random
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from .stats import INF_NAN_BIN, ActivationStats, CalibrationError, LayerStats, UpdateGraphs, rows_for_budget


@dataclass(frozen=True)
class CalibrationOptions:
    """How statistics are collected (the defaults suit every model; memory is bounded)."""
    reservoir_bytes: int = 2 << 20     # sampled input rows kept per layer (bf16)
    seed: int = 0
    nonfinite: str = "error"           # "error": refuse NaN/Inf activations; "ignore": count them only
    cuda_graphs: bool = True           # replay the per-call statistics of CUDA inputs (same values)
    check_calls: int = 4               # calls kept whole (host copies) for quantize_module's model-wide checks


@dataclass(frozen=True)
class RecordedCall:
    """A module's first call during calibration: its arguments, tensors copied to the CPU (each
    with the device it came from).  A runtime that compiles per input shape (compiled blocks)
    replays it before the first image, so the image does not pay the compilation; the non-tensor
    arguments are kept as they were (compiled code guards on the options a block reads, such as
    the keys of ComfyUI's transformer_options)."""
    args: tuple
    kwargs: dict

    @classmethod
    def of(cls, args, kwargs) -> "RecordedCall":
        return cls(tree_map(args, _to_host), tree_map(kwargs, _to_host))

    def replay(self, fn, device, first_tensor=None):
        """``fn(*args, **kwargs)``, the CUDA tensors moved to ``device`` (the CPU ones stay there);
        ``first_tensor(x)`` replaces the first positional argument (a perturbed input).

        It runs as the sampler that follows will run, not as the calibration did (compiled code
        guards on the grad mode and on whether its inputs are inference tensors): without grad -
        ComfyUI's samplers are decorated with ``torch.no_grad`` - and in the caller's inference
        mode, which is the process's: a ComfyUI server runs every node under inference mode, a
        script may not, and a file's calibration may have run elsewhere (a server loading a file
        calibrated in a script compiled every block twice; a script whose node ran with grad on
        failed to compile ahead at all)."""
        def back(stored):
            t, where = stored
            return t.to(device if where != "cpu" else "cpu", copy=True)
        with torch.no_grad():
            args, kwargs = tree_map(self.args, back, _Stored), tree_map(self.kwargs, back, _Stored)
            if first_tensor is not None:
                args = (first_tensor(args[0]), *args[1:])
            return fn(*args, **kwargs)

    def cast(self, dtype, positions=(0,), skip=()) -> "RecordedCall":
        """The call with the tensors of the positional arguments at ``positions`` and of every
        keyword argument not in ``skip`` (each, or each in a list) in ``dtype``, integer ones
        (int32, int64) kept - as a model computing in ``dtype`` is called.  A runtime that
        compiles ahead replays the calibration's call on a model of another compute dtype (ComfyUI
        runs a Wan fp8 file in fp16, the bf16 model it was calibrated on in bf16); compiled code
        guards on the dtypes, so a call left in the calibration's dtype compiles code the first
        image never uses (Wan 2.1 compiled again at its first image)."""
        def to(v):
            if isinstance(v, list):
                return [to(x) for x in v]
            if not isinstance(v, _Stored) or v[0].dtype in (torch.int32, torch.int64):
                return v
            return _Stored((v[0].to(dtype), v[1]))
        return RecordedCall(tuple(to(a) if i in positions else a for i, a in enumerate(self.args)),
                            {k: v if k in skip else to(v) for k, v in self.kwargs.items()})

    def signature(self) -> dict | None:
        """The call described in JSON (tensors by shape, dtype and device; the options as they
        are), for a file to carry: a loader in a fresh process compiles ahead from it
        (``from_signature``).  None where an argument is nothing JSON can describe (a function
        in the options, say): compiled code may guard on it."""
        try:
            return {"args": _describe(self.args), "kwargs": _describe(self.kwargs)}
        except TypeError:
            return None

    @classmethod
    def from_signature(cls, sig) -> "RecordedCall":
        """A call of ``signature``'s shapes and options with made-up tensor values (compiled code
        specialises on shapes, dtypes and options, not values).  ``sig`` comes from a file: every
        part is checked (ValueError names the first that is not what ``signature`` writes) and
        the tensors are bounded (``MAX_SIGNATURE_ELEMENTS``)."""
        if not isinstance(sig, dict) or not isinstance(sig.get("args"), dict) or \
                not isinstance(sig.get("kwargs"), dict):
            raise ValueError("not a call signature")
        budget = [MAX_SIGNATURE_ELEMENTS]
        args, kwargs = _build(sig["args"], budget), _build(sig["kwargs"], budget)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise ValueError("a call signature's args must be a tuple and its kwargs a dict")
        return cls(args, kwargs)

    @classmethod
    def read(cls, sig, where: str) -> "RecordedCall | None":
        """``from_signature`` of a description read from the file ``where``; None for one it
        refuses (logged: a runtime then compiles at the first image instead of ahead)."""
        try:
            return cls.from_signature(sig)
        except (ValueError, RecursionError) as e:
            logging.warning(f"[comfy-modelopt] {where}: the model call it describes is not usable ({e}); "
                            "compiled blocks are not compiled ahead from it")
            return None


# what a call signature read from a file may make: a Flux 1024^2 call holds 2.4M elements, Wan
# 2.1 at 81 frames of 832x480 about 9M
MAX_SIGNATURE_ELEMENTS = 1 << 28
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.bool)}


def _describe(v):
    if isinstance(v, _Stored):
        t, where = v
        if str(t.dtype) not in _DTYPES:
            raise TypeError(t.dtype)
        return {"tensor": list(t.shape), "dtype": str(t.dtype), "device": where}
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError("key")
        # pairs, not an object: the file's JSON sorts object keys, and compiled code guards on the
        # order of the options' keys (ComfyUI loops over them)
        return {"dict": [[k, _describe(x)] for k, x in v.items()]}
    if type(v) in (list, tuple):
        return {type(v).__name__: [_describe(x) for x in v]}
    if isinstance(v, uuid.UUID):
        return {"uuid": True}
    if v is None or type(v) in (bool, int, float, str):
        return {"value": v}
    raise TypeError(type(v).__name__)


def _build(d, budget: list):
    if isinstance(d, dict) and set(d) == {"tensor", "dtype", "device"}:
        shape, dtype, where = d["tensor"], _DTYPES.get(d["dtype"]), d["device"]
        if dtype is None or not (isinstance(where, str) and where.isalpha()) or not isinstance(shape, list) \
                or len(shape) > 8 or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"not a described tensor: {str(d)[:80]}")
        budget[0] -= math.prod(shape)
        if budget[0] < 0:
            raise ValueError(f"a call signature's tensors hold more than {MAX_SIGNATURE_ELEMENTS} elements")
        t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype) if dtype.is_floating_point \
            else torch.zeros(shape, dtype=dtype)
        return _Stored((t, where))
    if not isinstance(d, dict) or len(d) != 1:
        raise ValueError(f"not a described value: {str(d)[:80]}")
    (kind, v), = d.items()
    if kind == "value" and (v is None or type(v) in (bool, int, float, str)):
        return v
    if kind == "uuid":
        return uuid.uuid4()
    if kind in ("list", "tuple") and isinstance(v, list):
        items = [_build(x, budget) for x in v]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                      for p in v):
        return {k: _build(x, budget) for k, x in v}
    raise ValueError(f"not a described value: {str(d)[:80]}")


class _Stored(tuple):
    """(a CPU copy of a tensor, the device type it came from)."""


def _to_host(t: torch.Tensor):
    return _Stored((t.detach().to("cpu", copy=True), t.device.type))


def tree_map(v, fn, kind=torch.Tensor):
    """``v`` with every ``kind`` leaf mapped by ``fn``; dicts, lists and tuples copied, anything
    else kept as it is (also how the CUDA-graph runtime copies a model call, ``graph_inputs``)."""
    if isinstance(v, kind):
        return fn(v)
    if isinstance(v, dict):
        return {k: tree_map(x, fn, kind) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and not isinstance(v, _Stored):
        return type(v)(tree_map(x, fn, kind) for x in v) if type(v) in (list, tuple) else v
    return v


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
        from comfy_modelopt import Recipe, quantize
        from comfy_modelopt.calibrate import calibrate

        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
        batches = [torch.randn(16, 64) for _ in range(8)]
        with torch.inference_mode():
            stats = calibrate(model, lambda m: [m(x) for x in batches])
            stats.save("stats.safetensors")            # or keep it in memory
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

"""Plan -> choose -> encode, one layer at a time.

``quantize_layer`` turns one float weight into its output tensors and a LayerReport;
``quantize_file`` streams a whole safetensors checkpoint through it into the atomic writer.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable

import torch

from . import __version__
from .formats import Format, get_format
from .plan import LayerPlan, Plan, comfy_quant_bytes, make_plan
from .recipe import Recipe
from .report import LayerReport, QuantReport
from .safetensors_io import ITEMSIZE, SafetensorsFile, StreamWriter
from .scales import choose_weight_clip

META_PREFIX = "comfy_modelopt."
Progress = Callable[[int, int, str], None]


class QuantizeError(RuntimeError):
    """A layer that cannot be quantized; the message names it."""


def check_finite(name: str, w: torch.Tensor) -> None:
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        raise QuantizeError(f"{name}: {int(bad.sum())} NaN/Inf values in the weight; refusing to "
                            f"quantize a broken layer (fix the source, or --keep this layer)")


def quantize_layer(w: torch.Tensor, layer: LayerPlan, recipe: Recipe, layer_stats=None
                   ) -> tuple[dict[str, torch.Tensor], LayerReport]:
    """Output tensors (by output key) and the report for one planned, quantized layer."""
    fmt = get_format(layer.format)
    opts = recipe.format_options()
    w = w.to(torch.float32)
    check_finite(layer.name, w)
    xs = layer_stats.sample() if (layer_stats is not None and layer_stats.has_sample()) else None
    clip = choose_weight_clip(w, fmt, recipe.weight_scale, xs=xs, **opts)
    encoded, qt = fmt.encode(w, clip.alpha, **opts)
    deq = qt.dequantize().to(torch.float32)
    tensors = {layer.name + _suffix_key(s): t for s, t in encoded.items()}
    report = LayerReport(layer.name, fmt.name, _nbytes(layer.tensors), layer.n * layer.k * 2,
                         reason=layer.reason, weight_only=layer.weight_only,
                         rel_err=_rel(deq - w, w), alpha=clip.mean_alpha)
    if xs is not None:
        report.out_err = _rel((deq - w) @ xs.T, w @ xs.T)
    if layer.static_input:
        from .scales import choose_input_scale
        scale = choose_input_scale(layer_stats, fmt, recipe)
        tensors[layer.name + ".input_scale"] = torch.tensor(scale, dtype=torch.float32)
        report.input_scale = scale
    tensors[layer.name + ".comfy_quant"] = torch.frombuffer(
        bytearray(comfy_quant_bytes(layer.conf)), dtype=torch.uint8)
    return tensors, report


def _suffix_key(suffix: str) -> str:
    from .plan import SUFFIX_KEYS
    return SUFFIX_KEYS[suffix]


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


def kept_report(layer: LayerPlan) -> LayerReport:
    return LayerReport(layer.name, layer.src_dtype.lower(), _nbytes(layer.tensors),
                       layer.n * layer.k * 2, reason=layer.reason)


# ====================================================================== files
def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fit(text: str, width: int) -> str:
    """Pad ``text`` with JSON whitespace to ``width`` serialized characters (or fail)."""
    have = len(json.dumps(text, ensure_ascii=False))
    if have > width:
        raise RuntimeError(f"report grew past its reserved header space ({have} > {width})")
    return text + " " * (width - have)


def output_metadata(plan: Plan, report: QuantReport, source_meta: dict, source_info: dict,
                    stats_summary: str | None = None, report_width: int | None = None) -> dict[str, str]:
    meta = {k: v for k, v in source_meta.items()
            if k != "_quantization_metadata" and not k.startswith(META_PREFIX)}
    meta["_quantization_metadata"] = plan.quantization_metadata()
    meta[META_PREFIX + "version"] = __version__
    meta[META_PREFIX + "recipe"] = plan.recipe.to_json()
    meta[META_PREFIX + "family"] = plan.family.name
    meta[META_PREFIX + "source"] = json.dumps(source_info, sort_keys=True)
    if stats_summary is not None:
        meta[META_PREFIX + "calibration"] = stats_summary
    text = report.header_json()
    meta[META_PREFIX + "report"] = text if report_width is None else _fit(text, report_width)
    return meta


def quantize_file(src: str, out: str, recipe: Recipe, stats=None, overwrite: bool = False,
                  hash_source: bool = False, progress: Progress | None = None) -> QuantReport:
    """Quantize checkpoint ``src`` into ``out`` (atomic; ``src`` is only read)."""
    t0 = time.perf_counter()
    src_abs, out_abs = os.path.realpath(src), os.path.realpath(out)
    if src_abs == out_abs:
        raise ValueError(f"{out}: output would overwrite the input model; choose another path")
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out} already exists (use --overwrite to replace it)")
    with SafetensorsFile(src) as f:
        source = {k: (t.dtype, t.shape) for k, t in f.tensors.items()}
        plan = make_plan(source, recipe, stats=stats)
        if stats is not None:
            stats.check_model({l.rel: (l.n, l.k) for l in plan.layers})
        report = QuantReport(plan.family.name, recipe.to_dict(), [kept_report(l) for l in plan.layers])
        for key, (dtype, shape) in plan.passthrough.items():
            report.passthrough_bytes += f.tensors[key].nbytes
            is_float = dtype in ("F16", "BF16", "F32", "F64")
            report.passthrough_bytes_16bit += f.tensors[key].nbytes // ITEMSIZE[dtype] * 2 if is_float \
                else f.tensors[key].nbytes
        _add_notes(plan, report)
        source_info = {"name": os.path.basename(src), "bytes": f.size}
        if hash_source:
            source_info["sha256"] = sha256_file(src)
        summary = stats.summary_json() if stats is not None else None
        # The report is filled in after the run: reserve room for its variable-length parts.
        width = len(json.dumps(report.header_json())) + 96 * len(plan.layers) + 1024
        meta = output_metadata(plan, report, f.metadata, source_info, summary, width)
        with StreamWriter(out, plan.entries(), meta, overwrite=overwrite) as writer:
            for key in plan.passthrough:
                writer.write(key, f.read(key))
            by_name = {l.name: i for i, l in enumerate(plan.layers)}
            for done, layer in enumerate(plan.layers):
                if progress:
                    progress(done, len(plan.layers), layer.name)
                w = f.read(layer.name + ".weight")
                if not layer.quantized:
                    writer.write(layer.name + ".weight", w)
                    continue
                layer_stats = stats.layer(layer.rel) if stats is not None and stats.has(layer.rel) else None
                tensors, rep = quantize_layer(w, layer, recipe, layer_stats)
                del w
                for key, t in tensors.items():
                    writer.write(key, t)
                report.layers[by_name[layer.name]] = rep
            if progress:
                progress(len(plan.layers), len(plan.layers), "")
            report.seconds = time.perf_counter() - t0
            writer.close(output_metadata(plan, report, f.metadata, source_info, summary, width))
    return report


def _add_notes(plan: Plan, report: QuantReport) -> None:
    fmt: Format = get_format(plan.recipe.format)
    if plan.family.name == "unknown":
        kept = [l.rel for l in plan.kept if "generic rule" in l.reason or "unknown rule" in l.reason]
        report.notes.append("unknown model family: generic rules kept 16-bit: "
                            + (", ".join(kept) if kept else "nothing"))
    if fmt.needs_input_scale and any(l.weight_only for l in plan.quantized):
        report.notes.append(f"{fmt.name} without activation statistics is written weight-only "
                            "(full_precision_matrix_mult): smaller, not faster. Calibrate "
                            "(--stats) for W8A8 with static input scales.")

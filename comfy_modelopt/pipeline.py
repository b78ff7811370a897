"""Whole-model quantization: plan the output, stream the source through ``quantize_layer`` into a
sink (the atomic file writer, or an in-memory state dict for ComfyUI), one layer at a time.

A source is anything with ``tensors`` (key -> (safetensors dtype, shape)), ``metadata`` and
``read(key)``; a sink has ``open(entries, metadata)``, ``write(key, tensor)``,
``close(metadata)`` and ``abort()``.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import __version__
from .folding import fold_groups, producer_rows
from .formats import get_format
from .plan import Plan, make_plan
from .quantize import kept_report, quantize_conv, quantize_layer
from .recipe import Recipe
from .report import QuantReport
from .safetensors_io import FLOAT_DTYPES, ITEMSIZE, TORCH_DTYPES, SafetensorsFile, StreamWriter
from .smoothing import search_smoothing

META_PREFIX = "comfy_modelopt."
Progress = Callable[[int, int, str], None]


# ====================================================================== sources and sinks
class FileSource:
    def __init__(self, f: SafetensorsFile):
        self.f = f
        self.tensors = {k: (t.dtype, t.shape) for k, t in f.tensors.items()}
        self.metadata = dict(f.metadata)
        self.nbytes = {k: t.nbytes for k, t in f.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.f.read(key)


class DictSource:
    """An in-memory state dict (tensors may be lazy: ``read`` calls ``loader(key)``)."""

    def __init__(self, shapes: dict, loader: Callable[[str], torch.Tensor], metadata: dict | None = None):
        self.tensors = dict(shapes)
        self.metadata = dict(metadata or {})
        self.nbytes = {k: ITEMSIZE[d] * _numel(s) for k, (d, s) in self.tensors.items()}
        self.read = loader

    @classmethod
    def from_state_dict(cls, sd: dict, metadata: dict | None = None) -> "DictSource":
        from .safetensors_io import ST_DTYPES
        return cls({k: (ST_DTYPES[v.dtype], tuple(v.shape)) for k, v in sd.items()}, sd.__getitem__, metadata)


class DeviceSource:
    """``source`` read onto ``device``: the quantization math (clipping and smoothing searches,
    GPTQ, low-rank splits) runs there - on a GPU a Flux-size model takes about a minute instead
    of 6-30 on a CPU - while the sink writes from the CPU.  Tensors copied unchanged skip the
    round trip (``base``)."""

    def __init__(self, source, device):
        self.base, self.device = source, torch.device(device)
        self.tensors, self.metadata, self.nbytes = source.tensors, source.metadata, source.nbytes

    def read(self, key: str) -> torch.Tensor:
        return self.base.read(key).to(self.device)


class FileSink:
    def __init__(self, path: str, overwrite: bool = False):
        self.path, self.overwrite, self.writer = path, overwrite, None

    def open(self, entries, metadata):
        self.writer = StreamWriter(self.path, entries, metadata, overwrite=self.overwrite)

    def write(self, key, tensor):
        self.writer.write(key, tensor)

    def close(self, metadata):
        return self.writer.close(metadata)

    def abort(self):
        if self.writer is not None:
            self.writer.abort()


class DictSink:
    """Collects the output state dict (on ``device``, CPU by default)."""

    def __init__(self, device="cpu"):
        self.tensors, self.metadata, self.device = {}, {}, device

    def open(self, entries, metadata):
        self.entries, self.metadata = entries, metadata

    def write(self, key, tensor):
        self.tensors[key] = tensor.to(self.device)

    def close(self, metadata):
        missing = set(self.entries) - set(self.tensors)
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors were never produced, e.g. {sorted(missing)[:3]}")
        self.metadata = metadata
        return self.tensors

    def abort(self):
        self.tensors.clear()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ====================================================================== smoothing folds
@dataclass
class Folds:
    consumer: dict = field(default_factory=dict)   # layer name -> s [K]
    rows: dict = field(default_factory=dict)       # tensor key -> (row slice, 1/s): producer outputs
    notes: dict = field(default_factory=dict)      # layer name -> note


def plan_folds(plan: Plan, source, stats, recipe: Recipe, progress: Progress | None = None) -> Folds:
    """Search smoothing scales for every exact fold group and record what to rescale."""
    folds = Folds()
    p = plan.prefix
    rel_layers = {l.rel: l for l in plan.layers}
    rel_tensors = {k[len(p):] for k in source.tensors if k.startswith(p)}
    groups = fold_groups(plan.family.name, rel_layers, rel_tensors)
    fmt = get_format(recipe.format)
    opts = recipe.format_options()
    for i, g in enumerate(groups):
        if progress:
            progress(i, len(groups), "smoothing " + g.consumers[0])
        first = g.consumers[0]
        if not stats.has(first) or not stats.layer(first).has_sample():
            continue
        if g.kind != "norm" and fmt.name.startswith("float8") and rel_layers[g.producer].quantized:
            # dividing a quantized producer's rows by s shrinks some rows far below the one
            # per-tensor fp8 scale they share, and the consumer's search cannot see that error
            # (an SD block, tests/test_calibration.py: 1.28x the unsmoothed error with these
            # folds, 0.88x without; full SDXL in docs/benchmarks.md)
            for c in g.consumers:
                folds.notes[p + c] = (f"{recipe.smoothing}: not folded into {g.producer} (quantized with one "
                                      f"per-tensor fp8 scale)")
            continue
        st = stats.layer(first)
        w = torch.cat([_read_rows_scaled(source, p + c + ".weight", folds) for c in g.consumers])
        dev = w.device
        res = search_smoothing(w, st.sample().to(dev), st.channel_absmax.float().to(dev),
                               st.channel_mean_abs().to(dev), fmt, recipe.smoothing,
                               static_input=rel_layers[first].static_input, **opts)
        if res.scales is None:
            for c in g.consumers:
                folds.notes[p + c] = f"{recipe.smoothing}: no gain"
            continue
        inv = 1.0 / res.scales
        for c in g.consumers:
            folds.consumer[p + c] = res.scales
            folds.notes[p + c] = (f"{recipe.smoothing} a={res.alpha:.1f} folded into {g.producer} "
                                  f"(out err {res.base_error:.4f}->{res.error:.4f})")
        if g.kind == "norm":
            for suffix in (".weight", ".bias"):
                folds.rows[p + g.producer + suffix] = (slice(None), inv)
        else:
            layer = rel_layers[g.producer]
            rows = producer_rows(g.kind, layer.n)
            folds.rows[p + g.producer + ".weight"] = (rows, inv)
            if p + g.producer + ".bias" in source.tensors:
                folds.rows[p + g.producer + ".bias"] = (rows, inv)
    return folds


def _read_rows_scaled(source, key: str, folds: Folds) -> torch.Tensor:
    t = source.read(key).float()
    if key in folds.rows:
        rows, inv = folds.rows[key]
        inv = inv.to(t.device)
        t = t.clone()
        t[rows] = t[rows] * (inv.reshape(-1, 1) if t.dim() == 2 else inv)
    return t


def _passthrough(source, key: str, folds: Folds, dtype: str) -> torch.Tensor:
    """Source tensor with its fold rescaling applied, in its planned output dtype."""
    t = _read_rows_scaled(source, key, folds) if key in folds.rows else getattr(source, "base", source).read(key)
    return t.to(TORCH_DTYPES[dtype])


# ====================================================================== the pipeline
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
    if plan.recipe.own_loader:
        meta[META_PREFIX + "loader"] = "comfy-modelopt"  # stock ComfyUI cannot run these layers
    meta[META_PREFIX + "source"] = json.dumps(source_info, sort_keys=True)
    if stats_summary is not None:
        meta[META_PREFIX + "calibration"] = stats_summary
    text = report.header_json()
    meta[META_PREFIX + "report"] = text if report_width is None else _fit(text, report_width)
    return meta


def quantize_source(source, sink, recipe: Recipe, stats=None, source_info: dict | None = None,
                    progress: Progress | None = None, check_interrupt: Callable[[], None] | None = None
                    ) -> QuantReport:
    """Quantize ``source`` into ``sink`` layer by layer; returns the report."""
    t0 = time.perf_counter()
    plan = make_plan(source.tensors, recipe, stats=stats)
    if stats is not None:
        stats.check_model({l.rel: (l.n, l.k) for l in plan.layers})
    report = QuantReport(plan.family.name, recipe.to_dict(), [kept_report(l) for l in plan.layers])
    for key, (dtype, shape) in plan.passthrough.items():
        nbytes = source.nbytes[key]
        report.passthrough_bytes += nbytes
        report.passthrough_bytes_16bit += nbytes // ITEMSIZE[dtype] * 2 if dtype in FLOAT_DTYPES else nbytes
    _add_notes(plan, report, stats)
    folds = Folds()
    if recipe.smoothing != "none":
        if stats is None:
            raise ValueError(f"smoothing={recipe.smoothing} needs activation statistics (--stats)")
        if not recipe.own_loader:  # own-loader files carry smoothing per layer instead
            folds = plan_folds(plan, source, stats, recipe, progress)
    summary = stats.summary_json() if stats is not None else None
    info = dict(source_info or {})
    per_layer = 120 + (220 if stats is not None else 0)
    width = len(json.dumps(report.header_json())) + per_layer * len(plan.layers) + 300 * len(plan.convs) + 1024
    sink.open(plan.entries(), output_metadata(plan, report, source.metadata, info, summary, width))
    try:
        for key, (dtype, _shape) in plan.passthrough.items():
            sink.write(key, _passthrough(source, key, folds, dtype))
        by_name = {l.name: i for i, l in enumerate(plan.layers)}
        total = len(plan.layers) + len(plan.convs)  # convolutions count toward the bar too
        for done, layer in enumerate(plan.layers):
            if check_interrupt:
                check_interrupt()
            if progress:
                progress(done, total, layer.name)
            key = layer.name + ".weight"
            if not layer.quantized:
                sink.write(key, _passthrough(source, key, folds, layer.tensors[key][0]))
                continue
            w = _read_rows_scaled(source, key, folds) if key in folds.rows else source.read(key)
            layer_stats = stats.layer(layer.rel) if stats is not None and stats.has(layer.rel) else None
            tensors, rep = quantize_layer(w, layer, recipe, layer_stats, smooth=folds.consumer.get(layer.name))
            del w
            if recipe.smoothing != "none" and not recipe.own_loader:
                fold_note = folds.notes.get(layer.name, "smoothing skipped: no exact fold into a stock "
                                                        "ComfyUI file for this layer")
                rep.notes = ", ".join(x for x in (fold_note, rep.notes) if x)
            for k, t in tensors.items():
                sink.write(k, t)
            report.layers[by_name[layer.name]] = rep
        for done, conv in enumerate(plan.convs, len(plan.layers)):
            if check_interrupt:
                check_interrupt()
            if progress:
                progress(done, total, conv.name)
            tensors, rep = quantize_conv(source.read(conv.name + ".weight"), conv)
            for k, t in tensors.items():
                sink.write(k, t)
            report.layers.append(rep)
        if progress:
            progress(total, total, "")
        report.seconds = time.perf_counter() - t0
        sink.close(output_metadata(plan, report, source.metadata, info, summary, width))
    except BaseException:
        sink.abort()
        raise
    return report


def _add_notes(plan: Plan, report: QuantReport, stats) -> None:
    fmt = get_format(plan.recipe.format)
    if plan.family.name == "unknown":
        kept = [l.rel for l in plan.kept if "unknown rule" in l.reason]
        report.notes.append("unknown model family: generic rules kept 16-bit: "
                            + (", ".join(kept) if kept else "nothing"))
    if fmt.needs_input_scale and any(l.weight_only for l in plan.quantized):
        if stats is None:
            report.notes.append(f"{fmt.name} without activation statistics is written weight-only "
                                "(full_precision_matrix_mult): smaller, not faster. Calibrate "
                                "(--stats) for W8A8 with static input scales.")
        else:
            n = sum(1 for l in plan.quantized if l.weight_only)
            report.notes.append(f"{n} layers never ran during calibration: written weight-only")
    if stats is not None:
        never = [l.rel for l in plan.quantized if not stats.has(l.rel)]
        if never and not fmt.needs_input_scale:
            report.notes.append(f"{len(never)} layers never ran during calibration (weight-only "
                                f"searches for them), e.g. {never[0]}")


# ====================================================================== files
def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def quantize_file(src: str, out: str, recipe: Recipe, stats=None, overwrite: bool = False,
                  hash_source: bool = False, progress: Progress | None = None, device=None) -> QuantReport:
    """Quantize checkpoint ``src`` into ``out`` (atomic; ``src`` is only read), computing on
    ``device`` (default: the CPU; weights travel there one layer at a time)."""
    if os.path.realpath(src) == os.path.realpath(out):
        raise ValueError(f"{out}: output would overwrite the input model; choose another path")
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out} already exists (use --overwrite to replace it)")
    with SafetensorsFile(src) as f:
        info = {"name": os.path.basename(src), "bytes": f.size}
        if hash_source:
            info["sha256"] = sha256_file(src)
        source = FileSource(f) if device is None else DeviceSource(FileSource(f), device)
        return quantize_source(source, FileSink(out, overwrite), recipe, stats, info, progress)


__all__ = ["quantize_file", "quantize_source", "FileSource", "DictSource", "DeviceSource", "FileSink", "DictSink",
           "TORCH_DTYPES"]

"""Whole-model quantization: plan the output, stream the source through ``quantize_layer`` into a
sink (the atomic file writer, or an in-memory state dict for ComfyUI), one layer at a time.
Design: docs/design.md, ``pipeline.py``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, NamedTuple

import torch

from .errors import ModelOptError, OutputError, PlanError, QuantizeError
from .families import GENERIC, Family, family_named
from .folding import Folds, plan_folds, read_rows_scaled
from .plan import ConvPlan, Plan, make_plan
from .planner import allowance_recipe, plan_budget
from .layer import kept_report, quantize_conv, quantize_layer
from .recipe import Recipe
from .rotation import choose_rotations
from .report import (LayerReport, QuantReport, gptq_rows_note, header_room, nonfinite_note, output_metadata, plan_notes,
                     planner_note)
from .sources import DeviceSource, DictSink, DictSource, FileSink, FileSource, NullSink, check_memory, sha256_file
from .publish import check_not_input, check_output_path
from .safetensors_io import TORCH_DTYPES, SafetensorsFile
from .statsfile import load_stats
from .verify import check_source

Progress = Callable[[int, int, str], None]


def _copy(source, sink, key: str, folds: Folds, dtype: str, nonfinite: list, recipe: Recipe) -> None:
    """Source tensor ``key`` into ``sink`` with its fold rescaling applied, in its planned output
    dtype.  NaN/Inf in it are listed in ``nonfinite`` (key, count) and refused unless the recipe
    allows them (``allow_nonfinite``: copied and noted) - a sampler would turn them into a black image."""
    check_memory(source, key)
    t = read_rows_scaled(source, key, folds) if key in folds.rows else getattr(source, "base", source).read(key)
    bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() and t.numel() else 0
    if bad:
        nonfinite.append((key, bad))
        if not recipe.allow_nonfinite:
            raise QuantizeError(f"{key}: holds {bad} NaN/Inf values; the output would too - quantize from an "
                                f"undamaged model, or pass --allow-nonfinite to copy them as they are")
    sink.write(key, t.to(TORCH_DTYPES[dtype]))


# ====================================================================== the pipeline
@dataclass
class Job:
    """What one ``quantize`` call decides by, past its source and its output (its parameters of
    the same names), carried through the pipeline's steps as one record."""
    recipe: Recipe
    stats: object = None
    family: str | Family = "auto"
    refuse_unknown: bool = True
    engine: object = None
    prices: dict | None = None
    shard: object = None
    progress: Progress | None = None
    check_interrupt: Callable[[], None] | None = None
    source_info: dict | None = None


class Quantized(NamedTuple):
    """What ``quantize`` returns: the output state dict and its file's safetensors metadata (None
    where the output went to ``out`` or to the caller's ``sink``), and the report."""
    tensors: dict | None
    metadata: dict | None
    report: QuantReport


def quantize(source, recipe: Recipe, stats=None, *, out=None, overwrite: bool = False, sink=None,
             family: str | Family = "auto", refuse_unknown: bool = True, engine=None, prices: dict | None = None,
             device=None, shard=None, progress: Progress | bool | None = None,
             check_interrupt: Callable[[], None] | None = None, source_info: dict | None = None,
             hash_source: bool = False, metadata: dict | None = None) -> Quantized:
    """The one way in - the CLI, the nodes, the launcher and ``quantize_module`` call it: ``source``
    quantized with ``recipe``, planned first, then streamed one layer at a time.

    ``source``: a state dict (a diffusion model's, any prefix ComfyUI knows; untouched, ``metadata``
    its file's), the path of a safetensors checkpoint (only read), or a source (``sources.py``;
    ComfyUI's MODEL through ``comfyui.model.PatcherSource``).  The output goes to the file ``out``
    (written atomically; ``overwrite`` replaces one), else to ``sink`` (``sources.py``), else into
    the state dict returned (CPU tensors).
    ``stats``: ``ActivationStats`` or the path of a statistics file (static input scales, smoothing,
    GPTQ); without it the weights are quantized from their values alone.
    ``family``: "auto" detects the family (a model of none it knows is refused with
    ``refuse_unknown`` - a LoRA, a text encoder, a VAE -, else planned with the generic rules);
    "generic" or a family name (``families.FAMILY_CHOICES``) applies those rules instead.
    ``engine`` (``modelopt_engine.EngineResult``): ModelOpt's calibration choices (input ranges,
    absmax weights, its smoothing folded where exact) instead of the own searches.  ``prices``: the
    planner's options priced by the caller (``modules.price_end_to_end``), with ``recipe.budget`` or
    ``recipe.max_error``.  ``device``: where the math runs (weights travel there one layer at a
    time).  ``shard`` (``distributed.Shard.current()`` under torchrun): every rank calls this alike,
    the layers are encoded across the ranks and rank 0 writes (its report is the whole one).
    ``progress(done, total, layer_name)`` is called as layers finish (None: ``progress.Progress`` on
    the terminal when stderr is one - phase, layer i/N, ETA; False: silent), ``check_interrupt()`` before
    each (it raises to stop); ``source_info`` is what the header records of the source (a file's
    name and size, with ``hash_source`` its sha256)."""
    if out is not None and sink is not None:
        raise ValueError("quantize writes to out or to sink, not both")
    if progress is None:  # a library call in an interactive terminal shows where it is
        from .progress import Progress as Console
        progress = Console("quantizing") if sys.stderr.isatty() else None
    progress = progress or None
    writes = shard is None or shard.rank == 0
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    if out is not None:
        out = os.fspath(out)
        if writes:
            if path is not None:
                check_not_input(out, path, "output")
            check_output_path(out, overwrite)
        sink = FileSink(out, overwrite) if writes else NullSink()
    stats = _stats_of(stats)  # outside the source's error naming: a statistics file names itself
    own = sink is None
    sink = DictSink() if own else sink
    with contextlib.ExitStack() as files:
        if path is not None:
            f = files.enter_context(SafetensorsFile(path))
            source_info = {"name": os.path.basename(path), "bytes": f.size,
                           **({"sha256": sha256_file(path)} if hash_source else {}), **(source_info or {})}
            source = FileSource(f)
        elif isinstance(source, Mapping):
            source = DictSource.from_state_dict(source, metadata)
        if device is not None:
            source = DeviceSource(source, device)
        try:
            report = _quantize_into(source, sink, Job(recipe, stats, family, refuse_unknown, engine, prices, shard,
                                                      progress, check_interrupt, source_info))
        except ModelOptError as e:
            whose = None if path is None else os.path.basename(out) if isinstance(e, OutputError) and out else f.name
            if whose is None or whose in str(e):
                raise
            raise type(e)(f"{whose}: {e}") from None
    return Quantized(sink.tensors if own else None, sink.metadata if own else None, report)


def quantize_file(src: str | os.PathLike, out: str | os.PathLike, recipe: Recipe, stats=None, **options) -> QuantReport:
    """The report of ``quantize(src, recipe, stats, out=out, **options)``: checkpoint ``src`` (a
    diffusion model, or a full checkpoint holding one) into the file ``out``."""
    return quantize(src, recipe, stats, out=out, **options).report


def _quantize_into(source, sink, job: Job) -> QuantReport:
    t0 = time.perf_counter()
    recipe, stats, engine, progress = job.recipe, job.stats, job.engine, job.progress
    needs = recipe.needs_statistics()
    if needs and stats is None:  # a file must not record an option that did nothing
        raise PlanError(f"{', '.join(needs)} needs activation statistics: calibrate the model and pass the "
                        f"statistics (--stats FILE, or the calibration input of Quantize Model)")
    no_gptq = stats is None and recipe.gptq
    recipe = (recipe.without_statistics() if stats is None else recipe).effective()
    if engine is not None:
        recipe = replace(recipe, fp8_allowance=0.0)  # ModelOpt's choices, not the planner's
        engine.check(recipe, stats)
    if job.prices is not None and not recipe.planned:
        raise PlanError("prices are the planner's: give a budget or max_error too")
    job = replace(job, recipe=recipe)  # the effective recipe, for the steps below
    plan, report = _plan_and_report(source, job)
    if no_gptq:
        report.notes.append("gptq: off - it needs activation statistics (calibrate for error-compensated rounding)")
    folds = Folds()
    if engine is not None:
        report.notes.append(engine.note())
        given = engine.smoothing()
        if given and not recipe.lowrank:  # own-loader low-rank layers carry the scales themselves
            folds = plan_folds(plan, source, stats, recipe, progress, given=given)
    elif recipe.smoothing != "none" and not recipe.own_loader:  # own-loader files carry it per layer
        folds = plan_folds(plan, source, stats, recipe, progress)
    summary = stats.summary_json() if stats is not None else None
    info = dict(job.source_info or {})
    width = header_room(plan, report, stats is not None)
    sink.open(plan.entries(), output_metadata(plan, report, source.metadata, info, summary, width))
    try:
        _stream(plan, report, source, sink, folds, job)
        if plan.planner:
            report.notes.append(planner_note(plan.planner, report))
        report.seconds = time.perf_counter() - t0
        sink.close(output_metadata(plan, report, source.metadata, info, summary, width))
    except BaseException:
        sink.abort()
        raise
    return report


def _plan_and_report(source, job: Job) -> tuple[Plan, QuantReport]:
    """The plan, checked against the statistics, and the report it starts (every layer 16-bit)."""
    recipe, stats, family, progress = job.recipe, job.stats, job.family, job.progress
    if isinstance(family, str):
        family = None if family == "auto" else family_named(family)
    def checked(plan: Plan) -> dict | None:
        """The source and the statistics checked against the layout, then (before any weight is
        read) the mixed-precision planner's choices: the plan is frozen after this."""
        check_source(source, plan.prefix, complete=family is not GENERIC)
        if stats is not None:
            stats.check_model({l.rel: (l.n, l.k) for l in plan.layers})
        planned = recipe if recipe.planned else allowance_recipe(plan, recipe)
        summary = plan_budget(plan, source, stats, planned, progress, job.prices) if planned else None
        plan.rotation = choose_rotations(plan, source.read, stats, progress)
        return summary
    plan = make_plan(source.tensors, recipe, stats=stats, refuse_unknown=job.refuse_unknown, family=family,
                     engine=job.engine, planner=checked)
    report = QuantReport(plan.family.name, recipe.to_dict(), [kept_report(l) for l in plan.layers])
    plan_notes(plan, report, stats, source.nbytes)
    return plan, report


def _stream(plan: Plan, report: QuantReport, source, sink, folds: Folds, job: Job) -> None:
    """Every planned tensor from ``source`` into ``sink``: copies first, then one layer at a time.
    Sharded: each quantized layer is encoded by the rank ``shard.assign`` gives it; rank 0
    writes everything."""
    recipe, nonfinite, stats, progress, shard = plan.recipe, [], job.stats, job.progress, job.shard
    writes = shard is None or shard.rank == 0
    for key, (dtype, _shape) in plan.passthrough.items() if writes else ():
        _copy(source, sink, key, folds, dtype, nonfinite, recipe)
    by_name = {l.name: i for i, l in enumerate(plan.layers)}
    total = len(plan.layers) + len(plan.convs)  # convolutions count toward the bar too
    items, owner = (plan.layers + plan.convs, None) if shard is None else shard.schedule(plan)
    for done, layer in enumerate(items):
        if job.check_interrupt:
            job.check_interrupt()
        if progress:
            progress(done, total, layer.name)
        key = layer.name + ".weight"
        if isinstance(layer, ConvPlan):
            if not writes:
                continue
            tensors, rep = quantize_conv(source.read(key), layer)
            report.layers.append(rep)
        elif not layer.quantized:
            if writes:
                _copy(source, sink, key, folds, layer.tensors[key][0], nonfinite, recipe)
            continue
        elif shard is not None and owner[layer.name] != shard.rank:
            if not writes:
                continue  # another rank's layer, and rank 0 collects it
            planned = {k: (TORCH_DTYPES[d], tuple(sh)) for k, (d, sh) in layer.tensors.items()}
            tensors, text = shard.recv_layer(planned, owner[layer.name])
            report.layers[by_name[layer.name]] = LayerReport.from_json(layer.name, text)
        else:
            tensors, rep = _encode(source, layer, plan, stats, folds)
            if not writes:  # encoded here, written by rank 0
                shard.send_layer(tensors, rep.header_json())
                continue
            report.layers[by_name[layer.name]] = rep
        for k, t in tensors.items():
            sink.write(k, t)
    if shard is not None:
        shard.flush()
    if progress:
        progress(total, total, "")
    if nonfinite:
        report.notes.append(nonfinite_note(nonfinite))
    if recipe.gptq and writes:
        note = gptq_rows_note(report)
        if note:
            report.notes.append(note)


def _encode(source, layer, plan: Plan, stats, folds: Folds) -> tuple[dict, LayerReport]:
    """One quantized layer read (with its fold rescaling), encoded, and its report noting the
    smoothing fold."""
    key, recipe = layer.name + ".weight", plan.recipe
    check_memory(source, key, float32_copies=3)
    w = read_rows_scaled(source, key, folds) if key in folds.rows else source.read(key)
    layer_stats = stats.layer(layer.rel) if stats is not None and stats.has(layer.rel) else None
    tensors, rep = quantize_layer(w, layer, plan, layer_stats, smooth=folds.consumer.get(layer.name))
    if (recipe.smoothing != "none" and not recipe.own_loader) or layer.name in folds.notes:
        fold_note = folds.notes.get(layer.name, "smoothing skipped: no exact fold into a stock ComfyUI file for "
                                                "this layer")
        rep.notes = ", ".join(x for x in (fold_note, rep.notes) if x)
    return tensors, rep


def _stats_of(stats):
    """``ActivationStats`` as given, or loaded from a statistics file's path."""
    return load_stats(os.fspath(stats)) if isinstance(stats, (str, os.PathLike)) else stats


__all__ = ["quantize", "quantize_file", "Quantized", "FileSource",
           "DictSource", "DeviceSource", "FileSink", "DictSink", "NullSink", "TORCH_DTYPES"]

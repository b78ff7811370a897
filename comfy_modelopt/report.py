"""QuantReport: per-layer format, bytes and error; JSON for the checkpoint header and a table.

Numbers in the header JSON are written with fixed widths, so the report can be laid out in the
header before quantizing and filled in afterwards without moving any tensor data.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .errors import CheckpointError, one_line
from . import __version__
from .fileformat import (CONV_FORMAT, META_CALIBRATION, META_FAMILY, META_LOADER, META_PREFIX, META_RECIPE, META_REPORT,
                         META_SOURCE, META_VERSION, OWN_LOADER, QUANT_METADATA, own_base)
from .formats import FORMATS
from .safetensors_io import FLOAT_DTYPES, ITEMSIZE


ACT_WORST = 5  # layers the summary names by activation-rounding cost
NONFINITE_NOTE_ROOM = 600  # header characters kept for the note on NaN/Inf tensors copied
# what a layer's GPTQ note says when its Hessian X^T X came from fewer sampled rows than the layer
# has inputs (rank-deficient: the damping stands in for what was never sampled); the report counts
# these layers (gptq_rows_note).  A 2 MiB reservoir holds 341 rows of a 3072-wide layer, 85 of a
# 12288-wide one; on the real-weights benchmark GPTQ's gain grew with the calibration rows
# (16 -> 160 prompts, docs/benchmarks.md 3a)
FEW_ROWS = "fewer rows than inputs"


@dataclass
class LayerReport:
    name: str
    format: str                  # quantized format, or the 16-bit dtype it kept
    bytes: int                   # bytes of this layer's weight tensors in the output
    bytes_16bit: int             # the same weight at 2 bytes per value
    reason: str = ""             # why kept 16-bit / why weight-only
    weight_only: bool = False
    rel_err: float = 0.0         # ||W - deq(Q(W))|| / ||W||  (kitchen dequantization)
    out_err: float = -1.0        # relative output error on calibration inputs (-1: not measured)
    held_err: float = -1.0       # ... on the held-out prompts' inputs, which no search saw (-1: none)
    act_err: float = -1.0        # held_err less the same weight's error on 16-bit inputs (weight-only):
                                 # what rounding the activations costs on held-out prompts (-1: not measured)
    alpha: float = 1.0           # chosen clip factor (mean over rows for per-row formats)
    input_scale: float = 0.0     # static input_scale written (0: none)
    notes: str = ""              # algorithm notes (smoothing applied/skipped, rank, ...)
    sensitivity: dict = field(default_factory=dict)  # format -> relative output error on samples

    @classmethod
    def from_json(cls, name: str, text: str) -> "LayerReport":
        """Parse ``header_json`` output (TypeError / ValueError when malformed)."""
        return _layer_from_json(name, json.loads(text))

    def header_json(self, notes_limit: int | None = None) -> str:
        # %.4e numbers: the header reserves room for the report, filled in after the run;
        # ``notes_limit``: the notes cut to that many characters (QuantReport.header_json)
        notes = self.notes
        if notes_limit is not None and len(notes) > notes_limit:
            notes = notes[:max(notes_limit - 3, 0)] + "..."
        return ("{" + f'"format":{json.dumps(self.format)},"bytes":{self.bytes},'
                f'"bytes_16bit":{self.bytes_16bit},"rel_err":{_e(self.rel_err)},'
                f'"out_err":{_e(self.out_err)},"held_err":{_e(self.held_err)},"act_err":{_e(self.act_err)},'
                f'"alpha":{_e(self.alpha)},'
                f'"input_scale":{_e(self.input_scale)},"weight_only":{json.dumps(self.weight_only)},'
                f'"reason":{json.dumps(self.reason)},"notes":{json.dumps(notes)},'
                f'"sensitivity":{json.dumps(self.sensitivity, sort_keys=True)}' + "}")


_LAYER_TYPES = {"format": str, "bytes": int, "bytes_16bit": int, "reason": str, "weight_only": bool,
                "rel_err": float, "out_err": float, "held_err": float, "act_err": float, "alpha": float, "input_scale": float, "notes": str,
                "sensitivity": dict}


def _layer_from_json(name: str, v) -> LayerReport:
    if not isinstance(v, dict) or not set(v) <= set(_LAYER_TYPES) or "format" not in v:
        raise TypeError(f"layer {name!r} is not a report entry")
    for k, x in v.items():
        want = _LAYER_TYPES[k]
        if want is bool:
            ok = isinstance(x, bool)
        else:  # JSON numbers: an int is a fine float; a bool is neither
            ok = isinstance(x, (int, float) if want is float else want) and not isinstance(x, bool)
        if not ok:
            raise TypeError(f"layer {name!r}: {k} must be {want.__name__}")
    return LayerReport(name=name, **v)


def _int(x) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError("byte totals must be integers")
    return x


def _e(x: float) -> str:
    return f"{float(x):.4e}"


@dataclass
class QuantReport:
    family: str
    recipe: dict
    layers: list[LayerReport] = field(default_factory=list)
    passthrough_bytes: int = 0
    passthrough_bytes_16bit: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ totals
    def _is_quantized(self, layer: LayerReport) -> bool:
        # per layer: a mixed-precision plan holds several formats
        return layer.format in FORMATS or own_base(layer.format) in FORMATS

    @property
    def quantized(self) -> list[LayerReport]:
        return [l for l in self.layers if self._is_quantized(l)]

    @property
    def kept(self) -> list[LayerReport]:
        return [l for l in self.layers if not self._is_quantized(l) and l.format != CONV_FORMAT]

    @property
    def convs(self) -> list[LayerReport]:
        return [l for l in self.layers if l.format == CONV_FORMAT]

    def total_bytes(self) -> int:
        return self.passthrough_bytes + sum(l.bytes for l in self.layers)

    def total_bytes_16bit(self) -> int:
        return self.passthrough_bytes_16bit + sum(l.bytes_16bit for l in self.layers)

    def mean_rel_err(self) -> float:
        q = self.quantized
        return sum(l.rel_err for l in q) / len(q) if q else 0.0

    def max_rel_err(self) -> float:
        return max((l.rel_err for l in self.quantized), default=0.0)

    # ------------------------------------------------------------------ serialisation
    def header_json(self, notes_limit: int | None = None) -> str:
        """Fixed-width JSON for the safetensors header (same length before and after the run);
        ``notes_limit`` cuts each layer's notes to that many characters (the whole notes stay in
        this object and in ``--report``'s JSON)."""
        body = ",".join(f"{json.dumps(l.name)}:{l.header_json(notes_limit)}" for l in self.layers)
        # no wall time here: the same input and options give a byte-identical file
        return ("{" + f'"family":{json.dumps(self.family)},'
                f'"bytes":{self.total_bytes()},"bytes_16bit":{self.total_bytes_16bit()},'
                f'"notes":{json.dumps(self.notes)},"layers":{{{body}}}' + "}")

    def to_dict(self) -> dict:
        d = json.loads(self.header_json())
        d["recipe"] = self.recipe
        return d

    @classmethod
    def from_header(cls, text: str, recipe: dict, where: str = "report") -> "QuantReport":
        """Parse ``header_json`` output; anything malformed is a CheckpointError naming ``where``."""
        try:
            d = json.loads(text)
            layers = [_layer_from_json(k, v) for k, v in d["layers"].items()]
            notes = d.get("notes", [])
            if not (isinstance(d["family"], str) and isinstance(notes, list)
                    and all(isinstance(n, str) for n in notes)):
                raise TypeError("family/notes have the wrong type")
            rep = cls(d["family"], recipe, layers, notes=notes)
            rep.passthrough_bytes = _int(d["bytes"]) - sum(l.bytes for l in layers)
            rep.passthrough_bytes_16bit = _int(d["bytes_16bit"]) - sum(l.bytes_16bit for l in layers)
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: malformed report ({type(e).__name__}: {one_line(e)[:160]})") from None
        return rep

    def summary(self) -> str:
        fmt = self.recipe.get("format")
        q, kept = self.quantized, self.kept
        total, base = self.total_bytes(), self.total_bytes_16bit()
        lines = [
            f"family: {self.family}   format: {fmt}   layers: {len(q)} quantized, {len(kept)} kept 16-bit",
            f"size: {total / 2**20:.1f} MiB vs {base / 2**20:.1f} MiB at 16-bit "
            f"({total / base if base else 0:.3f}x)",
            f"weight error (relative, quantized layers): mean {self.mean_rel_err():.4f}, "
            f"max {self.max_rel_err():.4f}",
        ]
        held = [l for l in q if l.held_err >= 0]
        if held:
            lines.append(f"output error on held-out prompts (no search saw them): mean "
                         f"{sum(l.held_err for l in held) / len(held):.4f} over {len(held)} layers "
                         f"(on all calibration prompts: {sum(l.out_err for l in held) / len(held):.4f})")
        act = sorted((l for l in q if l.act_err >= 0), key=lambda l: -l.act_err)
        if act:
            worst = ", ".join(f"{l.name} +{l.act_err:.4f}" for l in act[:ACT_WORST])
            share = sum(l.act_err for l in act) / max(sum(l.held_err for l in act), 1e-12)
            # formats with an 8-bit partner (a low-rank own-loader layer is none of FORMATS: no planner there)
            four = any(getattr(FORMATS.get(l.format), "eight_bit", "") for l in act)
            lines.append(f"activation rounding (inputs rounded as a GPU computing the format natively rounds them, "
                         f"vs the same weights on 16-bit inputs; held-out prompts): mean "
                         f"+{sum(l.act_err for l in act) / len(act):.4f} over {len(act)} layers, {share:.0%} of their "
                         f"output error; most: {worst} (fp8: weight_only patterns store such layers without an input "
                         "scale, 16-bit compute there" + ("; 4-bit: fp8_allowance stores the costliest at 8-bit"
                                                          if four and not self.recipe.get("fp8_allowance") else "")
                         + ")")
        convs = self.convs
        if convs:
            lines.append(f"convolutions: {len(convs)} fp8 (per output channel, own loader), weight error "
                         f"mean {sum(l.rel_err for l in convs) / len(convs):.4f}, "
                         f"{sum(l.bytes_16bit - l.bytes for l in convs) / 2**20:.1f} MiB saved")
        if kept:
            lines.append(kept_summary([l.reason for l in kept]))
        wo = [l for l in q if l.weight_only]
        if wo:
            lines.append(f"weight-only: {len(wo)} layers ({kept_by_kind([l.reason for l in wo])})")
        lines += self.notes
        return "\n".join(lines)

    def table(self, limit: int | None = None) -> str:
        rows = [f"{'layer':58s} {'format':16s} {'MiB':>8s} {'rel_err':>8s} {'alpha':>6s}  note"]
        layers = self.layers if limit is None else self.layers[:limit]
        for l in layers:
            note = l.reason or l.notes
            rows.append(f"{l.name[:58]:58s} {l.format:16s} {l.bytes / 2**20:8.2f} "
                        f"{l.rel_err:8.4f} {l.alpha:6.3f}  {note}")
        if limit is not None and len(self.layers) > limit:
            rows.append(f"... {len(self.layers) - limit} more layers")
        return "\n".join(rows)


def reason_kind(reason: str) -> str:
    """The kind of a kept (or weight-only) layer's reason: "--keep", "--weight-only", "family
    rules", a shape rule without the layer's own numbers ("in_features % 256"), or the reason itself."""
    for flag in ("--keep", "--weight-only"):
        if reason.startswith(flag):
            return flag
    if " rule " in reason:
        return "family rules"
    if " needs " in reason and ", got " in reason:  # Format.shape_problem
        rule = reason.split(" needs ", 1)[1].split(", got ", 1)[0]
        return rule.removesuffix(" == 0")
    return reason


def kept_by_kind(reasons: list[str]) -> str:
    """How many layers each kind of reason accounts for, most first ("--keep: 3, family rules: 2")."""
    counts: dict = {}
    for r in reasons:
        kind = reason_kind(r)
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k}: {n}" for k, n in sorted(counts.items(), key=lambda x: (-x[1], x[0])))


def kept_summary(reasons: list[str]) -> str:
    """One line: how many layers stay 16-bit, by kind of reason."""
    return f"kept 16-bit: {len(reasons)} ({kept_by_kind(reasons)})"


# the header's room for the report is reserved before the run, from a per-layer estimate; where
# the layers' notes outgrow it (long GPTQ / block-clip notes on every layer), they are cut in the
# header - shortest cut last - rather than failing a finished run (the whole notes stay in the
# report object, ``--report``'s JSON and the node's text)
NOTES_CUTS = (240, 160, 100, 60, 0)


def fit_header(report: QuantReport, width: int) -> str:
    """The report's header JSON padded with JSON whitespace to ``width`` serialized characters,
    its layer notes cut where they would not fit (or fail)."""
    for cut in (None,) + NOTES_CUTS:
        text = report.header_json(cut)
        have = len(json.dumps(text, ensure_ascii=False))
        if have <= width:
            return text + " " * (width - have)
    raise RuntimeError(f"report grew past its reserved header space ({have} > {width})")


def nonfinite_note(found: list) -> str:
    shown = ", ".join(f"{k} ({n})" for k, n in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    return (f"warning: {len(found)} tensors copied unchanged hold NaN/Inf values: {shown}{more}"
            )[:NONFINITE_NOTE_ROOM - 20]


def planner_note(summary: dict, report: QuantReport) -> str:
    measured = sum(l.out_err for l in report.quantized if l.out_err >= 0)
    counts = ", ".join(f"{n} {f}" for f, n in sorted(summary["counts"].items(), key=lambda x: -x[1]))
    goal = (f"max summed error {summary['max_error']:g}" if not summary["budget"] else
            f"budget {summary['budget']:g} of the 16-bit Linear bytes" if not summary.get("allowance") else
            f"fp8_allowance {summary['allowance']:g} (the layers whose 4-bit rounding costs most per byte stored "
            f"fp8; budget {summary['budget']:.3f})")
    if summary.get("priced") == "end to end":
        errs = (f"{summary['layers']} layers priced end to end (the model's error with each layer's option "
                f"alone swapped in), summed {summary['predicted']:.4g}; layers' own output error measured "
                f"{measured:.4f}")
    else:
        errs = (f"summed output error of the {summary['layers']} planned layers predicted "
                f"{summary['predicted']:.4f} (absmax scales), measured {measured:.4f} (chosen scales)")
    note = f"planner: {goal}, used {summary['fraction']:.3f} of the 16-bit Linear bytes: {counts}; {errs}"
    return note + (f"; {summary['speed']}" if summary["speed"] else "")


def gptq_rows_note(report: QuantReport) -> str:
    """A line for the report when GPTQ rounded layers from fewer sampled rows than they have inputs
    (their Hessian is rank-deficient), with what raises the rows; empty when none did."""
    few = [l for l in report.layers if FEW_ROWS in (l.notes or "")]
    if not few:
        return ""
    return (f"GPTQ rounded {len(few)} layers from fewer sampled input rows than the layer has inputs (e.g. "
            f"{few[0].name}: {few[0].notes.split(FEW_ROWS + ': ')[1].split(']')[0]}): their Hessian is rank-deficient "
            "and its damping stands in for the directions never sampled - keep more samples per layer "
            "(Calibration Helper's samples_mib_per_layer, the launcher's --samples-mib-per-layer; rows = MiB * "
            "2^20 / (2 * inputs)) and, where calibration saw fewer rows than that, sample more prompts")


def output_metadata(plan, report: QuantReport, source_meta: dict, source_info: dict,
                    stats_summary: str | None = None, report_width: int | None = None) -> dict[str, str]:
    """The output file's safetensors metadata: the source's own (less any quantization entries),
    ComfyUI's per-layer quantization map, and this pack's recipe, family, source, calibration
    summary and report (fitted into ``report_width`` characters when given)."""
    meta = {k: v for k, v in source_meta.items()
            if k != QUANT_METADATA and not k.startswith(META_PREFIX)}
    meta[QUANT_METADATA] = plan.quantization_metadata()
    meta[META_VERSION] = __version__
    meta[META_RECIPE] = plan.recipe.to_json()
    meta[META_FAMILY] = plan.family.name
    if plan.recipe.own_loader:
        meta[META_LOADER] = OWN_LOADER  # stock ComfyUI cannot run these layers
    meta[META_SOURCE] = json.dumps(source_info, sort_keys=True)
    if stats_summary is not None:
        meta[META_CALIBRATION] = stats_summary
    meta[META_REPORT] = report.header_json() if report_width is None else fit_header(report, report_width)
    return meta


def header_room(plan, report: QuantReport, calibrated: bool) -> int:
    """The bytes the file's header keeps for the report: written before the layers are encoded, so
    the final report must fit the room it was given (``fit_header``)."""
    per_layer = 120 + (220 if calibrated else 0)
    return (len(json.dumps(report.header_json())) + per_layer * len(plan.layers) + 300 * len(plan.convs)
            + 1024 + NONFINITE_NOTE_ROOM)


def rotation_note(chosen: dict) -> str:
    """The report's line on the per-layer ConvRot choice (``rotation.choose_rotations``)."""
    names = ", ".join(chosen["off_layers"]) + (", ..." if chosen["off"] > len(chosen["off_layers"]) else "")
    return (f"ConvRot per layer: kept on {chosen['rotated']}, off on {chosen['off']} where it raised the layer's "
            f"output error on the calibration rows (mean {chosen['mean_err_rotated']:.4f} all rotated -> "
            f"{chosen['mean_err_chosen']:.4f} as chosen)" + (f": {names}" if chosen["off"] else ""))


def plan_notes(plan, report: QuantReport, stats, nbytes: dict) -> None:
    """The report's bytes of copied tensors (as written; ``nbytes``: the source's, by key) and its notes on
    the plan: an unknown family's rules, fp8 without statistics, NaN/Inf statistics, layers
    calibration never reached, patterns that matched nothing, tensors named like weights that
    are not 2-D, the convolutions kept as the network's ends, the per-layer ConvRot choice."""
    for key, (dtype, shape) in plan.passthrough.items():  # as written (an fp32 source's in 16-bit)
        numel = math.prod(shape)
        written = numel * ITEMSIZE[dtype] if dtype in ITEMSIZE else nbytes[key]
        report.passthrough_bytes += written
        report.passthrough_bytes_16bit += numel * 2 if dtype in FLOAT_DTYPES else written
    fmt = plan.fmt  # the recipe's format (the planner's layers are checked per layer below)
    if plan.conv_ends:
        report.notes.append("convolutions kept 16-bit as the network's input and output (fewest channels): "
                            + ", ".join(plan.conv_ends))
    if plan.family.name == "unknown":
        kept = [l.rel for l in plan.kept if "unknown rule" in l.reason]
        why = f" (a diffusion model by its structure: {plan.recognised})" if plan.recognised else ""
        report.notes.append(f"unknown model family{why}: generic rules kept 16-bit: "
                            + (", ".join(kept) if kept else "nothing"))
    if fmt.needs_input_scale and stats is None and any(l.weight_only for l in plan.quantized):
        report.notes.append(f"{fmt.name} without activation statistics is written weight-only "
                            "(full_precision_matrix_mult): smaller, not faster. Calibrate "
                            "(--stats) for W8A8 with static input scales.")
    if stats is not None:
        bad = sorted(((n, s.nonfinite) for n, s in stats.layers.items() if s.nonfinite), key=lambda x: -x[1])
        if bad:
            report.notes.append(f"warning: the statistics recorded NaN/Inf activations in {len(bad)} layers (e.g. "
                                f"{bad[0][0]}: {bad[0][1]} values; calibrated with nonfinite='ignore'): their scales "
                                f"come from the finite values - check the model, the prompts and the sampler")
        never = [l.rel for l in plan.quantized if not stats.has(l.rel)]
        if never:  # (the layers --weight-only names are counted by the report's weight-only line)
            what = "written weight-only" if fmt.needs_input_scale else "weight-only searches for them"
            report.notes.append(f"{len(never)} layers never ran during calibration ({what}), e.g. {never[0]}")
    report.notes.extend(plan.unmatched_patterns)
    if plan.odd:
        shown = ", ".join(f"{k} {list(sh)}" for k, sh in plan.odd[:3])
        report.notes.append(f"{len(plan.odd)} tensors named like Linear weights are not 2-D and were copied "
                            f"unchanged: {shown}{' ...' if len(plan.odd) > 3 else ''}")
    if plan.rotation:
        report.notes.append(rotation_note(plan.rotation))

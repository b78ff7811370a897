"""Inspect checkpoints: ours, stock ComfyUI native quantized files, legacy scaled-fp8 files,
files of the old comfy-modelopt node pack, and plain 16-bit models."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import MISSING, dataclass, field

from .families import detect_family, diffusion_prefix
from .fileformat import (LAYER_SUFFIXES, META_CALIBRATION, META_LOADER, META_RECIPE, META_REPORT, META_SOURCE,
                         META_VERSION, is_ours, json_meta, own_base, read_comfy_quant)
from .formats import values_per_element
from .report import QuantReport
from .safetensors_io import FLOAT_DTYPES, SafetensorsFile
from .verify import Verification, verify

OLD_PACK_SUFFIXES = ("weight_q", "block_scale", "tensor_scale", "svd_u", "svd_s", "svd_v", "use_svd")
OLD_PACK_META = ("_model_config", "unet_config", "model_type", "latent_format_cls", "precision")

KINDS = {
    "comfy_modelopt": "comfy-modelopt checkpoint (ComfyUI-native quantized; loads with stock "
                      "'Load Diffusion Model')",
    "comfy_modelopt_own": "comfy-modelopt checkpoint with layers only comfy-modelopt's loader runs "
                          "(low-rank branch): load it with 'Load Quantized Model'; stock ComfyUI "
                          "refuses it",
    "comfyui_native": "ComfyUI-native quantized checkpoint (.comfy_quant / _quantization_metadata; "
                      "loads with stock 'Load Diffusion Model')",
    "scaled_fp8": "legacy scaled-fp8 checkpoint (scaled_fp8 marker, .scale_weight); ComfyUI "
                  "converts it to float8_e4m3fn at load",
    "old_modelopt_pack": "file of the old comfy-modelopt node pack (private keys such as "
                         ".weight_q/.block_scale/.svd_u): stock ComfyUI cannot load it; "
                         "re-quantize the original model with comfy-modelopt",
    "unquantized": "unquantized model (no quantized layers)",
}


@dataclass
class InspectResult:
    """What ``inspect_file`` found; ``text()`` for people, ``to_dict()`` for programs."""
    path: str
    kind: str
    family: str
    prefix: str
    file_bytes: int
    layers_by_format: dict = field(default_factory=dict)   # format -> layer count
    bytes_by_format: dict = field(default_factory=dict)    # format or dtype -> bytes
    bytes_16bit: int = 0                                   # the same model at 2 bytes/value
    ours: dict = field(default_factory=dict)               # our metadata, parsed
    notes: list = field(default_factory=list)
    tensor_bytes: int = 0                                  # the tensors alone (file minus header)
    verification: Verification | None = None               # verify.py's findings (None: not run)

    @property
    def problems(self) -> list:
        return self.verification.problems if self.verification is not None else []

    @property
    def description(self) -> str:
        return KINDS[self.kind]

    @property
    def ratio(self) -> float:
        """Tensor bytes over the same tensors at 16 bits (the quantization report's ratio)."""
        return self.tensor_bytes / self.bytes_16bit if self.bytes_16bit else 0.0

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "description": self.description,
                "family": self.family, "prefix": self.prefix, "file_bytes": self.file_bytes,
                "tensor_bytes": self.tensor_bytes,
                "bytes_16bit": self.bytes_16bit, "ratio_vs_16bit": round(self.ratio, 4),
                "layers_by_format": self.layers_by_format, "bytes_by_format": self.bytes_by_format,
                "comfy_modelopt": self.ours, "notes": self.notes,
                "verification": self.verification.to_dict() if self.verification is not None else None}

    def text(self) -> str:
        lines = [f"file:    {self.path}", f"kind:    {self.description}",
                 f"family:  {self.family}" + (f"   (prefix {self.prefix!r})" if self.prefix else ""),
                 f"size:    {self.tensor_bytes / 2**20:.1f} MiB of tensors vs {self.bytes_16bit / 2**20:.1f} MiB "
                 f"at 16-bit ({self.ratio:.3f}x); file {self.file_bytes / 2**20:.1f} MiB with its header",
                 "layers by format (16-bit: Linear layers left unquantized):"]
        width = max(map(len, [*self.layers_by_format, *self.bytes_by_format, ""]))
        for fmt, n in sorted(self.layers_by_format.items(), key=lambda x: -x[1]):
            lines.append(f"  {fmt:{width}s} {n:6d} layers")
        lines.append("bytes by format:")
        for fmt, b in sorted(self.bytes_by_format.items(), key=lambda x: -x[1]):
            lines.append(f"  {fmt:{width}s} {b / 2**20:10.1f} MiB")
        if self.ours:
            lines.append(f"comfy-modelopt {self.ours.get('version', '?')}: recipe {recipe_text(self.ours.get('recipe'))}")
            if "source" in self.ours:
                lines.append(f"  source: {self.ours['source']}")
            if "summary" in self.ours:
                lines.append("  " + self.ours["summary"].replace("\n", "\n  "))
        lines += [f"note: {n}" for n in self.notes]
        if self.verification is not None:
            lines.append(self.verification.summary())
            shown = self.problems[:20]
            lines += [f"  problem: {p}" for p in shown]
            if len(self.problems) > len(shown):
                lines.append(f"  ... and {len(self.problems) - len(shown)} more")
            if self.problems:
                lines.append("  this file would not load correctly: re-quantize it, or get an undamaged copy")
        return "\n".join(lines)


def recipe_text(recipe) -> str:
    """A stored recipe as ``field=value`` for the fields not at their defaults (the format always)."""
    if not isinstance(recipe, dict):
        return str(recipe)
    from dataclasses import fields
    from .recipe import Recipe, recipe_default
    defaults = {f.name: recipe_default(f) for f in fields(Recipe)}
    shown = [f"format={recipe.get('format')}"]
    for name, value in recipe.items():
        default = defaults.get(name, MISSING)
        if name != "format" and (default is MISSING or value != (list(default) if isinstance(default, tuple) else default)):
            shown.append(f"{name}={','.join(map(str, value)) if isinstance(value, list) else value}")
    return ", ".join(shown)


def inspect_file(path: str, verify_values: bool = False, deep: bool = False) -> InspectResult:
    """Describe the checkpoint at ``path``: its kind (``KINDS``), model family, layers and bytes
    by format, size against 16 bits, for comfy-modelopt files the recipe, source and report
    stored in the header, and ``verification``: every quantized layer checked against its
    format's contract, quantization tensors without a layer, non-float weights without a
    config, missing layers (verify.py) - from the header alone, or with ``verify_values`` reading
    every scale and 16-bit tensor too (``deep``: the quantized weights' codes as well).
    ``.text()`` is what ``comfy-modelopt inspect`` prints, ``.to_dict()`` what ``--json``
    prints.  Raises ``CheckpointError`` (one line naming the file) for a file that is no valid
    safetensors."""
    with SafetensorsFile(path) as f:
        return _inspect(f, verify_values, deep)


def _inspect(f: SafetensorsFile, verify_values: bool, deep: bool) -> InspectResult:
    keys = f.tensors
    prefix = diffusion_prefix(keys)
    rel = {k[len(prefix):]: t.shape for k, t in keys.items() if k.startswith(prefix)}
    fam = detect_family(rel)
    family = fam.name
    notes = []
    entries = {k: (t.dtype, t.shape) for k, t in keys.items()}
    checked = verify(entries, f.metadata, f.read, lambda key: read_comfy_quant(f, key), prefix,
                     values=verify_values, deep=deep)
    layer_formats = {name: _label(conf) for name, conf in checked.configs.items()}
    old_pack = [k for k in keys if k.rsplit(".", 1)[-1] in OLD_PACK_SUFFIXES[:4]]
    if is_ours(f.metadata):
        kind = "comfy_modelopt"
    elif layer_formats:
        kind = "comfyui_native"
    elif "scaled_fp8" in keys or any(k.endswith(".scale_weight") for k in keys):
        kind = "scaled_fp8"
        layer_formats = {k[:-13]: "scaled_fp8" for k in keys if k.endswith(".scale_weight")}
    elif old_pack or any(m in f.metadata for m in OLD_PACK_META):
        kind = "old_modelopt_pack"
        precision = _old_precision(f.metadata)
        layer_formats = {k.rsplit(".", 1)[0]: f"old:{precision}" for k in keys if k.endswith(".weight_q")}
    else:
        kind = "unquantized"
    res = InspectResult(f.path, kind, family, prefix, f.size, notes=notes)
    _tally(f, layer_formats, res, lambda key: key.startswith(prefix) and fam.is_linear(key[len(prefix):-7]))
    if kind == "comfy_modelopt":
        res.ours = _our_metadata(f.metadata, f.name)
        if res.ours.get("loader"):
            res.kind = "comfy_modelopt_own"
    if kind == "old_modelopt_pack":
        res.notes.append("its nvfp4/int4 payloads were stored unpacked or saturated by that pack; "
                         "the weights cannot be trusted")
    if kind != "old_modelopt_pack":  # refused whatever it holds
        res.verification = checked
    return res


def _label(conf: dict) -> str:
    label = conf.get("format", "?")
    if conf.get("convrot"):
        label += "+convrot"
    if conf.get("full_precision_matrix_mult"):
        label += " (weight-only)"
    return label


def _old_precision(meta: dict) -> str:
    for key in ("precision", "quantization_format", "quant_format"):
        if key in meta:
            return meta[key].strip('"')
    for key in ("_model_config", "quantization"):
        if key in meta:
            try:
                doc = json.loads(meta[key])
            except (ValueError, RecursionError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("precision"), str):
                return doc["precision"]
    return "?"


def _tally(f: SafetensorsFile, layer_formats: dict, res: InspectResult, is_linear) -> None:
    """Layers and bytes by format.  A 16-bit layer is counted as the quantizer plans one: a 2-D
    float ``.weight`` of the diffusion model that the family calls Linear (``is_linear(key)``)."""
    counts, nbytes = defaultdict(int), defaultdict(int)
    for name, fmt in layer_formats.items():
        counts[fmt] += 1
    for key, t in f.tensors.items():
        layer, _, suffix = key.rpartition(".")
        if layer in layer_formats and suffix in LAYER_SUFFIXES + OLD_PACK_SUFFIXES + ("scale_weight", "scale_input"):
            fmt = layer_formats[layer]
            nbytes[fmt] += t.nbytes
            if suffix in ("weight", "weight_q"):
                res.bytes_16bit += _logical_numel(fmt, t.shape) * 2
            continue
        label = t.dtype.lower()
        if t.dtype in FLOAT_DTYPES and len(t.shape) == 2 and suffix == "weight" and is_linear(key):
            counts[label] += 1
        nbytes[label] += t.nbytes
        res.bytes_16bit += math.prod(t.shape) * 2 if t.dtype in FLOAT_DTYPES else t.nbytes
    res.layers_by_format = dict(counts)
    res.bytes_by_format = dict(nbytes)
    res.tensor_bytes = sum(nbytes.values())


def _logical_numel(label: str, shape: tuple) -> int:
    name = label.split(" ")[0].split("+")[0]  # see _label
    return math.prod(shape) * values_per_element(own_base(name) or name)


def _our_metadata(meta: dict, where: str) -> dict:
    out = {"version": meta.get(META_VERSION)}
    if META_LOADER in meta:
        out["loader"] = meta[META_LOADER]
    for name, key in (("recipe", META_RECIPE), ("source", META_SOURCE), ("calibration", META_CALIBRATION)):
        value = json_meta(meta, key, where)
        if value is not None:
            out[name] = value
    if META_REPORT in meta:
        recipe = out.get("recipe") if isinstance(out.get("recipe"), dict) else {}
        rep = QuantReport.from_header(meta[META_REPORT], recipe, where=f"{where}: {META_REPORT}")
        out["summary"] = rep.summary()
        out["family"] = rep.family
    return out

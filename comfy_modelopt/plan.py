"""Which layer gets which format, and why the others stay 16-bit.

Planning needs only names, dtypes and shapes (a safetensors header or a module's state dict),
so the whole output file can be laid out before any weight is read.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Mapping

from .families import Family, detect_family, diffusion_prefix
from .formats import Format, get_format
from .recipe import Recipe
from .safetensors_io import FLOAT_DTYPES, ST_DTYPES

SUFFIX_KEYS = {"": ".weight", "_scale": ".weight_scale", "_scale_2": ".weight_scale_2"}
QUANT_MARKERS = (".comfy_quant", ".scale_weight", ".weight_q")
# Formats only comfy-modelopt's loader runs.  Their names are not ComfyUI QUANT_ALGOS keys, so
# stock ComfyUI refuses such a file instead of silently dropping the extra tensors.
LOWRANK_PREFIX = "modelopt_lowrank_"
# fp8 Conv2d weights (ComfyUI 0.29 quantizes only Linear layers): [O, I*kh*kw] float8_e4m3fn with
# one float32 scale per output channel.  Stored 2-D on purpose: stock ComfyUI's load_state_dict
# then fails on the shape ("size mismatch for <layer>.weight") instead of copying raw fp8 values
# into a 16-bit convolution; our loader restores the 4-D shape from the layer config.
CONV_FORMAT = "modelopt_conv_fp8"
# convolutions ComfyUI's model detection reads (in/out channels, conv vs linear proj_in) or that
# carry the first/last step of the network: never quantized
CONV_KEEP = ("input_blocks.0.0", "out.2", "*.proj_in", "*.proj_out", "conv_in", "conv_out")


def own_base(fmt: str) -> str | None:
    """The stock base format of a low-rank format only our loader runs, else None (also for
    ``CONV_FORMAT``, which has no stock counterpart)."""
    return fmt[len(LOWRANK_PREFIX):] if fmt.startswith(LOWRANK_PREFIX) else None


def stock_conf(conf: dict) -> dict | None:
    """The stock ComfyUI layer config of an own-loader layer (what _lay_out wrote, undone), else
    None."""
    base = own_base(conf.get("format", ""))
    if base is None:
        return None
    return dict({k: v for k, v in conf.items() if k != "rank"}, format=base)


class PlanError(ValueError):
    pass


@dataclass
class LayerPlan:
    name: str                    # layer name as in the file (weight key minus ".weight")
    rel: str                     # name relative to the diffusion model
    n: int                       # out_features
    k: int                       # in_features
    src_dtype: str
    format: str | None = None    # None: kept 16-bit
    reason: str = ""             # why kept, or why weight-only
    weight_only: bool = False    # stored quantized, computed dequantized (no input_scale)
    static_input: bool = False   # writes input_scale
    conf: dict | None = None     # .comfy_quant JSON
    tensors: dict = field(default_factory=dict)  # output key -> (safetensors dtype, shape)

    @property
    def quantized(self) -> bool:
        return self.format is not None


@dataclass
class Plan:
    recipe: Recipe
    family: Family
    prefix: str
    layers: list[LayerPlan]
    passthrough: dict            # key -> (dtype, shape) copied unchanged
    convs: list = field(default_factory=list)  # ConvPlan: fp8 convolutions (own loader)

    @property
    def quantized(self) -> list[LayerPlan]:
        return [l for l in self.layers if l.quantized]

    @property
    def kept(self) -> list[LayerPlan]:
        return [l for l in self.layers if not l.quantized]

    def entries(self) -> dict:
        out = dict(self.passthrough)
        for layer in self.layers + self.convs:
            out.update(layer.tensors)
        return out

    def quantization_metadata(self) -> str:
        layers = {l.name: l.conf for l in self.quantized + self.convs}
        return json.dumps({"format_version": "1.0", "layers": layers})


@dataclass
class ConvPlan:
    name: str
    rel: str
    shape: tuple                 # [O, I, kh, kw] as in the source
    src_dtype: str
    conf: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1] * self.shape[2] * self.shape[3]


def conv_conf(shape) -> dict:
    return {"format": CONV_FORMAT, "shape": [int(d) for d in shape]}


def _conv_plan(key: str, rel: str, dtype: str, shape: tuple, recipe: Recipe, family: Family) -> ConvPlan | None:
    """An fp8 plan for a Conv2d weight, or None to keep it (too small a kernel, kept by rule)."""
    if recipe.conv == "none" or len(shape) != 4 or shape[2] * shape[3] < 2 or dtype not in FLOAT_DTYPES:
        return None
    name = rel[:-7]
    if any(fnmatch.fnmatchcase(name, p) for p in CONV_KEEP + recipe.keep) or family.keep_reason(name):
        return None
    conv = ConvPlan(key[:-7], name, tuple(shape), dtype, conv_conf(shape))
    o = shape[0]
    conv.tensors = {key: ("F8_E4M3", (o, conv.k)), conv.name + ".weight_scale": ("F32", (o,)),
                    conv.name + ".comfy_quant": ("U8", (len(comfy_quant_bytes(conv.conf)),))}
    return conv


def comfy_quant_bytes(conf: dict) -> bytes:
    """What ComfyUI writes for .comfy_quant (ops._quantized_weight_state_dict)."""
    return json.dumps(conf).encode("utf-8")


def make_plan(source: Mapping[str, tuple], recipe: Recipe, stats=None,
              family: Family | None = None) -> Plan:
    """Plan a file whose tensors are ``source``: key -> (safetensors dtype, shape).

    ``stats`` (ActivationStats) enables static input scales: layers it lacks are kept as the
    format allows (fp8 weight-only), never silently given a default scale.
    """
    marked = [k for k in source if k.endswith(QUANT_MARKERS) or k == "scaled_fp8"]
    if marked:
        raise PlanError(f"already quantized (e.g. {marked[0]}): quantize from the 16-bit model")
    prefix = diffusion_prefix(source)
    rel_shapes = {k[len(prefix):]: v[1] for k, v in source.items() if k.startswith(prefix)}
    if not rel_shapes:
        raise PlanError("no diffusion-model tensors found")
    family = family or detect_family(rel_shapes)
    fmt = get_format(recipe.format)
    opts = recipe.format_options()

    layers, passthrough, convs = [], {}, []
    for key, (dtype, shape) in source.items():
        rel = key[len(prefix):] if key.startswith(prefix) else None
        if rel is not None and rel.endswith(".weight") and len(shape) == 4:
            conv = _conv_plan(key, rel, dtype, tuple(shape), recipe, family)
            if conv is not None:
                convs.append(conv)
                continue
        if rel is None or not rel.endswith(".weight") or len(shape) != 2:
            passthrough[key] = (dtype, tuple(shape))
            continue
        layer = LayerPlan(key[:-7], rel[:-7], shape[0], shape[1], dtype)
        if not family.is_linear(layer.rel):
            passthrough[key] = (dtype, tuple(shape))
            continue
        _decide(layer, fmt, recipe, opts, family, stats)
        if layer.quantized:
            _lay_out(layer, fmt, recipe, opts)
        else:
            layer.tensors = {key: (dtype, tuple(shape))}
        layers.append(layer)
    if not layers:
        raise PlanError("no Linear weights found in the diffusion model")
    if recipe.conv != "none" and not convs:
        raise PlanError(f"conv={recipe.conv}: this {family.name} model has no convolution to quantize "
                        f"(kernels larger than 1x1, outside {', '.join(CONV_KEEP)})")
    return Plan(recipe, family, prefix, layers, passthrough, convs)


def _decide(layer: LayerPlan, fmt: Format, recipe: Recipe, opts: dict, family: Family, stats) -> None:
    for pat in recipe.keep:
        if fnmatch.fnmatchcase(layer.rel, pat) or fnmatch.fnmatchcase(layer.name, pat):
            layer.reason = f"--keep {pat}"
            return
    rule = family.keep_reason(layer.rel)
    if rule:
        layer.reason = rule
        return
    if layer.src_dtype not in FLOAT_DTYPES:
        layer.reason = f"source dtype {layer.src_dtype} is not 16/32-bit float"
        return
    problem = fmt.shape_problem(layer.n, layer.k, **_shape_opts(fmt, opts))
    if problem:
        layer.reason = problem
        return
    layer.format = fmt.name
    if stats is not None and not stats.has(layer.rel):
        if fmt.needs_input_scale:
            layer.weight_only = True
            layer.reason = "no activation statistics for this layer (never ran during calibration)"
        return
    if stats is None:
        if fmt.needs_input_scale:
            layer.weight_only = True
            layer.reason = "no activation statistics: weight-only (calibrate for W8A8)"
        return
    layer.static_input = fmt.needs_input_scale or (fmt.static_input_scale and recipe.static_nvfp4_input)


def _shape_opts(fmt: Format, opts: dict) -> dict:
    out = {"convrot_groupsize": opts.get("convrot_groupsize", 256)}
    if fmt.name == "int8_tensorwise":
        out["convrot"] = opts.get("convrot", False)
    return out


def _lay_out(layer: LayerPlan, fmt: Format, recipe: Recipe, opts: dict) -> None:
    layer.conf = fmt.conf(weight_only=layer.weight_only, **opts)
    for suffix, (dtype, shape) in fmt.planned(layer.n, layer.k, **opts).items():
        layer.tensors[layer.name + SUFFIX_KEYS[suffix]] = (ST_DTYPES[dtype], shape)
    if layer.static_input:
        layer.tensors[layer.name + ".input_scale"] = ("F32", ())
    if recipe.lowrank:
        rank = min(recipe.lowrank, layer.n, layer.k)
        layer.conf = dict(layer.conf, format=LOWRANK_PREFIX + fmt.name, rank=rank)
        layer.tensors[layer.name + ".lowrank_down"] = ("BF16", (rank, layer.k))
        layer.tensors[layer.name + ".lowrank_up"] = ("BF16", (layer.n, rank))
        if recipe.smoothing != "none":
            layer.tensors[layer.name + ".smooth_scale"] = ("F32", (layer.k,))
    layer.tensors[layer.name + ".comfy_quant"] = ("U8", (len(comfy_quant_bytes(layer.conf)),))

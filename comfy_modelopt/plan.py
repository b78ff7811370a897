"""Which layer gets which format, and why the others stay 16-bit.

Planning needs only names, dtypes and shapes (a safetensors header or a module's state dict),
so the whole output file can be laid out before any weight is read.
"""
from __future__ import annotations

import collections
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Mapping

from .families import GENERIC, Family, detect_family, diffusion_prefix, diffusion_structure, looks_like
from .errors import PlanError
from .fileformat import (COMFY_QUANT, INPUT_SCALE, LOWRANK_DOWN, LOWRANK_UP, QUANT_MARKERS, SMOOTH_SCALE, SUFFIX_KEYS,
                         encode_comfy_quant, encode_quantization_metadata, own_format)
from .formats import Format, get_format
from .formats.conv_fp8 import CONV_FP8
from .recipe import Recipe
from .report import kept_by_kind
from .safetensors_io import FLOAT_DTYPES, ST_DTYPES

# convolutions ComfyUI's model detection reads (in/out channels, conv vs linear proj_in) or that
# carry the first/last step of the network: never quantized
CONV_KEEP = ("input_blocks.0.0", "out.2", "*.proj_in", "*.proj_out", "conv_in", "conv_out")


class Frozen:
    """Attributes fixed once planning ends (``freeze``): the steps, the pipeline and the report
    read a plan, and a change after planning is an error that names the field, not a silent patch."""
    _frozen = False

    def __setattr__(self, name, value):
        if self._frozen:
            raise AttributeError(f"{type(self).__name__}.{name}: the plan is frozen once planned")
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)


@dataclass
class LayerPlan(Frozen):
    name: str                    # layer name as in the file (weight key minus ".weight")
    rel: str                     # name relative to the diffusion model
    n: int                       # out_features
    k: int                       # in_features
    src_dtype: str
    fmt: Format | None = None    # resolved once when planned; None: kept 16-bit
    reason: str = ""             # why kept, or why weight-only
    weight_only: bool = False    # stored quantized, computed dequantized (no input_scale)
    static_input: bool = False   # writes input_scale
    rank: int = 0                # rank of the 16-bit low-rank branch (0: none)
    eligible: bool = False       # no keep rule, float source: the planner may give it any format
    predicted: float = -1.0      # the planner's predicted output error (-1: no planner)
    opts: dict = field(default_factory=dict)  # the format's options for this layer (Format.layer_options)
    conf: dict | None = None     # .comfy_quant JSON
    tensors: dict = field(default_factory=dict)  # output key -> (safetensors dtype, shape)

    @property
    def format(self) -> str | None:
        return self.fmt.name if self.fmt is not None else None

    @property
    def quantized(self) -> bool:
        return self.fmt is not None


@dataclass
class Plan(Frozen):
    recipe: Recipe
    family: Family
    prefix: str
    layers: list[LayerPlan]
    passthrough: dict            # key -> (dtype, shape) copied unchanged
    convs: list = field(default_factory=list)  # ConvPlan: fp8 convolutions (own loader)
    odd: list = field(default_factory=list)    # (key, shape): named like a Linear weight, not 2-D
    fmt: Format | None = None    # the recipe's format, resolved
    opts: dict = field(default_factory=dict)   # its options (Recipe.format_options)
    recognised: str = ""         # no known family: why it was taken for a diffusion model (families.py)
    unmatched_patterns: list = field(default_factory=list)  # warnings: --keep / --weight-only patterns that matched nothing
    planner: dict | None = None  # the mixed-precision planner's summary (planner.plan_budget)
    engine: object = None        # modelopt_engine.EngineResult: ModelOpt's calibration choices
    rotation: dict | None = None  # ConvRot chosen per layer (rotation.choose_rotations)
    conv_ends: list = field(default_factory=list)  # convolutions kept as the network's input/output

    def freeze(self) -> None:
        for part in self.layers + self.convs:
            part.freeze()
        super().freeze()

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
        return encode_quantization_metadata(layers)


@dataclass
class ConvPlan(Frozen):
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


def network_ends(source: Mapping[str, tuple], prefix: str) -> set:
    """The convolutions that read the network's input or write its output, by structure rather
    than by name: those with the fewest input channels and those with the fewest output channels
    (the latent's or the image's channels against the blocks' hundreds).  Empty where every
    convolution has the same channels (no structure to read)."""
    convs = {k[len(prefix):-7]: shape for k, (dtype, shape) in source.items()
             if k.startswith(prefix) and k.endswith(".weight") and len(shape) == 4 and shape[2] * shape[3] > 1}
    ends = set()
    for axis in (0, 1):
        counts = {name: shape[axis] for name, shape in convs.items()}
        if counts and len(set(counts.values())) > 1:
            fewest = min(counts.values())
            ends |= {name for name, c in counts.items() if c == fewest}
    return ends


def _conv_plan(key: str, rel: str, dtype: str, shape: tuple, recipe: Recipe, family: Family,
               ends: set) -> ConvPlan | None:
    """An fp8 plan for a Conv2d weight, or None to keep it (too small a kernel, the network's input
    or output, kept by rule)."""
    if recipe.conv == "none" or len(shape) != 4 or shape[2] * shape[3] < 2 or dtype not in FLOAT_DTYPES:
        return None
    name = rel[:-7]
    if name in ends or any(fnmatch.fnmatchcase(name, p) for p in CONV_KEEP + recipe.keep) \
            or family.keep_reason(name):
        return None
    conv = ConvPlan(key[:-7], name, tuple(shape), dtype, CONV_FP8.conf(shape))
    conv.tensors = {conv.name + suffix: entry for suffix, entry in CONV_FP8.planned(shape).items()}
    conv.tensors[conv.name + COMFY_QUANT] = ("U8", (len(encode_comfy_quant(conv.conf)),))
    return conv


def make_plan(source: Mapping[str, tuple], recipe: Recipe, stats=None,
              family: Family | None = None, refuse_unknown: bool = False, engine=None, planner=None) -> Plan:
    """Plan a file whose tensors are ``source``: key -> (safetensors dtype, shape).

    ``stats`` (ActivationStats) enables static input scales: layers it lacks are kept as the
    format allows (fp8 weight-only), never silently given a default scale.  ``family`` overrides
    detection; with ``refuse_unknown`` a file of no known family is refused (it is usually a
    LoRA, a text encoder or a VAE) instead of planned with the generic rules.  ``engine``
    (``modelopt_engine.EngineResult``): ModelOpt's per-layer choices, which the layers' steps use.
    ``planner(plan) -> summary | None``: the last word before the plan is frozen - the
    mixed-precision planner (``planner.plan_budget``) reassigns the eligible layers' formats there.
    """
    marked = [k for k in source if k.endswith(QUANT_MARKERS) or k == "scaled_fp8"]
    if marked:
        raise PlanError(f"{marked[0]}: a quantization tensor - this model is already quantized (or a partly "
                        f"converted file): quantize from the 16-bit model")
    prefix, family, recognised = _family_of(source, family, refuse_unknown)
    fmt = get_format(recipe.format)
    opts = recipe.format_options()
    ends = network_ends(source, prefix) if recipe.conv != "none" else set()
    layers, passthrough, convs = _layers_of(source, prefix, family, fmt, recipe, opts, stats, ends)
    if not layers:
        raise PlanError("no Linear weights found in the diffusion model")
    if not any(l.quantized for l in layers) and not convs:
        raise PlanError(f"nothing was quantized: all {len(layers)} Linear layers would stay 16-bit "
                        f"({kept_by_kind([l.reason for l in layers])}); see the keep patterns "
                        f"and the format's shape rules")
    if recipe.conv != "none" and not convs:
        raise PlanError(f"conv={recipe.conv}: this {family.name} model has no convolution to quantize "
                        f"(kernels larger than 1x1, outside {', '.join(CONV_KEEP)})")
    plan = Plan(recipe, family, prefix, layers, passthrough, convs, _odd_weights(layers, passthrough, prefix),
                fmt, opts, recognised=recognised, engine=engine, conv_ends=sorted(ends),
                unmatched_patterns=_unmatched("--keep", recipe.keep, layers + convs)
                + _unmatched("--weight-only", recipe.weight_only, layers))
    if planner is not None:
        plan.planner = planner(plan)  # None: no planner
    plan.freeze()
    return plan


def _family_of(source: Mapping[str, tuple], family: Family | None, refuse_unknown: bool) -> tuple:
    """(the diffusion model's key prefix, its family, the generic structure recognised or "")."""
    prefix = family.prefix if family is not None and family.prefix is not None else diffusion_prefix(source)
    rel_shapes = {k[len(prefix):]: v[1] for k, v in source.items() if k.startswith(prefix)}
    if not rel_shapes:
        raise PlanError("no diffusion-model tensors found")
    recognised = ""
    if family is None:
        family = detect_family(rel_shapes)
        if refuse_unknown and family is GENERIC:
            what = looks_like(source)
            if what:
                raise PlanError(f"this looks like {what}, not a diffusion model: quantize the diffusion model "
                                f"(or pass --family generic to apply generic rules to an unknown architecture)")
            recognised = diffusion_structure(rel_shapes)
            if recognised is None:
                raise PlanError("no diffusion-model architecture comfy-modelopt knows, and no diffusion-model "
                                "structure (numbered attention + MLP blocks beside a timestep embedding): pass "
                                "--family generic to quantize it with generic rules (embedders, input/output "
                                "and final layers kept 16-bit), or --family NAME for a known one")
    return prefix, family, recognised


def _layers_of(source: Mapping[str, tuple], prefix: str, family: Family, fmt, recipe: Recipe, opts: dict,
               stats, ends: set) -> tuple:
    """(Linear layer plans, tensors copied as they are, convolution plans) of ``source``."""
    layers, passthrough, convs = [], {}, []
    written = _written_dtype(source, recipe)
    for key, (dtype, shape) in source.items():
        out = written.get(dtype, dtype)  # what a tensor left unquantized is written as
        rel = key[len(prefix):] if key.startswith(prefix) else None
        if rel is not None and rel.endswith(".weight") and len(shape) == 4:
            conv = _conv_plan(key, rel, dtype, tuple(shape), recipe, family, ends)
            if conv is not None:
                convs.append(conv)
                continue
        if rel is None or not rel.endswith(".weight") or len(shape) != 2:
            passthrough[key] = (out, tuple(shape))
            continue
        layer = LayerPlan(key[:-7], rel[:-7], shape[0], shape[1], dtype)
        if not family.is_linear(layer.rel):
            passthrough[key] = (out, tuple(shape))
            continue
        _decide(layer, fmt, recipe, opts, family, stats)
        if layer.quantized:
            lay_out(layer, fmt, recipe)
        else:
            layer.tensors = {key: (out, tuple(shape))}
        layers.append(layer)
    return layers, passthrough, convs


def _written_dtype(source: Mapping[str, tuple], recipe: Recipe) -> dict:
    """{"F32": 16-bit dtype} where an fp32 source's unquantized tensors are written in 16-bit
    (``recipe.fp32_tensors``): the source's most common 16-bit float dtype, else BF16."""
    if recipe.fp32_tensors == "keep":
        return {}
    counts = collections.Counter(d for d, _ in source.values() if d in ("F16", "BF16"))
    return {"F32": counts.most_common(1)[0][0] if counts else "BF16"}


def _matches(layer, pat: str) -> bool:
    return fnmatch.fnmatchcase(layer.rel, pat) or fnmatch.fnmatchcase(layer.name, pat)


def _unmatched(flag: str, patterns: tuple, planned: list) -> list[str]:
    """Layer patterns (``flag``'s) that match no layer (a typo, a ``.weight`` suffix), each with a hint."""
    out = []
    for pat in patterns:
        if any(_matches(l, pat) for l in planned):
            continue
        hint = " (layer names have no .weight suffix)" if pat.endswith(".weight") else ""
        example = planned[len(planned) // 2].rel if planned else ""
        out.append(f"warning: {flag} {pat} matched no layer{hint}; layer names look like {example}")
    return out


def _odd_weights(layers: list, passthrough: dict, prefix: str) -> list:
    """Tensors named like this model's Linear weights (same name with the block numbers
    ignored) that are not 2-D: copied unchanged, and reported."""
    pattern = lambda rel: re.sub(r"\.\d+\.", ".#.", rel)  # noqa: E731
    linear = {pattern(l.rel) for l in layers}
    return [(k, shape) for k, (_, shape) in passthrough.items()
            if k.startswith(prefix) and k.endswith(".weight") and len(shape) != 2
            and pattern(k[len(prefix):][:-7]) in linear]


def _decide(layer: LayerPlan, fmt: Format, recipe: Recipe, opts: dict, family: Family, stats) -> None:
    for pat in recipe.keep:
        if _matches(layer, pat):
            layer.reason = f"--keep {pat}"
            return
    rule = family.keep_reason(layer.rel)
    if rule:
        layer.reason = rule
        return
    if layer.n == 0 or layer.k == 0:
        layer.reason = f"empty weight [{layer.n}, {layer.k}]"
        return
    if layer.src_dtype not in FLOAT_DTYPES:
        layer.reason = f"source dtype {layer.src_dtype} is not 16/32-bit float"
        return
    layer.eligible = True
    assign(layer, fmt, recipe, opts, stats)


def assign(layer: LayerPlan, fmt: Format, recipe: Recipe, opts: dict, stats) -> None:
    """Give an eligible layer ``fmt`` (with the recipe's ``opts`` fitted to its shape), or keep
    it 16-bit where the shape does not allow it; weight-only / static input as the statistics allow."""
    layer.fmt, layer.weight_only, layer.static_input, layer.reason = None, False, False, ""
    layer_opts = fmt.layer_options(layer.n, layer.k, opts)
    problem = fmt.shape_problem(layer.n, layer.k, **layer_opts)
    if problem:
        layer.reason = problem
        return
    layer.fmt, layer.opts = fmt, layer_opts
    if fmt.needs_input_scale and not fmt.w8a8_gemm:
        layer.weight_only = True
        layer.reason = f"{fmt.name}: weight-only (no GPU runs an {fmt.name} x {fmt.name} GEMM)"
        return
    if stats is not None and not stats.has(layer.rel):
        if fmt.needs_input_scale:
            layer.weight_only = True
            layer.reason = "no activation statistics for this layer (never ran during calibration)"
        return
    if stats is None:
        if fmt.needs_input_scale:
            layer.weight_only = True
            layer.reason = "no activation statistics (calibrate for W8A8)"
        return
    static_input = fmt.needs_input_scale or (fmt.static_input_scale and recipe.static_nvfp4_input)
    chosen = next((p for p in recipe.weight_only if _matches(layer, p)), None) if static_input else None
    if chosen is not None:
        layer.weight_only, layer.reason = True, f"--weight-only {chosen}"
        return
    layer.static_input = static_input


def lay_out(layer: LayerPlan, fmt: Format, recipe: Recipe) -> None:
    """The output tensors (and .comfy_quant) of a quantized layer."""
    layer.tensors = {}
    layer.conf = fmt.conf(weight_only=layer.weight_only, **layer.opts)
    for suffix, (dtype, shape) in fmt.planned(layer.n, layer.k, **layer.opts).items():
        layer.tensors[layer.name + SUFFIX_KEYS[suffix]] = (ST_DTYPES[dtype], shape)
    if layer.static_input:
        layer.tensors[layer.name + INPUT_SCALE] = ("F32", ())
    if recipe.lowrank:
        layer.rank = rank = min(recipe.lowrank, layer.n, layer.k)
        layer.conf = dict(layer.conf, format=own_format(fmt.name), rank=rank)
        layer.tensors[layer.name + LOWRANK_DOWN] = ("BF16", (rank, layer.k))
        layer.tensors[layer.name + LOWRANK_UP] = ("BF16", (layer.n, rank))
        if recipe.smoothing != "none":
            layer.tensors[layer.name + SMOOTH_SCALE] = ("F32", (layer.k,))
    layer.tensors[layer.name + COMFY_QUANT] = ("U8", (len(encode_comfy_quant(layer.conf)),))

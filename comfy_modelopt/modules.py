"""Quantize any torch module, and run it the way ComfyUI runs the file.
Design: docs/design.md, ``modules.py``.
"""
from __future__ import annotations

import copy
import math

import torch
from comfy_kitchen.tensor import QuantizedTensor

from .calibrate import is_linear
from .errors import QuantizeError
from .families import Family, literal_glob
from . import model_checks
from .fileformat import (COMFY_QUANT, CONV_FORMAT, META_REPORT, QUANT_METADATA, SUFFIX_KEYS, comfy_quant_tensor,
                         decode_comfy_quant, decode_quantization_metadata, encode_quantization_metadata, own_base)
from .formats import FORMATS, Format
from .formats.conv_fp8 import CONV_FP8
from .lowrank import branch_dtype, branched
from .pipeline import quantize
from .recipe import Recipe
from .safetensors_io import write_file

_METADATA = "_modelopt_metadata"
_REPORT = "_modelopt_report"
_WRITTEN = "_modelopt_written_dtypes"


def _weight_key(suffix: str) -> str:
    return SUFFIX_KEYS[suffix][1:]  # "weight", "weight_scale", ...


class QuantLinear(torch.nn.Module):
    """One quantized Linear layer as a file stores it, computing what ComfyUI computes for it.

    Build it with ``from_stored`` from the layer's tensors (key suffix -> tensor, as in the
    file); its ``state_dict`` gives those tensors back, so a model of these layers exports
    exactly the file it came from."""

    def __init__(self, fmt: Format, conf: dict, weight: QuantizedTensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                 extras: dict[str, torch.Tensor] | None = None, native: bool | None = None):
        super().__init__()
        self.fmt, self.conf = fmt, dict(conf)
        self.in_features, self.out_features = in_features, out_features
        self.weight = weight                      # kitchen QuantizedTensor, orig_dtype = compute dtype
        # ComfyUI: full_precision_matrix_mult (our weight-only layers) skips the quantized path
        self.full_precision = bool(conf.get("full_precision_matrix_mult", False))
        self._native_on: dict = {}                # device -> ComfyUI computes the format natively there
        # None: as ComfyUI on the device at hand (formats it emulates there: weight dequantized,
        # activation unquantized); True: as on a GPU that computes the format natively (activation
        # quantized), emulated where this device has no kernel; False: always dequantized
        self.native = native
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.register_buffer("input_scale", input_scale)
        extras = extras or {}
        for name in ("lowrank_up", "lowrank_down", "smooth_scale"):
            self.register_buffer(name, extras.get(name))

    # ------------------------------------------------------------------ building
    @classmethod
    def from_stored(cls, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                    dtype: torch.dtype, name: str = "layer", native: bool | None = None) -> "QuantLinear":
        """The layer from its stored tensors, keyed by what follows the layer name in the file
        (``weight``, ``weight_scale``, ``comfy_quant``, ``input_scale``, ``bias``, ...).
        ``dtype``: the compute dtype (ComfyUI's model dtype)."""
        if "comfy_quant" not in tensors:
            raise QuantizeError(f"{name}: no comfy_quant entry, not a quantized layer")
        conf = decode_comfy_quant(tensors["comfy_quant"], name)
        base = own_base(conf.get("format", "")) or conf.get("format")
        fmt = FORMATS.get(base)
        if fmt is None:
            raise QuantizeError(f"{name}: format {conf.get('format')!r} is not one of {', '.join(FORMATS)}")
        stored = {s: tensors[_weight_key(s)] for s in SUFFIX_KEYS if _weight_key(s) in tensors}
        weight = fmt.from_stored(stored, conf, (out_features, in_features), dtype)
        extras = {k: tensors[k] for k in ("lowrank_up", "lowrank_down", "smooth_scale") if k in tensors}
        for k in ("lowrank_up", "lowrank_down"):  # held as the own loader holds it
            if k in extras:
                extras[k] = extras[k].to(branch_dtype(dtype))
        return cls(fmt, conf, weight, in_features, out_features, tensors.get("bias"),
                   tensors.get("input_scale"), extras, native)

    # ------------------------------------------------------------------ running
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lowrank_down is None:  # (a smooth_scale comes only with a branch: the verifier's rule)
            return self._base(x)
        return branched(x, self._base, self.lowrank_down, self.lowrank_up, self.smooth_scale)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        """ComfyUI's inference path, step by step (comfy/ops.py MixedPrecisionOps.Linear.forward,
        forward_comfy_cast_weights, cast_bias_weight)."""
        weight = self.weight if self.weight.device == x.device else self.weight.to(x.device)
        bias = None if self.bias is None else self.bias.to(x.device, x.dtype)
        native = self._native(x.device)
        quantized = not self.full_precision and (native or self.native is True)
        if quantized and self.fmt.quantize_input:
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]) if x.ndim >= 3 else x
            if x2.ndim == 2:  # ComfyUI leaves a 1-D input unquantized
                scale = None if self.input_scale is None else self.input_scale.to(x.device)
                qx = self.fmt.quantize_activation(x2, scale)
                if native:
                    y = torch.nn.functional.linear(qx, self._cast(weight, x.dtype), bias)
                else:  # emulated: kitchen's quantized operands, dequantized, one float32 GEMM
                    y = torch.nn.functional.linear(qx.dequantize().float(), weight.dequantize().float(),
                                                   None if bias is None else bias.float()).to(x.dtype)
                return y.reshape(*shape[:-1], self.out_features) if x.ndim >= 3 else y
        if quantized and not self.fmt.quantize_input:
            # weight-only path in ComfyUI's terms: the weight stays quantized and kitchen's kernel
            # quantizes the activation rows itself (int8 W8A8, ConvRot W4A4)
            return torch.nn.functional.linear(x, weight.to(x.dtype), bias)
        return torch.nn.functional.linear(x, self._cast(weight, x.dtype), bias)

    def _native(self, device: torch.device) -> bool:
        if self.native is False:
            return False
        native = self._native_on.get(device)
        if native is None:
            native = self._native_on[device] = self.fmt.native_on(device)
        return native

    @staticmethod
    def _cast(weight: QuantizedTensor, dtype: torch.dtype):
        # cast_bias_weight: a weight of another dtype is cast and dequantized; of the same dtype it
        # stays quantized and kitchen's linear decides (a 16-bit input dequantizes it)
        return weight if weight.dtype == dtype else weight.to(dtype).dequantize()

    # ------------------------------------------------------------------ state
    def _apply(self, fn, recurse=True):
        self.weight = fn(self.weight)
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for suffix, t in self.weight.state_dict("").items():
            destination[prefix + _weight_key(suffix)] = t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t
        for name in ("input_scale", "lowrank_up", "lowrank_down", "smooth_scale"):
            t = getattr(self, name)
            if t is not None:
                destination[prefix + name] = t
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()
        destination[prefix + "comfy_quant"] = comfy_quant_tensor(self.conf)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        raise QuantizeError(f"{prefix.rstrip('.') or 'QuantLinear'}: load a quantized layer with "
                            f"QuantLinear.from_stored, not load_state_dict")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.conf.get('format')}, bias={self.bias is not None}, "
                f"static_input={self.input_scale is not None}")


class QuantConv2d(torch.nn.Conv2d):
    """An fp8 convolution of comfy-modelopt's own loader (``modelopt_conv_fp8``): the weight
    dequantized per output channel in float32 on every call (comfyui/ownloader.py)."""

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, q: torch.Tensor, scale: torch.Tensor, conf: dict) -> "QuantConv2d":
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
                  dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None,
                  padding_mode=conv.padding_mode, device="meta")
        new.weight = torch.nn.Parameter(q.view(conf["shape"]), requires_grad=False)
        if conv.bias is not None:
            new.bias = conv.bias
        new.register_buffer("weight_scale", scale.float())
        new.conf = dict(conf)
        return new.train(conv.training)

    def forward(self, x):
        w = CONV_FP8.decode(self.weight, self.weight_scale).to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return self._conv_forward(x, w.to(x.device), b)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight.detach().reshape(self.weight.shape[0], -1)
        destination[prefix + "weight_scale"] = self.weight_scale
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias.detach()
        destination[prefix + "comfy_quant"] = comfy_quant_tensor(self.conf)


# ====================================================================== entry points
def module_family(module: torch.nn.Module, keep: tuple[str, ...] = ()) -> Family:
    """Planning rules for a plain torch module: every Linear layer is quantizable (the recipe's
    ``keep`` patterns still apply); 2-D weights of other modules (embeddings, ...) are not."""
    not_linear = tuple(literal_glob(name) for name, m in module.named_modules()
                       if name and not is_linear(m) and getattr(m, "weight", None) is not None
                       and getattr(m.weight, "dim", lambda: 0)() == 2)
    return Family("module", type(module).__name__, lambda s: True, tuple(keep), not_linear,
                  notes="every Linear layer of the module", prefix="")


def quantize_module(module: torch.nn.Module, recipe: Recipe, stats=None, *, family: str | Family | None = None,
                    inplace: bool = False, native: bool | None = None, progress=None,
                    engine=None, evaluate=None) -> torch.nn.Module:
    """``module`` with every planned Linear layer replaced by a ``QuantLinear`` (and with
    ``recipe.conv="fp8"`` every planned convolution by a ``QuantConv2d``), computing exactly what
    ComfyUI computes for the file ``quantize_file`` would write from this module's weights.

    ``stats``: ``ActivationStats`` from ``calibrate(module, ...)`` (or a statistics file) for
    static input scales, smoothing and GPTQ.  ``family``: the planning rules; by default every
    Linear layer is quantized (``module_family``); pass "auto" or a family name to plan a
    diffusion model the way its file would be.  ``inplace=False`` (the default) leaves
    ``module`` untouched and returns a quantized copy.  ``native``: None computes what ComfyUI
    computes on the device the layer runs on (a format ComfyUI only emulates there - fp8 before
    Ada, nvfp4/mxfp8 before Blackwell, any of them on a CPU - runs on its dequantized weight);
    True computes what a GPU that runs the format natively computes (the activation quantized
    too), on kitchen's reference where this device has no kernel: measure quality with it on a
    CPU.  ``engine``: ModelOpt's calibration of this module (``modelopt_engine.modelopt_calibrate``)
    used instead of the own searches.  ``evaluate`` (with ``recipe.budget`` or ``recipe.max_error``):
    ``evaluate(model) -> float``, the whole model's error on inputs of your choosing (lower is
    better; not the inputs you will judge the result on): the planner then prices each layer's
    formats by that instead of the layer's own output error (``price_end_to_end``).
    Integer and boolean tensors (buffers) are kept as they are.  The report is
    ``module_report(result)``.
    Run the result under ``torch.no_grad()`` or ``torch.inference_mode()`` (inference only)."""
    if family is None:
        family = module_family(module)
    prices = None
    if evaluate is not None:
        prices = price_end_to_end(module, recipe, stats, evaluate, family=family, native=native, progress=progress)
    checks = list(getattr(stats, "check_calls", None) or [])
    wanted = len(checks) >= 2 and model_checks.wanted(stats, recipe)
    refs = [model_checks.outputs(c.replay(module, model_checks.device_of(module))) for c in checks] if wanted else []
    target = module if inplace else copy.deepcopy(module)
    # the source's convolution weights, for the checks to round again (the layers are replaced below)
    originals = {n: m.weight for n, m in target.named_modules() if isinstance(m, torch.nn.Conv2d)} if refs else {}
    # integer and boolean tensors (a BatchNorm's count, a converted graph's index tables) are the
    # module's own: they stay as they are, outside what the pipeline plans and checks
    sd = {k: v.detach() for k, v in target.state_dict().items() if v.is_floating_point()}
    out, metadata, report = quantize(sd, recipe, stats, family=family, progress=progress, engine=engine,
                                     prices=prices)
    dtype_of = {k: v.dtype for k, v in sd.items()}
    device_of = {k: v.device for k, v in sd.items()}
    del sd
    consumed = _replace_layers(target, out, dtype_of, device_of, native)
    rest = {k: v for k, v in out.items() if k not in consumed}
    missing_params = {k for k in rest if k not in dtype_of}
    if missing_params:  # the pipeline only writes what the module has
        raise QuantizeError(f"unexpected output tensors {sorted(missing_params)[:3]}")
    with torch.no_grad():
        current = target.state_dict(keep_vars=True)
        for k, v in rest.items():
            current[k].copy_(v.to(current[k].device, current[k].dtype))
    # the module keeps its dtypes; the file holds some tensors in another (an fp32 module's
    # unquantized tensors in 16-bit, recipe.fp32_tensors): the export writes them as the file does
    setattr(target, _WRITTEN, {k: v.dtype for k, v in rest.items() if v.dtype != dtype_of[k]})
    if refs:  # choices checked on the model's own output (model_checks.py)
        reports, confs = {l.name: l for l in report.layers}, decode_quantization_metadata(metadata[QUANT_METADATA], "plan")
        mods = dict(target.named_modules())
        alternatives = [model_checks.per_sample({n: m for n, m in mods.items() if isinstance(m, QuantLinear)}, stats,
                                                reports, confs),
                        model_checks.conv_per_tensor({n: m for n, m in mods.items() if isinstance(m, QuantConv2d)},
                                                     originals, reports)]
        model_checks.choose(target, checks, refs, [a for a in alternatives if a], report.notes)
        metadata = {**metadata, QUANT_METADATA: encode_quantization_metadata(confs), META_REPORT: report.header_json()}
    setattr(target, _METADATA, dict(metadata))
    setattr(target, _REPORT, report)
    return target


def _replace_layers(target: torch.nn.Module, out: dict, dtype_of: dict, device_of: dict, native) -> set[str]:
    """Every layer of ``target`` that ``out`` (the quantized state dict) holds quantized replaced by
    the module computing what ComfyUI computes for it; returns the keys of ``out`` they took."""
    consumed: set[str] = set()
    for name, sub in list(target.named_modules()):
        if not name or name + COMFY_QUANT not in out:
            continue
        prefix = name + "."
        tensors = {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        consumed.update(prefix + k for k in tensors)
        device = device_of.get(prefix + "weight", torch.device("cpu"))
        tensors = {k: v.to(device) for k, v in tensors.items()}
        conf = decode_comfy_quant(tensors["comfy_quant"], name)
        if conf.get("format") == CONV_FORMAT:
            new = QuantConv2d.from_conv(sub, tensors["weight"], tensors["weight_scale"], conf)
        else:
            new = QuantLinear.from_stored(tensors, sub.in_features, sub.out_features,
                                          dtype_of.get(prefix + "weight", torch.float32), name, native)
        _set_submodule(target, name, new)
    return consumed


def price_end_to_end(module: torch.nn.Module, recipe: Recipe, stats, evaluate, *, family: str | Family | None = None,
                     native: bool | None = None, progress=None) -> dict[str, dict[str, float]]:
    """The planner's options priced by the whole model: {layer name: {format: error}}.

    Each candidate format (``recipe.candidates``, default ``planner.DEFAULT_CANDIDATES``) is
    applied to the whole module with the recipe's other choices (its scales, GPTQ, held-out
    checks), so each layer's option is the layer that format's file would hold.  From a base
    that gives every layer its smallest option, one layer at a time takes each of its other
    options, 16-bit included, and ``evaluate`` measures the model; a format's price is the
    model's error with it minus the model's error with that layer kept 16-bit (at least 0) -
    each layer's own share of the error with everything else quantized, where the per-layer
    planner knows only the layer's output.  Costs one quantization per candidate, held in
    memory together (one quantized copy of the model per candidate), and one evaluation per
    (layer, option); measured on real trained weights in
    benchmarks/quality_real.py (the planner rows "priced end to end").  ``module`` is not changed."""
    from dataclasses import replace

    from .planner import resolve_candidates
    if not recipe.planned:
        raise QuantizeError("evaluate prices the planner's choices: give the recipe a budget or max_error")
    if family is None:
        family = module_family(module)
    versions, size = {}, {}
    for name in resolve_candidates(recipe):
        one = replace(recipe, format=name, budget=0.0, max_error=0.0, candidates=(),
                      sensitivity=False)
        q = quantize_module(module, one, stats, family=family, native=native)
        versions[name] = quantized_layers(q)
        size[name] = {l.name: l.bytes for l in module_report(q).layers}
    names = sorted({n for layers in versions.values() for n in layers})
    options = {n: sorted((f for f in versions if n in versions[f]), key=lambda f: size[f][n]) for n in names}
    frame = _frame(module, names)
    base = {n: versions[options[n][0]][n] for n in names}
    for n in names:
        _set_submodule(frame, n, base[n])
    originals = dict(module.named_modules())
    total = sum(len(o) for o in options.values())
    with torch.no_grad():
        e_base, prices, done = _finite(evaluate(frame), "with every layer at its smallest format"), {}, 0
        for n in names:
            errs = {options[n][0]: e_base}
            for alt in [None] + options[n][1:]:
                if progress:
                    progress(done, total, f"pricing {n} ({alt or '16-bit'})")
                done += 1
                _set_submodule(frame, n, originals[n] if alt is None else versions[alt][n])
                errs[alt] = _finite(evaluate(frame), f"with {n} {alt or 'kept 16-bit'}")
            _set_submodule(frame, n, base[n])
            prices[n] = {f: max(errs[f] - errs[None], 0.0) for f in options[n]}
    return prices


def _finite(value, what: str) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise QuantizeError(f"evaluate returned {value} {what}: it must give a finite error to price the planner's "
                            f"options")
    return value


def _frame(module: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    """A shallow copy of ``module`` whose modules on the way to ``names`` are shallow copies too
    (each with its own child dict), so setting those submodules leaves ``module`` alone; every
    tensor is shared."""
    def shallow(m):
        c = copy.copy(m)
        c._modules = dict(m._modules)
        return c
    frame, copied = shallow(module), {""}
    for n in names:
        parts = n.split(".")
        for i in range(1, len(parts)):
            path = ".".join(parts[:i])
            if path not in copied:
                parent = frame.get_submodule(".".join(parts[:i - 1]))
                setattr(parent, parts[i - 1], shallow(getattr(parent, parts[i - 1])))
                copied.add(path)
    return frame


def _set_submodule(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def module_report(module: torch.nn.Module):
    """The ``QuantReport`` of a module made by ``quantize_module`` (None for any other)."""
    return getattr(module, _REPORT, None)


def export_state_dict(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, safetensors metadata) of a module made by ``quantize_module``: the tensors
    and header ``quantize_file`` writes for the same weights and recipe (CPU, contiguous)."""
    metadata = getattr(module, _METADATA, None)
    if metadata is None:
        raise QuantizeError("export_state_dict needs a module made by quantize_module")
    written = getattr(module, _WRITTEN, {})
    sd = {k: v.detach().to("cpu", written.get(k, v.dtype)).contiguous() for k, v in module.state_dict().items()}
    return sd, dict(metadata)


def export_file(module: torch.nn.Module, path: str, overwrite: bool = False) -> str:
    """Write ``export_state_dict(module)`` to ``path`` atomically (temp file + rename)."""
    sd, metadata = export_state_dict(module)
    return write_file(str(path), sd, metadata, overwrite=overwrite)


def quantized_layers(module: torch.nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in module.named_modules() if isinstance(m, QuantLinear)}


__all__ = ["QuantConv2d", "QuantLinear", "export_file", "export_state_dict", "module_family", "module_report",
           "price_end_to_end", "quantize_module", "quantized_layers"]

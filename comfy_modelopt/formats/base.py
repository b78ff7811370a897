"""The Format contract: one ComfyUI ``QUANT_ALGOS`` key, what it stores and how it rounds.
Design: docs/design.md, ``formats/base.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import comfy_kitchen as ck
import comfy_kitchen.tensor as ck_tensor
import torch
from comfy_kitchen.tensor import QuantizedTensor
from ..safetensors_io import is_int
from . import CONVROT_GROUP_DEFAULT

# kitchen's own layout classes, held directly: ComfyUI re-registers some layout names with its
# subclasses (e.g. "TensorCoreFP8Layout" becomes its E4M3 class without a dtype argument), so
# resolving by name inside a ComfyUI process would not run kitchen's encoder.
_KITCHEN_LAYOUTS = {name: getattr(ck_tensor, name) for name in (
    "TensorCoreFP8Layout", "TensorWiseINT8Layout", "TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout",
    "TensorCoreConvRotW4A4Layout")}

F8_E4M3_MAX = 448.0
F4_E2M1_MAX = 6.0


@dataclass(frozen=True)
class ModelOptQuantizers:
    """How NVIDIA ModelOpt fake-quantizes a format while it calibrates (``modelopt_engine``): its
    weight and input quantizer configs, and the ModelOpt algorithms whose choices export to it."""
    weight: dict
    input: dict
    algorithms: tuple = ("max",)


@dataclass(frozen=True)
class Format:
    """A ComfyUI-native quantized Linear format."""

    name: str                 # ComfyUI QUANT_ALGOS key, written into .comfy_quant
    layout: str               # comfy-kitchen layout class name
    native_sm: tuple          # NVIDIA compute capability from which ComfyUI computes it natively
    static_input_scale: bool  # ComfyUI honours a stored input_scale (fp8, nvfp4)
    needs_input_scale: bool   # without one ComfyUI would clip activations (fp8): store weight-only
    free_scale: str           # "tensor", "row" or "" : what a clip factor applies to
    k_multiple: int           # in_features must be a multiple of this (kernel rule)
    n_multiple: int = 1       # out_features rule
    options: tuple = ()       # Recipe fields this format reads (Recipe.format_options)
    lowrank: bool = False     # can carry a 16-bit low-rank branch (comfy-modelopt's loader)
    one_weight_scale: bool = False  # one scale for the whole weight (fp8): rescaling some rows
    #                                 of it (a smoothing fold into a producer) costs precision
    values_per_element: int = 1     # weight values packed into one stored element (4-bit: 2)
    # how a static input scale's clip is searched: f(fmt, candidates, amax, hist, sample) -> their
    # errors, or None (then the max); scales.histogram_errors or scales.sample_errors
    input_search: object = field(default=None, compare=False)
    native_gate: str = ""     # comfy.model_management predicate for native compute ("": always)
    lean_kernel: str = ""     # the lean runtime's direct kernel ("": dequantize, or stock)
    lean_emulated: str = ""   # ... where the GPU cannot compute it natively ("": dequantize)
    w8a8_gemm: bool = True          # a quantized-activation GEMM exists for it (fp8 e5m2: no
    #                                 e5m2 x e5m2 kernel - torch refuses it on Ada/Hopper)
    quantize_input: bool = True     # ComfyUI quantizes the activation before the GEMM (its
    #                                 QUANT_ALGOS "quantize_input"); False: kitchen's kernel does
    block_clip: bool = False        # the encoder derives 16-block scales from each block's max:
    #                                 clamping a block clips it (scales.search_block_clip)
    block: int = 0                  # values per stored block scale (ComfyUI's "group_size"); 0: none
    modelopt: ModelOptQuantizers | None = field(default=None, compare=False)  # None: no ModelOpt engine
    candidate: int = 0              # its place among the planner's default candidates (0: not one)
    eight_bit: str = ""             # a 4-bit format's 8-bit partner: its costliest layers go there
    #                                 within Recipe.fp8_allowance (planner.allowance_recipe)
    colour: tuple = (150, 110, 60)  # RGB of its layers in the Quantize node's report image

    # ---------------------------------------------------------------- rules
    def shape_problem(self, n: int, k: int, **opts) -> str | None:
        """Why a [n, k] weight cannot use this format with ``opts`` (its recipe options), or None."""
        if k % self.k_multiple:
            return f"{self.name} needs in_features % {self.k_multiple} == 0, got {k}"
        if n % self.n_multiple:
            return f"{self.name} needs out_features % {self.n_multiple} == 0, got {n}"
        return None

    def conf(self, weight_only: bool = False, convrot: bool = False, convrot_groupsize: int = CONVROT_GROUP_DEFAULT,
             linear_dtype: str = "int4") -> dict:
        """The ``.comfy_quant`` JSON object for one layer."""
        conf = {"format": self.name}
        if weight_only:
            conf["full_precision_matrix_mult"] = True
        return conf

    def layout_kwargs(self, convrot: bool = False, convrot_groupsize: int = CONVROT_GROUP_DEFAULT,
                      linear_dtype: str = "int4") -> dict:
        return {}

    def layer_options(self, n: int, k: int, opts: dict) -> dict:
        """The options one [n, k] layer is encoded with: the recipe's, or a variant of them that
        its shape allows (int8 ConvRot: a smaller rotation group).  ComfyUI reads them per layer
        from ``.comfy_quant``."""
        return opts

    # ---------------------------------------------------------------- encode
    def _prepare(self, w: torch.Tensor, alpha: torch.Tensor | None, opts: dict) -> tuple[torch.Tensor, dict]:
        """Return (tensor handed to kitchen, extra quantize kwargs) for clip factor alpha."""
        return w, {}

    def _explicit(self, scale: torch.Tensor) -> dict:
        """quantize kwargs for an explicit scale (formats whose scale kitchen takes as given)."""
        raise ValueError(f"{self.name}: kitchen derives this format's scales itself")

    def quantize(self, w: torch.Tensor, alpha: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, **opts) -> QuantizedTensor:
        """kitchen QuantizedTensor of a float32 [N, K] weight with clip factor alpha, or with an
        explicit ``scale`` (fp8: the tensor scale; int8: per-row [N]) for pre-rounded weights."""
        if scale is not None:
            prepared, extra = w, self._explicit(scale)
        else:
            prepared, extra = self._prepare(w, alpha, opts)
        return self._kitchen(prepared, **{**self.layout_kwargs(**opts), **extra})

    def _kitchen(self, tensor: torch.Tensor, **kw) -> QuantizedTensor:
        # kitchen keeps its input's strides: a transposed weight would give a column-major qdata,
        # which ComfyUI's fp8 scaled_mm refuses
        qdata, params = self._kitchen_raw(tensor.contiguous(), **kw)
        return QuantizedTensor(qdata, self.layout, params)

    def _kitchen_raw(self, tensor: torch.Tensor, **kw):
        """kitchen's (qdata, params) of ``tensor`` in this format's layout."""
        with kitchen_reference():
            qdata, params = _KITCHEN_LAYOUTS[self.layout].quantize(tensor, **kw)
        return qdata, params

    def encode(self, w: torch.Tensor, alpha: torch.Tensor | None = None,
               scale: torch.Tensor | None = None, **opts) -> tuple[dict[str, torch.Tensor], QuantizedTensor]:
        """On-disk tensors by key suffix ('' is the weight itself) and the QuantizedTensor."""
        qt = self.quantize(w, alpha, scale, **opts)
        tensors = qt.state_dict("")
        return {k: _storage(v) for k, v in tensors.items()}, qt

    def planned(self, n: int, k: int, **opts) -> dict[str, tuple[torch.dtype, tuple]]:
        """Dtype and shape of every encoded tensor, from kitchen run on a meta tensor."""
        meta = torch.empty(n, k, dtype=torch.float32, device="meta")
        qt = self._kitchen(meta, **self.layout_kwargs(**opts), **self._meta_extra(meta))
        return {s: (_storage_dtype(t.dtype), tuple(t.shape)) for s, t in qt.state_dict("").items()}

    def _meta_extra(self, meta: torch.Tensor) -> dict:
        return {}

    # ---------------------------------------------------------------- capabilities
    def input_fmax(self) -> float | None:
        """What ComfyUI divides the activation clip value by to get ``input_scale``; None when
        the format cannot store a static input scale."""
        return None

    def gptq_rounding(self, w: torch.Tensor, alpha: torch.Tensor | None, **opts):
        """GPTQ support for ``w`` in the search space: ``(quantize_columns, scale)`` - a column
        rounder with the scales fixed by clip factor ``alpha``, and the explicit scale (or None:
        the encoder's own) that re-encodes the rounded weight exactly once rotated back - or
        None where error compensation cannot hold (gptq.py)."""
        return None

    # ---------------------------------------------------------------- search
    def search_space(self, w: torch.Tensor, **opts) -> torch.Tensor:
        """The basis in which the format rounds (rotated for ConvRot); norms are preserved."""
        return w

    def fake_rows(self, x: torch.Tensor, alpha: torch.Tensor | None = None,
                  amax: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize -> dequantize in the search space, float32, for clip factor alpha.

        ``amax`` overrides the tensor absmax of per-tensor formats, so a subset of rows can be
        searched with the whole tensor's scale."""
        raise NotImplementedError(self.name)

    def fake_quant(self, w: torch.Tensor, alpha: torch.Tensor | None = None, **opts) -> torch.Tensor:
        """kitchen's quantize -> dequantize round trip, restated in torch for fast scale search."""
        return self.fake_rows(w, alpha)

    def fake_act(self, x: torch.Tensor, input_scale: float | None = None, **opts) -> torch.Tensor:
        """What ComfyUI does to a [M, K] activation before the GEMM (quantize -> dequantize), in
        the weight's search space (rotated for ConvRot)."""
        return x

    def native_on(self, device: torch.device, gates=None) -> bool:
        """Whether ComfyUI computes this format natively on ``device``; where not, it lists the
        format as emulated and dequantizes the weight (comfy/ops.py pick_operations: the
        ``supports_*_compute`` predicates named by ``native_gate``).  ``gates``: where those
        predicates can be asked (``comfy.model_management``, passed by the ComfyUI adapter);
        without it - the ComfyUI-free core - they are read as ``native_sm``."""
        if not self.native_gate:
            return True
        if gates is not None:
            return bool(getattr(gates, self.native_gate, lambda _d: False)(device))
        device = torch.device(device)
        if device.type != "cuda" or torch.version.cuda is None:
            return False
        return torch.cuda.get_device_capability(device) >= self.native_sm

    def quantize_activation(self, x: torch.Tensor, input_scale: torch.Tensor | None) -> QuantizedTensor:
        """What ComfyUI's Linear makes of a 2-D activation before the GEMM,
        ``QuantizedTensor.from_float(x, layout, scale=input_scale)``, on kitchen's backend for
        ``x``'s device (its kernels where it has them)."""
        qdata, params = _KITCHEN_LAYOUTS[self.layout].quantize(x, **self._activation_kwargs(x, input_scale))
        return QuantizedTensor(qdata, self.layout, params)

    def _activation_kwargs(self, x: torch.Tensor, input_scale: torch.Tensor | None) -> dict:
        return {} if input_scale is None else {"scale": input_scale}

    def clip_candidates(self) -> torch.Tensor:
        """Clip factors tried by the MSE search (always includes 1.0 = absmax)."""
        if not self.free_scale:
            return torch.ones(1)
        return torch.linspace(0.5, 1.0, 11)

    def from_stored(self, tensors: dict[str, torch.Tensor], conf: dict, orig_shape: tuple,
                    dtype: torch.dtype = torch.float32) -> QuantizedTensor:
        """Rebuild kitchen's QuantizedTensor from stored tensors (suffix -> tensor) and the
        .comfy_quant JSON, the way ComfyUI's loader does (ops._load_quantized_module)."""
        params = _KITCHEN_LAYOUTS[self.layout].Params(
            **self._stored_params(tensors, conf), orig_dtype=dtype, orig_shape=tuple(orig_shape))
        return QuantizedTensor(tensors[""], self.layout, params)

    def _stored_params(self, tensors: dict, conf: dict) -> dict:
        return {"scale": tensors["_scale"]}

    # ---------------------------------------------------------------- the stored contract (verify.py)
    def stored_options(self, conf: dict) -> dict:
        """The encoding options a stored layer's ``.comfy_quant`` config names, read as ComfyUI
        reads them (a field, or the same field under ``params``), each checked against its
        domain: raises ValueError naming the field.  What ``planned`` takes for that layer."""
        check_common_fields(conf, self.name, self.block)
        return {}

    def scales_problem(self, scales: dict, read_weight) -> str | None:
        """Why the layer's scales (``scales``: stored suffix -> tensor, as read) do not fit its
        codes - ``read_weight()`` gives the stored weight, read only where a rule needs it - or
        None.  Nothing by default; nvfp4: a zero block scale over codes that are not zero."""
        return None

    def value_problem(self, suffix: str, t: torch.Tensor) -> str | None:
        """Why stored tensor ``suffix`` ('' the weight, '_scale', '_scale_2': kitchen's
        ``state_dict`` suffixes) holds values ComfyUI must not compute with, or None.  Scales must
        be finite and > 0 (a zero or NaN scale gives a zero or NaN layer); weights hold no value
        that is not a number, except where a format says otherwise."""
        return positive_problem(t) if suffix else None


def shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _float_dtype_name(v) -> bool:
    name = v[len("torch."):] if isinstance(v, str) and v.startswith("torch.") else v
    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) \
        and getattr(torch, name).is_floating_point


def check_common_fields(conf: dict, name: str, block: int = 0) -> None:
    """The fields any layer config may carry, in their domains (ValueError naming the field)."""
    params = conf.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"'params' must be a JSON object, got {shown(params)}")
    for field_name, ok, want in (
            ("full_precision_matrix_mult", lambda v: isinstance(v, bool), "true or false"),
            ("group_size", lambda v: is_int(v) and v == (block or v) and v > 0,
             f"{block} for {name}" if block else "a positive integer"),
            ("orig_dtype", _float_dtype_name, "the name of a float dtype")):
        for where in (conf, params):
            if field_name in where and not ok(where[field_name]):
                raise ValueError(f"'{field_name}' must be {want}, got {shown(where[field_name])}")


def option(conf: dict, name: str, default):
    """A layer config field as ComfyUI reads it: the field, else the same field under 'params'."""
    params = conf.get("params", {})
    return conf.get(name, params.get(name, default) if isinstance(params, dict) else default)


def positive_problem(t: torch.Tensor) -> str | None:
    """Why a stored scale is not finite and > 0 everywhere (naming the first bad value), or None."""
    if not t.is_floating_point():
        return f"must be a float scale, is {t.dtype}"
    bad = ~(torch.isfinite(t) & (t > 0))
    if not bool(bad.any()):
        return None
    value = float(t.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]])
    return f"must be finite and > 0, holds {value:g} ({int(bad.sum())} of {t.numel()} values)"


# The byte codes an 8-bit stored value must not hold, as (mask, value) pairs over the byte, and
# the same as bounds on the byte read as int8 and as uint8 (two reductions - read at memory speed
# - find whether any is there; the codes are then counted for the message).
E4M3_NAN = ((0x7F, 0x7F),)                 # float8_e4m3fn: S.1111.111 is NaN (it has no Inf)
E5M2_NAN = ((0x7C, 0x7C),)                 # float8_e5m2: exponent 11111 is Inf or NaN
E4M3_NAN_OR_NEGATIVE = E4M3_NAN + ((0x80, 0x80),)
E8M0_NAN = ((0xFF, 0xFF),)                 # E8M0 scales: 0xFF is NaN, every other byte a power of 2
_BOUNDS = {E4M3_NAN: (-128, 126, 254), E5M2_NAN: (-128, 123, 251), E4M3_NAN_OR_NEGATIVE: (0, 126, 255),
           E8M0_NAN: (-128, 127, 254)}     # (lowest int8, highest int8, highest uint8) a clean byte has


def nan_code_problem(t: torch.Tensor, codes: tuple, what: str) -> str | None:
    """Why 8-bit stored values hold a code ``codes`` forbids (``what`` names it), or None."""
    b = t.reshape(-1).view(torch.uint8)
    if not b.numel():
        return None
    low, high, high_u8 = _BOUNDS[codes]
    lo, hi = torch.aminmax(b.view(torch.int8))
    if int(lo) >= low and int(hi) <= high and int(b.max()) <= high_u8:
        return None
    bad = torch.zeros_like(b, dtype=torch.bool)
    for mask, value in codes:
        bad |= (b & mask) == value
    n = int(bad.sum())
    return f"holds {n} {what} codes (of {b.numel()} values)" if n else None


def kitchen_reference():
    """kitchen's eager (reference) backend: the encoder every test checks against, on any device
    and for float32 inputs (its CUDA quantizers take only 16-bit inputs)."""
    return ck.use_backend("eager")


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    # ComfyUI's DynamicVRAM loader has no F8_E8M0 entry: E8M0 block scales are stored as U8.
    return torch.uint8 if dtype == torch.float8_e8m0fnu else dtype


def _storage(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def tensor_scale(w: torch.Tensor, alpha: torch.Tensor | None, amax: torch.Tensor | None, top: float) -> torch.Tensor:
    """One scale for the whole tensor: its absmax (or ``amax``) over the format's ``top``, times the
    clip factor ``alpha``; an all-zero weight gets 1 (its 0 would give 0/0 in the encoder)."""
    scale = (w.abs().amax() if amax is None else amax).float() / top
    if alpha is not None:
        scale = scale * alpha.float()
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def row_alpha(alpha: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    if alpha is None:
        return None
    return alpha.reshape(-1, 1).to(w.dtype) if alpha.dim() else alpha.to(w.dtype)


def clip_rows(w: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """Clamp each row to alpha * its absmax, so kitchen's absmax scale becomes the clipped one."""
    if alpha is None:
        return w
    bound = w.abs().amax(dim=-1, keepdim=True) * row_alpha(alpha, w)
    return torch.minimum(torch.maximum(w, -bound), bound)

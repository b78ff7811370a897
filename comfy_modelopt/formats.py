"""Quantization formats, one per ComfyUI ``QUANT_ALGOS`` key.

A Format is the only owner of what its format can do; no other module tests a format's name.
It knows:
- ``shape_problem``: whether a ``[N, K]`` Linear weight can use it (kernel and layout rules);
- ``encode``: the on-disk tensors, produced by comfy-kitchen (never re-implemented here), and
  ``conf``: its ``.comfy_quant`` fields;
- ``fake_quant`` / ``fake_act``: a fast torch re-statement of the same rounding of weights and
  activations, used only to *search* scales; the tests hold it equal to kitchen's round trip;
- its capabilities: the recipe options it reads (``options``), its activation limit for a
  static input scale (``input_fmax``) and how that scale is searched (``input_search``),
  GPTQ (``gptq_rounding``), a low-rank branch (``lowrank``), whether one scale covers the
  whole weight (``one_weight_scale``), and how ComfyUI runs it (``native_sm``, ``native_gate``,
  ``lean_kernel``).

A scale choice is a clip factor ``alpha`` (a 0-d tensor, or one value per output row) relative
to the absmax scale: ``alpha == 1`` is the naive absmax encoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import comfy_kitchen as ck
import comfy_kitchen.tensor as ck_tensor
import torch
from comfy_kitchen.tensor import QuantizedTensor

from . import gptq
from .errors import QuantizeError


def regular_hadamard(size: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """kitchen 0.2's ConvRot matrix restated: the normalized regular Hadamard built from the 4x4
    core by Kronecker powers (the fallback if kitchen's private helper moves; a test holds the
    two equal)."""
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=dtype, device=device)
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    return h / size ** 0.5


def rotate_groups(w: torch.Tensor, h: torch.Tensor, group: int) -> torch.Tensor:
    """W·Hᵀ per group of ``group`` input columns."""
    n, k = w.shape
    return (w.reshape(n, k // group, group) @ h.T.to(w)).reshape(n, k)


try:  # private in kitchen 0.2.x: the ConvRot rotation its encoder applies
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_weight
except ImportError:  # pragma: no cover - other kitchen versions
    _build_hadamard, _rotate_weight = regular_hadamard, rotate_groups

# kitchen's own layout classes, held directly: ComfyUI re-registers some layout names with its
# subclasses (e.g. "TensorCoreFP8Layout" becomes its E4M3 class without a dtype argument), so
# resolving by name inside a ComfyUI process would not run kitchen's encoder.
_KITCHEN_LAYOUTS = {name: getattr(ck_tensor, name) for name in (
    "TensorCoreFP8Layout", "TensorWiseINT8Layout", "TensorCoreMXFP8Layout", "TensorCoreNVFP4Layout",
    "TensorCoreConvRotW4A4Layout")}

F8_E4M3_MAX = 448.0
F4_E2M1_MAX = 6.0
_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

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
    input_search: str = ""    # static input scale searched on the "histogram" or a "sample"
    native_gate: str = ""     # comfy.model_management predicate for native compute ("": always)
    lean_kernel: str = ""     # the lean runtime's direct kernel ("": dequantize, or stock)
    w8a8_gemm: bool = True          # a quantized-activation GEMM exists for it (fp8 e5m2: no
    #                                 e5m2 x e5m2 kernel - torch refuses it on Ada/Hopper)
    quantize_input: bool = True     # ComfyUI quantizes the activation before the GEMM (its
    #                                 QUANT_ALGOS "quantize_input"); False: kitchen's kernel does
    block_clip: bool = False        # the encoder derives 16-block scales from each block's max:
    #                                 clamping a block clips it (scales.search_block_clip)

    # ---------------------------------------------------------------- rules
    def shape_problem(self, n: int, k: int, **opts) -> str | None:
        """Why a [n, k] weight cannot use this format with ``opts`` (its recipe options), or None."""
        if k % self.k_multiple:
            return f"{self.name} needs in_features % {self.k_multiple} == 0, got {k}"
        if n % self.n_multiple:
            return f"{self.name} needs out_features % {self.n_multiple} == 0, got {n}"
        return None

    def conf(self, weight_only: bool = False, convrot: bool = False, convrot_groupsize: int = 256,
             linear_dtype: str = "int4") -> dict:
        """The ``.comfy_quant`` JSON object for one layer."""
        conf = {"format": self.name}
        if weight_only:
            conf["full_precision_matrix_mult"] = True
        return conf

    def layout_kwargs(self, convrot: bool = False, convrot_groupsize: int = 256,
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
        qdata, params = self._kitchen_raw(tensor, **kw)
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

    def native_on(self, device: torch.device) -> bool:
        """Whether ComfyUI computes this format natively on ``device``; where not, it lists the
        format as emulated and dequantizes the weight (comfy/ops.py pick_operations: the
        ``supports_*_compute`` predicates named by ``native_gate``)."""
        if not self.native_gate:
            return True
        device = torch.device(device)
        if device.type != "cuda" or torch.version.cuda is None:
            return False
        if self.name == "mxfp8" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 10):
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


def kitchen_reference():
    """kitchen's eager (reference) backend: the encoder every test checks against, on any device
    and for float32 inputs (its CUDA quantizers take only 16-bit inputs)."""
    return ck.use_backend("eager")


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    # ComfyUI's DynamicVRAM loader has no F8_E8M0 entry: E8M0 block scales are stored as U8.
    return torch.uint8 if dtype == torch.float8_e8m0fnu else dtype


def _storage(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t


def _row_alpha(alpha: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    if alpha is None:
        return None
    return alpha.reshape(-1, 1).to(w.dtype) if alpha.dim() else alpha.to(w.dtype)


def _clip_rows(w: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """Clamp each row to alpha * its absmax, so kitchen's absmax scale becomes the clipped one."""
    if alpha is None:
        return w
    bound = w.abs().amax(dim=-1, keepdim=True) * _row_alpha(alpha, w)
    return torch.minimum(torch.maximum(w, -bound), bound)


# ==================================================================== fp8 per-tensor
@dataclass(frozen=True)
class Fp8Format(Format):
    @property
    def dtype(self) -> torch.dtype:
        return _FP8_DTYPES[self.name]

    def fmax(self) -> float:
        return torch.finfo(self.dtype).max

    def input_fmax(self):
        return float(self.fmax())

    def gptq_rounding(self, w, alpha, **opts):
        scale = float(self.weight_scale(w, alpha))
        return gptq.fp8_column_quantizer(scale, self.dtype), torch.tensor(scale)

    def layout_kwargs(self, **opts) -> dict:
        return {"dtype": _FP8_DTYPES[self.name]}

    def weight_scale(self, w: torch.Tensor, alpha: torch.Tensor | None,
                     amax: torch.Tensor | None = None) -> torch.Tensor:
        scale = (w.abs().amax() if amax is None else amax).float() / self.fmax()
        if alpha is not None:
            scale = scale * alpha.float()
        # an all-zero weight would give scale 0 and 0/0 in the encoder
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    def _prepare(self, w, alpha, opts):
        return w, {"scale": self.weight_scale(w, alpha)}

    def _explicit(self, scale):
        return {"scale": scale.reshape(()).float()}

    def _meta_extra(self, meta):
        return {"scale": torch.ones((), device="meta")}

    def _activation_kwargs(self, x, input_scale):
        # ComfyUI's fp8 layouts (comfy/quant_ops.py) take a missing input_scale as 1.0, where
        # kitchen's own would compute the activation's absmax
        scale = torch.ones((), device=x.device) if input_scale is None else input_scale
        return {"scale": scale, "dtype": self.dtype}

    def fake_act(self, x, input_scale=None, **opts):
        if input_scale is None:  # weight-only: the matmul runs in 16-bit
            return x
        fmax = self.fmax()
        q = (x * (1.0 / input_scale)).clamp(-fmax, fmax).to(_FP8_DTYPES[self.name])
        return q.to(torch.float32) * input_scale

    def fake_rows(self, w, alpha=None, amax=None):
        scale = self.weight_scale(w, alpha, amax)
        fmax = self.fmax()
        q = (w * (1.0 / scale)).clamp(-fmax, fmax).to(_FP8_DTYPES[self.name])
        return q.to(torch.float32) * scale


# ==================================================================== int8 per-row (+ConvRot)
def _hadamard_rotate(w: torch.Tensor, group: int) -> torch.Tensor:
    """W·Hᵀ per group of K with kitchen's normalized regular Hadamard (H = Hᵀ, H·H = I)."""
    return _rotate_weight(w, _build_hadamard(group, device=w.device, dtype=w.dtype), group)


@dataclass(frozen=True)
class RowwiseIntFormat(Format):
    qmax: int = 127
    rotated: bool = False  # convrot_w4a4 always rotates; int8 only with convrot=True

    convrot_groups: tuple = (1024, 256, 64, 16)  # regular Hadamard sizes kitchen's ConvRot takes

    def _rotates(self, opts) -> bool:
        return self.rotated or bool(opts.get("convrot"))

    def layer_options(self, n, k, opts):
        # the largest rotation group up to the recipe's that divides in_features: a 384-wide
        # model takes group 64 instead of keeping every layer 16-bit (ComfyUI reads the group
        # per layer from .comfy_quant, for int8 and convrot_w4a4 alike)
        group = opts.get("convrot_groupsize", 256)
        if not self._rotates(opts) or k % group == 0:
            return opts
        fits = [g for g in self.convrot_groups if g < group and k % g == 0]
        return dict(opts, convrot_groupsize=fits[0]) if fits else opts

    def shape_problem(self, n, k, convrot_groupsize=256, convrot=False, **opts):
        problem = super().shape_problem(n, k)
        if problem is None and (self.rotated or convrot) and k % convrot_groupsize:
            problem = f"{self.name} with ConvRot needs in_features % {convrot_groupsize} == 0, got {k}"
        return problem

    def _prepare(self, w, alpha, opts):
        if alpha is None:
            return w, {}
        if not self._rotates(opts):
            return _clip_rows(w, alpha), {}
        # Clip in the rotated basis (where kitchen takes its row absmax), then rotate back so
        # kitchen's own rotation lands on the clipped rows.
        group = opts.get("convrot_groupsize", 256)
        return _hadamard_rotate(_clip_rows(_hadamard_rotate(w, group), alpha), group), {}

    def search_space(self, w, **opts):
        return _hadamard_rotate(w, opts.get("convrot_groupsize", 256)) if self._rotates(opts) else w

    def fake_quant(self, w, alpha=None, **opts):
        out = self.fake_rows(self.search_space(w, **opts), alpha)
        return self.search_space(out, **opts)  # the rotation is its own inverse

    def fake_act(self, x, input_scale=None, linear_dtype="int4", **opts):
        # kitchen's int8/int4 linear: dynamic per-row absmax quantization of the (rotated) input
        x = self.search_space(x, **opts)
        if self.qmax == 127 or linear_dtype == "int8":
            scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
            return (x / scale).round().clamp(-128.0, 127.0) * scale
        return self.fake_rows(x)

    def fake_rows(self, x, alpha=None, amax=None):
        # amax: the rows' absmax [N, 1] when x holds only some of their columns (search subsample)
        absmax = x.abs().amax(dim=-1, keepdim=True) if amax is None else amax
        if alpha is not None:  # candidates are <= 1: the clipped row's absmax is the bound itself
            absmax = absmax * _row_alpha(alpha, x)
            x = torch.minimum(torch.maximum(x, -absmax), absmax)
        if self.qmax == 127:  # kitchen quantize_int8_rowwise
            scale = (absmax / 127.0).clamp(min=1e-30)
            q = (x / scale).round().clamp(-128.0, 127.0)
        else:                 # kitchen quantize_signed_int4_rowwise
            scale = absmax.clamp(min=1e-10) / self.qmax
            q = (x / scale).round().clamp(-self.qmax, self.qmax)
        return q * scale


@dataclass(frozen=True)
class Int8Format(RowwiseIntFormat):

    def gptq_rounding(self, w, alpha, convrot=False, **opts):
        if convrot:  # w is rotated; kitchen takes ConvRot rows' scales only from their absmax
            return _anchored_rows(self, w, alpha)
        absmax = w.abs().amax(dim=1)
        if alpha is not None:
            absmax = absmax * alpha.to(w.device)
        row_scale = (absmax / 127.0).clamp(min=1e-30)
        return gptq.int8_column_quantizer(row_scale), row_scale

    def _explicit(self, scale):
        # kitchen's tensorwise quantizer broadcasts an [N, 1] scale: per-row with given scales
        return {"scale": scale.reshape(-1, 1).float(), "per_channel": False}

    def clip_candidates(self):
        # 127 levels: the optimum of a row without outliers sits close to its absmax
        return torch.tensor([0.6, 0.75, 0.85, 0.9, 0.95, 1.0])

    def _stored_params(self, tensors, conf):
        params = {"scale": tensors["_scale"]}
        if conf.get("convrot"):
            params.update(convrot=True, convrot_groupsize=int(conf.get("convrot_groupsize", 256)))
        return params

    def layout_kwargs(self, convrot=False, convrot_groupsize=256, **opts):
        kw = {"per_channel": True}
        if convrot:
            kw.update(convrot=True, convrot_groupsize=convrot_groupsize)
        return kw

    def conf(self, weight_only=False, convrot=False, convrot_groupsize=256, **opts):
        conf = super().conf(weight_only)
        if convrot:
            conf.update(convrot=True, convrot_groupsize=convrot_groupsize)
        return conf


def _anchored_rows(fmt: RowwiseIntFormat, w: torch.Tensor, alpha):
    """GPTQ rounding of a rotated weight whose per-row scale the encoder derives (row absmax /
    qmax): that scale fixed from the unrounded rows, each row's largest element anchored at
    +-qmax so the encoder derives it again (gptq.py)."""
    absmax = w.abs().amax(dim=1, keepdim=True)
    if alpha is not None:
        absmax = absmax * _row_alpha(alpha, w)
    scale = absmax.clamp(min=1e-10) / fmt.qmax
    return gptq.grid_column_quantizer(scale, w.shape[1], gptq.anchors(w, w.shape[1]), float(fmt.qmax),
                                      torch.round), None


@dataclass(frozen=True)
class ConvRotW4A4Format(RowwiseIntFormat):
    def gptq_rounding(self, w, alpha, **opts):
        return _anchored_rows(self, w, alpha)

    def _stored_params(self, tensors, conf):
        return {"scale": tensors["_scale"], "convrot_groupsize": int(conf.get("convrot_groupsize", 256)),
                "quant_group_size": 64, "linear_dtype": conf.get("linear_dtype", "int4")}

    def layout_kwargs(self, convrot_groupsize=256, linear_dtype="int4", **opts):
        return {"convrot_groupsize": convrot_groupsize, "linear_dtype": linear_dtype}

    def conf(self, weight_only=False, convrot_groupsize=256, linear_dtype="int4", **opts):
        conf = super().conf(weight_only)
        conf["convrot_groupsize"] = convrot_groupsize
        if linear_dtype != "int4":
            conf["linear_dtype"] = linear_dtype
        return conf

    def clip_candidates(self):
        return torch.linspace(0.4, 1.0, 13)


# ==================================================================== nvfp4
def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round |x| <= 6 to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} like kitchen's
    _f32_to_floatx_unpacked: nearest, ties to even mantissa.  The grid step is 0.5 below 2,
    1 below 4 and 2 above, and torch.round rounds half to even on the step count."""
    mag = x.abs()
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(mag / step) * step, x)


def clamp_blocks(w: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] with each 16-value block clamped to +-its ``bound`` [N, K/16]."""
    n, k = w.shape
    b = bound.to(w.dtype).unsqueeze(-1)
    blocks = w.reshape(n, k // 16, 16)
    return torch.maximum(torch.minimum(blocks, b), -b).reshape(n, k)


def _e2m1_blocks(blocks: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """16-value ``blocks`` [..., 16] rounded to E2M1 with each block's ``total`` scale [...] and
    dequantized, as kitchen does (values past +-6 x scale clamped; a zero scale gives zeros)."""
    total = total.unsqueeze(-1)
    safe = torch.where(total == 0, torch.ones_like(total), total)
    scaled = torch.where(total == 0, torch.zeros_like(blocks), blocks / safe)
    return _round_e2m1(scaled.clamp(-F4_E2M1_MAX, F4_E2M1_MAX)) * total


def _nvfp4_block_scales(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The E4M3 scale of each 16-value block as kitchen derives it: block amax / 6 / global
    scale, at most 448, rounded to E4M3 (float32 result)."""
    return (block_amax.float() / F4_E2M1_MAX / global_scale).clamp(max=F8_E4M3_MAX).to(torch.float8_e4m3fn).float()


@dataclass(frozen=True)
class NvFp4Format(Format):
    def input_fmax(self):  # the activation global scale: amax / (6 * 448)
        return F4_E2M1_MAX * F8_E4M3_MAX

    def _stored_params(self, tensors, conf):
        return {"scale": tensors["_scale_2"], "block_scale": tensors["_scale"].view(torch.float8_e4m3fn)}

    def global_scale(self, w: torch.Tensor, alpha: torch.Tensor | None,
                     amax: torch.Tensor | None = None) -> torch.Tensor:
        scale = (w.abs().amax() if amax is None else amax).float() / (F8_E4M3_MAX * F4_E2M1_MAX)
        if alpha is not None:
            scale = scale * alpha.float()
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    def _prepare(self, w, alpha, opts):
        return w, {"scale": self.global_scale(w, alpha)}

    def _meta_extra(self, meta):
        return {"scale": torch.ones((), device="meta")}

    def _explicit(self, scale):
        return {"scale": scale.reshape(()).float()}

    def quantize(self, w, alpha=None, scale=None, block_bound=None, **opts):
        """As ``Format.quantize``; ``block_bound`` [N, K/16] (scales.search_block_clip) sets each
        16-block's scale to the one kitchen derives from that magnitude instead of the block's
        max: a bound below the max clips the block (it is clamped, and kitchen derives the scale
        from the clamp), a bound above it *raises* the scale - the block's largest value then
        lands below 6 on the E2M1 grid, where the grid is finer (4 -> 6 is its coarsest step;
        "Four Over Six", Cook et al. 2025, scales blocks to 4 for this).  kitchen derives every
        block scale from the block's largest value, so it cannot be asked for a raised one
        directly: ``_raised`` encodes such blocks in two kitchen calls."""
        if block_bound is None:
            return super().quantize(w, alpha, scale, **opts)
        g = self.global_scale(w, alpha) if scale is None else scale.reshape(()).float()
        n, k = w.shape
        bound = block_bound.float().to(w.device)
        x = clamp_blocks(w.float(), bound)
        raised = _nvfp4_block_scales(x.abs().reshape(n, k // 16, 16).amax(-1), g) != _nvfp4_block_scales(bound, g)
        kw = {**self.layout_kwargs(**opts), **self._explicit(g)}
        if not bool(raised.any()):
            return self._kitchen(x, **kw)
        return self._raised(x, bound, raised, g, kw)

    def _raised(self, x, bound, raised, g, kw) -> QuantizedTensor:
        """kitchen's encoding of ``x`` [N, K] with the blocks marked ``raised`` [N, K/16] scaled
        from ``bound`` rather than from their own max.  Call A sets each raised block's largest
        element to 6 x that scale, so kitchen derives the scale, and codes every other element
        of the block against it; that element's own code is then wrong (6).  Call B sets another
        element of the block, one in a different byte (two E2M1 codes share a byte), and codes
        the largest one right.  The result takes call B's byte holding the largest element and
        call A's everywhere else: every byte and every scale is kitchen's own, unchanged."""
        n, k = x.shape
        top = 6.0 * _nvfp4_block_scales(bound, g) * g          # kitchen derives exactly the scale from it
        blocks = x.reshape(n, k // 16, 16)
        arg = blocks.abs().argmax(-1, keepdim=True)
        a, b = blocks.clone(), blocks.clone()
        a.scatter_(-1, arg, torch.where(raised, top, a.gather(-1, arg).squeeze(-1)).unsqueeze(-1))
        other = arg ^ 2                                        # same block, another byte
        b.scatter_(-1, other, torch.where(raised, top, b.gather(-1, other).squeeze(-1)).unsqueeze(-1))
        (qa, pa), (qb, pb) = self._kitchen_raw(a.reshape(n, k), **kw), self._kitchen_raw(b.reshape(n, k), **kw)
        if not torch.equal(pa.block_scale.view(torch.uint8), pb.block_scale.view(torch.uint8)):
            raise QuantizeError("nvfp4: kitchen derived different block scales for the two halves of a raised "
                                "block's encoding")
        pick = torch.zeros(n, k // 16, 8, dtype=torch.bool, device=x.device)
        pick.scatter_(-1, arg // 2, raised.unsqueeze(-1))      # the byte of each raised block's largest value
        pick = torch.nn.functional.pad(pick.reshape(n, k // 2),
                                       (0, qa.shape[1] - k // 2, 0, qa.shape[0] - n))
        return QuantizedTensor(torch.where(pick, qb, qa), self.layout, pa)

    def fake_blocks(self, w: torch.Tensor, bound: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize -> dequantize of float ``w`` [N, K] (K % 16 == 0) with each 16-block's scale
        derived from ``bound`` [N, K/16] (``quantize``'s ``block_bound``: clipped below the block's
        max, raised above it); ``amax`` as in ``fake_rows``."""
        n, k = w.shape
        g = self.global_scale(w, None, amax)
        blocks = clamp_blocks(w.float(), bound).reshape(n, k // 16, 16)
        return _e2m1_blocks(blocks, g * _nvfp4_block_scales(bound.float(), g)).reshape(n, k)

    def gptq_rounding(self, w, alpha, block_bound=None, **opts):
        # block scales fixed as kitchen derives them from the unrounded weight (E4M3 of
        # block amax / 6 / global, at most 448) - or from ``block_bound`` (scales.search_block_clip);
        # each block's largest element anchored at +-6 (its clamp, where the bound clips), except
        # in raised blocks: ``quantize`` sets their scales whatever their largest value rounds to
        if w.shape[1] % 16:
            return None
        g = self.global_scale(w, alpha)
        n, k = w.shape
        bmax = w.abs().reshape(n, k // 16, 16).amax(dim=-1)
        scales = _nvfp4_block_scales(bmax if block_bound is None else block_bound.float(), g)
        anchor = gptq.anchors(w, 16)
        if block_bound is not None:
            anchor &= (scales <= _nvfp4_block_scales(bmax, g)).repeat_interleave(16, dim=1)
        return gptq.grid_column_quantizer(scales * g, 16, anchor, F4_E2M1_MAX, _round_e2m1), g

    def fake_act(self, x, input_scale=None, **opts):
        amax = None if input_scale is None else torch.tensor(input_scale * F8_E4M3_MAX * F4_E2M1_MAX)
        return self.fake_rows(x, None, amax)

    def clip_candidates(self):
        # below 1 clips the largest blocks; above 1 only shifts block scales on the E4M3 grid
        # (periodic in log2), so a few phases suffice
        return torch.cat([torch.linspace(0.5, 1.0, 11), torch.tensor([1.25, 1.5, 1.75])])

    def fake_rows(self, w, alpha=None, amax=None):
        n, k = w.shape
        pad_n, pad_k = -n % 16, -k % 16
        x = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n)) if pad_n or pad_k else w
        s = self.global_scale(w, alpha, amax)
        blocks = x.reshape(x.shape[0], -1, 16)
        deq = _e2m1_blocks(blocks, s * _nvfp4_block_scales(blocks.abs().amax(dim=-1), s)).reshape(x.shape)
        return deq[:n, :k]


# ==================================================================== mxfp8
def _mxfp8_block_scales(block_amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 scale of each 32-value block as kitchen derives it: 2^ceil(log2(amax / 448))."""
    return torch.exp2(torch.ceil(torch.log2((block_amax / F8_E4M3_MAX).clamp(min=2.0 ** -127))).clamp(-127, 127))


@dataclass(frozen=True)
class MxFp8Format(Format):
    def _stored_params(self, tensors, conf):
        return {"scale": tensors["_scale"].view(torch.float8_e8m0fnu)}

    def fake_act(self, x, input_scale=None, **opts):
        return self.fake_rows(x)

    def gptq_rounding(self, w, alpha, **opts):
        # block scales fixed as kitchen derives them from the unrounded weight (2^ceil(log2(amax /
        # 448))); each block's largest element anchored on the grid above 224 (gptq.py)
        if w.shape[1] % 32:
            return None
        n, k = w.shape
        amax = w.abs().reshape(n, k // 32, 32).amax(dim=-1).float()
        scale = torch.where(amax == 0, torch.zeros_like(amax), _mxfp8_block_scales(amax))
        return gptq.grid_column_quantizer(scale, 32, gptq.anchors(w, 32), F8_E4M3_MAX, gptq.round_e4m3,
                                          gptq.e4m3_up), None

    def fake_rows(self, w, alpha=None, amax=None):
        n, k = w.shape
        pad_n, pad_k = -n % 32, -k % 32
        x = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n)) if pad_n or pad_k else w
        blocks = x.reshape(x.shape[0], -1, 32)
        amax = blocks.abs().amax(dim=-1).float()
        scale = torch.where(amax == 0, torch.ones_like(amax), _mxfp8_block_scales(amax)).unsqueeze(-1)
        q = (blocks / scale).clamp(-F8_E4M3_MAX, F8_E4M3_MAX).to(torch.float8_e4m3fn).float()
        deq = torch.where(amax.unsqueeze(-1) == 0, torch.zeros_like(q), q * scale)
        return deq.reshape(x.shape)[:n, :k]


_FP8_KW = dict(layout="TensorCoreFP8Layout", native_sm=(8, 9), static_input_scale=True, needs_input_scale=True,
            free_scale="tensor", k_multiple=16, n_multiple=16, one_weight_scale=True, input_search="histogram",
            native_gate="supports_fp8_compute", lean_kernel="fp8_scaled_mm")
# fp8 E4M3: per-tensor scale; W8A8 with a calibrated input_scale, else weight-only
FLOAT8_E4M3FN = Fp8Format("float8_e4m3fn", **_FP8_KW)
# fp8 E5M2: wider range, 2 mantissa bits; weight-only (an input_scale would make ComfyUI run an
# e5m2 x e5m2 GEMM, which torch refuses on an H200: "Multiplication of two Float8_e5m2 matrices
# is not supported")
FLOAT8_E5M2 = Fp8Format("float8_e5m2", **_FP8_KW, w8a8_gemm=False)
# int8: per-row weight scale, dynamic per-row int8 activations; optional ConvRot rotation
INT8_TENSORWISE = Int8Format("int8_tensorwise", "TensorWiseINT8Layout", (7, 5), False, False, "row", 16, 1,
                             options=("convrot", "convrot_groupsize"), lean_kernel="int8_linear",
                             quantize_input=False)
# MXFP8: E4M3 values with one E8M0 scale per 32; dynamic activations
MXFP8 = MxFp8Format("mxfp8", "TensorCoreMXFP8Layout", (10, 0), False, False, "", 32, 1,
                    native_gate="supports_mxfp8_compute")
# NVFP4: E2M1 values, E4M3 scale per 16, fp32 global scale; dynamic or static activations
NVFP4 = NvFp4Format("nvfp4", "TensorCoreNVFP4Layout", (10, 0), True, False, "tensor", 32, 1, lowrank=True,
                    values_per_element=2, input_search="sample", native_gate="supports_nvfp4_compute",
                    block_clip=True)
# Hadamard-rotated signed int4 weights and activations (int4 MMA)
CONVROT_W4A4 = ConvRotW4A4Format("convrot_w4a4", "TensorCoreConvRotW4A4Layout", (7, 5), False, False, "row", 64, 1,
                                 options=("convrot_groupsize", "linear_dtype"), lowrank=True, values_per_element=2,
                                 quantize_input=False, qmax=7, rotated=True)

FORMATS: dict[str, Format] = {f.name: f for f in (
    FLOAT8_E4M3FN, FLOAT8_E5M2, INT8_TENSORWISE, MXFP8, NVFP4, CONVROT_W4A4)}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of: {', '.join(FORMATS)}") from None


def values_per_element(name: str) -> int:
    """Weight values per stored element of format ``name`` (1 for names that are not formats)."""
    fmt = FORMATS.get(name)
    return fmt.values_per_element if fmt is not None else 1

"""Row-wise integer formats: int8 W8A8 (dynamic per-row activations; optional ConvRot
Hadamard rotation) and the shared base of convrot_w4a4 (convrot_w4a4.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import gptq
from ..safetensors_io import is_int
from . import CONVROT_GROUP_DEFAULT, CONVROT_GROUPS
from .base import Format, ModelOptQuantizers, clip_rows, row_alpha, shown, option


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


def rotation_group(conf: dict) -> int:
    """A stored layer's ConvRot group as ComfyUI reads it (default 256), checked against what
    kitchen's rotation takes: a power of 4."""
    group = option(conf, "convrot_groupsize", CONVROT_GROUP_DEFAULT)
    if not (is_int(group) and group >= 4 and group & (group - 1) == 0
            and group.bit_length() % 2 == 1):
        raise ValueError(f"'convrot_groupsize' must be a power of 4 (kitchen's rotation), got {shown(group)}")
    return group


def _hadamard_rotate(w: torch.Tensor, group: int) -> torch.Tensor:
    """W·Hᵀ per group of K with kitchen's normalized regular Hadamard (H = Hᵀ, H·H = I)."""
    return _rotate_weight(w, _build_hadamard(group, device=w.device, dtype=w.dtype), group)


@dataclass(frozen=True)
class RowwiseIntFormat(Format):
    qmax: int = 127
    rotated: bool = False  # convrot_w4a4 always rotates; int8 only with convrot=True

    convrot_groups: tuple = CONVROT_GROUPS  # regular Hadamard sizes kitchen's ConvRot takes

    def _rotates(self, opts) -> bool:
        return self.rotated or bool(opts.get("convrot"))

    def layer_options(self, n, k, opts):
        # the largest rotation group up to the recipe's that divides in_features: a 384-wide
        # model takes group 64 instead of keeping every layer 16-bit (ComfyUI reads the group
        # per layer from .comfy_quant, for int8 and convrot_w4a4 alike)
        group = opts.get("convrot_groupsize", CONVROT_GROUP_DEFAULT)
        if not self._rotates(opts) or k % group == 0:
            return opts
        fits = [g for g in self.convrot_groups if g < group and k % g == 0]
        return dict(opts, convrot_groupsize=fits[0]) if fits else opts

    def shape_problem(self, n, k, convrot_groupsize=CONVROT_GROUP_DEFAULT, convrot=False, **opts):
        problem = super().shape_problem(n, k)
        if problem is None and (self.rotated or convrot) and k % convrot_groupsize:
            problem = f"{self.name} with ConvRot needs in_features % {convrot_groupsize} == 0, got {k}"
        return problem

    def _prepare(self, w, alpha, opts):
        if alpha is None:
            return w, {}
        if not self._rotates(opts):
            return clip_rows(w, alpha), {}
        # Clip in the rotated basis (where kitchen takes its row absmax), then rotate back so
        # kitchen's own rotation lands on the clipped rows.
        group = opts.get("convrot_groupsize", CONVROT_GROUP_DEFAULT)
        return _hadamard_rotate(clip_rows(_hadamard_rotate(w, group), alpha), group), {}

    def search_space(self, w, **opts):
        return _hadamard_rotate(w, opts.get("convrot_groupsize", CONVROT_GROUP_DEFAULT)) if self._rotates(opts) else w

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
            absmax = absmax * row_alpha(alpha, x)
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
            return anchored_rows(self, w, alpha)
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
        return {"scale": tensors["_scale"], **self.stored_options(conf)}

    def stored_options(self, conf):
        super().stored_options(conf)
        convrot = option(conf, "convrot", False)
        if not isinstance(convrot, bool):
            raise ValueError(f"'convrot' must be true or false, got {shown(convrot)}")
        return {"convrot": True, "convrot_groupsize": rotation_group(conf)} if convrot else {}

    def layout_kwargs(self, convrot=False, convrot_groupsize=CONVROT_GROUP_DEFAULT, **opts):
        kw = {"per_channel": True}
        if convrot:
            kw.update(convrot=True, convrot_groupsize=convrot_groupsize)
        return kw

    def conf(self, weight_only=False, convrot=False, convrot_groupsize=CONVROT_GROUP_DEFAULT, **opts):
        conf = super().conf(weight_only)
        if convrot:
            conf.update(convrot=True, convrot_groupsize=convrot_groupsize)
        return conf


def anchored_rows(fmt: RowwiseIntFormat, w: torch.Tensor, alpha):
    """GPTQ rounding of a rotated weight whose per-row scale the encoder derives (row absmax /
    qmax): that scale fixed from the unrounded rows, each row's largest element anchored at
    +-qmax so the encoder derives it again (gptq.py)."""
    absmax = w.abs().amax(dim=1, keepdim=True)
    if alpha is not None:
        absmax = absmax * row_alpha(alpha, w)
    scale = absmax.clamp(min=1e-10) / fmt.qmax
    return gptq.grid_column_quantizer(scale, w.shape[1], gptq.anchors(w, w.shape[1]), float(fmt.qmax),
                                      torch.round, grid="int"), None


# int8: per-row weight scale, dynamic per-row int8 activations; optional ConvRot rotation
# ModelOpt 0.47's smoothquant smooths int8 quantizers only (with fp8 ones it smoothed nothing)
INT8_TENSORWISE = Int8Format(name="int8_tensorwise", layout="TensorWiseINT8Layout", native_sm=(7, 5),
                             static_input_scale=False, needs_input_scale=False, free_scale="row", k_multiple=16,
                             options=("convrot", "convrot_groupsize"), lean_kernel="int8_linear",
                             quantize_input=False, candidate=3, colour=(38, 166, 91), modelopt=ModelOptQuantizers(
                                 {"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}, ("max", "smoothquant")))

"""nvfp4: E2M1 values, one E4M3 scale per 16 values, an fp32 global scale; dynamic or static
activations; the per-block scale search (clipped or raised block scales)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_kitchen.tensor import QuantizedTensor

from .. import gptq
from ..errors import QuantizeError
from ..scales import sample_errors
from .base import E4M3_NAN_OR_NEGATIVE, F4_E2M1_MAX, F8_E4M3_MAX, Format, ModelOptQuantizers, nan_code_problem, tensor_scale


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

    def scales_problem(self, scales, read_weight):
        """A block scale of zero is what kitchen writes for a block of zeros only: over codes that
        are not zero it silences the block (a zeroed or damaged scale).  The weight is read only
        where a scale is zero; kitchen's own unswizzle maps the stored scales to their blocks."""
        stored = scales.get("_scale")
        if stored is None or not bool((stored.view(torch.uint8) == 0).any()):
            return None
        from comfy_kitchen.float_utils import from_blocked
        codes = read_weight().view(torch.uint8)
        rows, blocks = codes.shape[0], codes.shape[1] // 8  # two E2M1 codes a byte, 16 a block
        zero = from_blocked(stored.view(torch.uint8), rows, blocks) == 0
        # a code's magnitude is its low three bits (0x8 is the sign: -0 is zero)
        filled = (codes.reshape(rows, blocks, 8) & 0x77).amax(dim=-1) != 0
        bad = int((zero & filled).sum())
        return f"{bad} block scales of zero over blocks whose codes are not zero (of {zero.numel()})" if bad else None

    def value_problem(self, suffix, t):
        if suffix == "_scale":  # E4M3 block scales: >= 0 (zero for an all-zero block), never NaN
            return nan_code_problem(t, E4M3_NAN_OR_NEGATIVE, "NaN or negative block-scale")
        return super().value_problem(suffix, t)

    def global_scale(self, w: torch.Tensor, alpha: torch.Tensor | None,
                     amax: torch.Tensor | None = None) -> torch.Tensor:
        return tensor_scale(w, alpha, amax, F8_E4M3_MAX * F4_E2M1_MAX)

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
        return gptq.grid_column_quantizer(scales * g, 16, anchor, F4_E2M1_MAX, _round_e2m1, grid="e2m1"), g

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

# NVFP4: E2M1 values, E4M3 scale per 16, fp32 global scale; dynamic or static activations
_NVFP4_MODELOPT = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
NVFP4 = NvFp4Format(name="nvfp4", layout="TensorCoreNVFP4Layout", native_sm=(10, 0), static_input_scale=True,
                    needs_input_scale=False, free_scale="tensor", k_multiple=32, lowrank=True,
                    values_per_element=2, input_search=sample_errors, native_gate="supports_nvfp4_compute",
                    block_clip=True, block=16, candidate=1, lean_emulated="w4a8", colour=(235, 120, 30),
                    eight_bit="float8_e4m3fn",
                    modelopt=ModelOptQuantizers(_NVFP4_MODELOPT, _NVFP4_MODELOPT,
                                                ("max", "awq_lite", "awq_full", "svdquant")))

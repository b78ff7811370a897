"""comfy-modelopt's own loader, for the layers stock ComfyUI cannot run.

Such layers carry a format name that is not a ComfyUI ``QUANT_ALGOS`` key
(``modelopt_lowrank_<base>``), so stock ComfyUI refuses the file instead of silently dropping
their extra tensors.  This loader rewrites them to their stock base format, lets ComfyUI's own
loader build the model (mixed-precision ops, model management, LoRA all unchanged), then gives
each such layer its extra computation:

    y = base(x * smooth_scale) + (x * smooth_scale) @ lowrank_down^T @ lowrank_up^T

where ``base`` is the stock (or lean) quantized layer holding the 4-bit residual.

fp8 convolutions (``modelopt_conv_fp8``; ComfyUI 0.29 quantizes only Linear layers) are stored
2-D ``[O, I*kh*kw]`` with one float32 scale per output channel, so stock ComfyUI fails on their
shape instead of running raw fp8 values.  ComfyUI's loader gets a zero-memory 16-bit placeholder
of the real shape; the layer then holds the fp8 weight (4-D view) and dequantizes it per call -
from any device, so offloading keeps working, and with the lowvram weight functions applied in
the stored basis like a regular patch.

LoRA and other weight patches: ComfyUI adds a patch's delta to the stored weight, which for a
smoothed layer lives in the smoothed basis (``W / smooth_scale`` per input column) and for an
fp8 convolution in its scaled basis (``W / scale`` per output channel).  The patcher this loader
returns maps every delta on such a layer into that basis, so the layer's output changes exactly
as for a 16-bit model (up to re-quantization).
"""
from __future__ import annotations

import types

import torch

import comfy.model_management
import comfy.sd
import comfy.utils

from ..errors import CheckpointError
from ..safetensors_io import SafetensorsFile
from ..fileformat import (COMFY_QUANT, CONV_FORMAT, LOWRANK_PREFIX, LOWRANK_SUFFIXES, QUANT_METADATA,
                          comfy_quant_tensor, decode_comfy_quant, decode_quantization_metadata,
                          encode_quantization_metadata, needs_own_loader, stock_conf)

PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def split_state_dict(sd: dict, metadata: dict | None) -> tuple[dict, dict, dict]:
    """(stock state dict, stock metadata, extras by layer name relative to the diffusion model).

    An fp8 convolution's extras are ``conv_weight`` (fp8, 4-D view), ``conv_scale`` [O];
    ComfyUI's loader gets a zero-stride placeholder of the real shape in its place."""
    sd = dict(sd)
    extras = {}
    placeholder = _placeholder_dtype(sd)
    for key in [k for k in sd if k.endswith(COMFY_QUANT)]:
        conf = decode_comfy_quant(sd[key], key)
        layer = key[: -len(COMFY_QUANT)]
        if conf.get("format") == CONV_FORMAT:
            shape = tuple(conf["shape"])
            del sd[key]
            try:
                q, scale = sd.pop(layer + ".weight"), sd.pop(layer + ".weight_scale")
                q = q.view(shape)
            except (KeyError, RuntimeError) as e:
                raise CheckpointError(f"{layer}: broken {CONV_FORMAT} layer ({type(e).__name__}: {e})") from None
            sd[layer + ".weight"] = torch.zeros((), dtype=placeholder).expand(shape)
            extras[_relative(layer)] = {"conv_weight": q, "conv_scale": scale.float()}
            continue
        stock = stock_conf(conf)
        if stock is None:
            continue
        sd[key] = comfy_quant_tensor(stock)
        extras[_relative(layer)] = {s[1:]: sd.pop(layer + s) for s in LOWRANK_SUFFIXES if layer + s in sd}
    meta = dict(metadata or {})
    if QUANT_METADATA in meta:
        layers = decode_quantization_metadata(meta[QUANT_METADATA], QUANT_METADATA)
        meta[QUANT_METADATA] = encode_quantization_metadata(
            {name: stock_conf(conf) or conf for name, conf in layers.items() if conf["format"] != CONV_FORMAT})
    return sd, meta, extras


def _placeholder_dtype(sd: dict):
    """The 16-bit dtype of the file's unquantized weights (ComfyUI infers the model dtype from
    them, so a placeholder must not change the vote)."""
    counts: dict = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.dtype in (torch.float16, torch.bfloat16, torch.float32):
            counts[v.dtype] = counts.get(v.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else torch.bfloat16


def _relative(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def load_state_dict(sd: dict, metadata: dict | None = None, rebuildable: bool = False, **load_options):
    """A MODEL from a diffusion-model state dict: ComfyUI's own loader, which our layers then
    join when the file has any (options go to ComfyUI's loader; ``sd`` itself is not changed).
    Returns None when ComfyUI cannot detect the model.

    ``rebuildable``: register this call as the patcher's ``cached_patcher_init`` - ComfyUI
    rebuilds a model through it when it needs a non-dynamic copy (hooks in the conditioning on
    a dynamic-VRAM model) or one per GPU (multi-GPU); without it ComfyUI refuses those, and
    through its own loader it would rebuild our layers without their extras.  Keeps ``sd``
    alive as long as the patcher."""
    patcher = _load(dict(sd), metadata, **load_options)
    if patcher is not None and rebuildable:
        patcher.cached_patcher_init = (load_state_dict, (sd, metadata, True))  # rebuildable again
    return patcher


def _load(sd: dict, metadata: dict | None, **load_options):
    if not needs_own_loader(metadata, sd):
        return comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata, **load_options)
    stock_sd, meta, extras = split_state_dict(sd, metadata)
    patcher = comfy.sd.load_diffusion_model_state_dict(stock_sd, metadata=meta, **load_options)
    if patcher is None:
        return None
    attach(patcher, extras)
    # what a weight delta is divided by to land in the stored basis, shaped to broadcast
    divisors = {}
    for name, ex in extras.items():
        if ex.get("smooth_scale") is not None:
            divisors["diffusion_model." + name + ".weight"] = ex["smooth_scale"].float()  # per input column
        if ex.get("conv_scale") is not None:
            divisors["diffusion_model." + name + ".weight"] = ex["conv_scale"].float().view(-1, 1, 1, 1)
    patcher.model._modelopt_stored_basis = divisors
    if divisors:
        # a subclass, not an instance attribute: ModelPatcher.clone() keeps self.__class__, and
        # where ComfyUI picks another class (a non-dynamic copy of a dynamic patcher) our
        # clone() puts the mapping back on top of it
        patcher.__class__ = _basis_aware(type(patcher))
    return patcher


def load_file(path: str, **load_options):
    """A MODEL from a file; ComfyUI rebuilds copies by reading the file again."""
    with SafetensorsFile(path):  # header and layout checked first: names an interrupted write, a bad key
        pass
    sd, metadata = comfy.utils.load_torch_file(path, safe_load=True, return_metadata=True)
    patcher = load_state_dict(sd, metadata, **load_options)
    if patcher is not None:
        patcher.cached_patcher_init = (load_file, (path,))
    return patcher


def attach(patcher, extras: dict) -> int:
    """Give every own-loader layer its low-rank branch and input smoothing, or its fp8 weight."""
    model = patcher.model.diffusion_model
    dtype = patcher.model.get_dtype() or torch.bfloat16
    for name, ex in extras.items():
        module = model.get_submodule(name)
        if "conv_weight" in ex:
            if not isinstance(module, torch.nn.Conv2d):
                raise ValueError(f"{name}: {CONV_FORMAT} needs a Conv2d, the model has {type(module).__name__}")
            if tuple(ex["conv_weight"].shape) != tuple(module.weight.shape):
                raise ValueError(f"{name}: fp8 weight {tuple(ex['conv_weight'].shape)} does not fit the "
                                 f"model's {tuple(module.weight.shape)}")
            module.weight = torch.nn.Parameter(ex["conv_weight"], requires_grad=False)
            module.register_buffer("weight_scale", ex["conv_scale"])
            module.forward = types.MethodType(_conv_fp8_forward, module)
            module._modelopt_conv_fp8 = True
            continue
        for buf in ("lowrank_up", "lowrank_down", "smooth_scale"):
            t = ex.get(buf)
            if t is not None and buf != "smooth_scale":
                t = t.to(dtype=dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32)
            module.register_buffer(buf, t)
        module._modelopt_base_forward = module.forward
        module.forward = types.MethodType(_branch_forward, module)
    return len(extras)


_PATCHER_CLASSES: dict = {}


def _basis_aware(cls):
    """``cls`` with add_patches mapping deltas on layers stored in another basis (smoothed,
    fp8 convolutions) into that basis."""
    if getattr(cls, "_modelopt_basis_aware", False):
        return cls
    if cls not in _PATCHER_CLASSES:
        def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
            divisors = getattr(self.model, "_modelopt_stored_basis", {})
            mapped = {}
            for k, v in patches.items():
                key, offset, fn = (k, None, None) if isinstance(k, str) else (k[0], k[1], k[2] if len(k) > 2 else None)
                if key in divisors and offset is None:
                    k = (key, None, _into_stored_basis(divisors[key], fn))
                mapped[k] = v
            return cls.add_patches(self, mapped, strength_patch, strength_model)

        def clone(self, *args, **kwargs):
            n = cls.clone(self, *args, **kwargs)
            if not getattr(type(n), "_modelopt_basis_aware", False) and \
                    getattr(n.model, "_modelopt_stored_basis", None):
                n.__class__ = _basis_aware(type(n))
            return n
        _PATCHER_CLASSES[cls] = type(cls.__name__, (cls,), {"add_patches": add_patches, "clone": clone,
                                                            "_modelopt_basis_aware": True})
    return _PATCHER_CLASSES[cls]


def _into_stored_basis(divisor: torch.Tensor, inner=None):
    def fn(delta):
        delta = inner(delta) if inner is not None else delta
        return delta / divisor.to(delta.device, delta.dtype)
    return fn


def _conv_fp8_forward(self, x, *args, **kwargs):
    """Dequantize (fp32, per output channel) and convolve; weight functions (ComfyUI's lowvram
    patches) act on the stored basis, where their deltas were mapped to."""
    cast = comfy.model_management.cast_to_device
    w = cast(self.weight, x.device, torch.float32)
    for f in self.weight_function:
        w = f(w)
    w = (w * cast(self.weight_scale, x.device, torch.float32).view(-1, 1, 1, 1)).to(x.dtype)
    b = None if self.bias is None else cast(self.bias, x.device, x.dtype)
    for f in self.bias_function:
        b = f(b)
    return self._conv_forward(x, w, b)


def _branch_forward(self, x, *args, **kwargs):
    cast = comfy.model_management.cast_to_device
    if self.smooth_scale is not None:
        x = x * cast(self.smooth_scale, x.device, x.dtype)
    y = self._modelopt_base_forward(x, *args, **kwargs)
    down = cast(self.lowrank_down, x.device, x.dtype)
    up = cast(self.lowrank_up, x.device, x.dtype)
    return y + torch.nn.functional.linear(torch.nn.functional.linear(x, down), up)


__all__ = ["LOWRANK_PREFIX", "attach", "load_file", "load_state_dict", "needs_own_loader", "split_state_dict"]

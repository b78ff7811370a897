"""comfy-modelopt's own loader, for the layers stock ComfyUI cannot run.

Such layers carry a format name that is not a ComfyUI ``QUANT_ALGOS`` key
(``modelopt_lowrank_<base>``), so stock ComfyUI refuses the file instead of silently dropping
their extra tensors.  This loader rewrites them to their stock base format, lets ComfyUI's own
loader build the model (mixed-precision ops, model management, LoRA all unchanged), then gives
each such layer its extra computation:

    y = base(x * smooth_scale) + (x * smooth_scale) @ lowrank_down^T @ lowrank_up^T

where ``base`` is the stock (or lean) quantized layer holding the 4-bit residual.

LoRA and other weight patches: ComfyUI adds a patch's delta to the stored weight, which for a
smoothed layer lives in the smoothed basis (``W / smooth_scale`` per input column).  The patcher
this loader returns maps every delta on such a layer into that basis (``delta / smooth_scale``),
so ``y`` changes by exactly ``x @ delta^T`` as for a 16-bit model (up to re-quantization).
"""
from __future__ import annotations

import json
import types

import torch

import comfy.model_management
import comfy.sd
import comfy.utils

from ..plan import LOWRANK_PREFIX, comfy_quant_bytes, stock_conf

EXTRA_SUFFIXES = (".lowrank_up", ".lowrank_down", ".smooth_scale")
PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def needs_own_loader(metadata: dict | None, keys) -> bool:
    if metadata and metadata.get("comfy_modelopt.loader"):
        return True
    return any(k.endswith(".lowrank_up") for k in keys)


def split_state_dict(sd: dict, metadata: dict | None) -> tuple[dict, dict, dict]:
    """(stock state dict, stock metadata, extras by layer name relative to the diffusion model)."""
    sd = dict(sd)
    extras = {}
    for key in [k for k in sd if k.endswith(".comfy_quant")]:
        stock = stock_conf(json.loads(bytes(sd[key].tolist()).decode("utf-8")))
        if stock is None:
            continue
        layer = key[: -len(".comfy_quant")]
        sd[key] = torch.frombuffer(bytearray(comfy_quant_bytes(stock)), dtype=torch.uint8)
        extras[_relative(layer)] = {s[1:]: sd.pop(layer + s) for s in EXTRA_SUFFIXES if layer + s in sd}
    meta = dict(metadata or {})
    if "_quantization_metadata" in meta:
        q = json.loads(meta["_quantization_metadata"])
        for name, conf in q.get("layers", {}).items():
            q["layers"][name] = stock_conf(conf) or conf
        meta["_quantization_metadata"] = json.dumps(q)
    return sd, meta, extras


def _relative(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def load_state_dict(sd: dict, metadata: dict | None = None, **load_options):
    """A MODEL from a diffusion-model state dict: ComfyUI's own loader, which our layers then
    join when the file has any (options go to ComfyUI's loader).  Returns None when ComfyUI
    cannot detect the model."""
    if not needs_own_loader(metadata, sd):
        return comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata, **load_options)
    stock_sd, meta, extras = split_state_dict(sd, metadata)
    patcher = comfy.sd.load_diffusion_model_state_dict(stock_sd, metadata=meta, **load_options)
    if patcher is None:
        return None
    attach(patcher, extras)
    smoothed = {"diffusion_model." + name + ".weight": ex["smooth_scale"].float()
                for name, ex in extras.items() if ex.get("smooth_scale") is not None}
    if smoothed:
        # a subclass, not an instance attribute: ModelPatcher.clone() keeps self.__class__
        # (except clone(disable_dynamic=True) of a dynamic patcher, which falls back to the
        # plain ModelPatcher: patches added to such a clone are not mapped - a known limit)
        patcher.__class__ = _smoothing_aware(type(patcher))
        patcher.model._modelopt_smoothed_weights = smoothed
    return patcher


def load_file(path: str):
    sd, metadata = comfy.utils.load_torch_file(path, safe_load=True, return_metadata=True)
    return load_state_dict(sd, metadata)


def attach(patcher, extras: dict) -> int:
    """Give every own-loader layer its low-rank branch and input smoothing."""
    model = patcher.model.diffusion_model
    dtype = patcher.model.get_dtype() or torch.bfloat16
    for name, ex in extras.items():
        module = model.get_submodule(name)
        for buf in ("lowrank_up", "lowrank_down", "smooth_scale"):
            t = ex.get(buf)
            if t is not None and buf != "smooth_scale":
                t = t.to(dtype=dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32)
            module.register_buffer(buf, t)
        module._modelopt_base_forward = module.forward
        module.forward = types.MethodType(_branch_forward, module)
    return len(extras)


_PATCHER_CLASSES: dict = {}


def _smoothing_aware(cls):
    """``cls`` with add_patches mapping deltas on smoothed layers into their stored basis."""
    if getattr(cls, "_modelopt_smoothing_aware", False):
        return cls
    if cls not in _PATCHER_CLASSES:
        def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
            smoothed = getattr(self.model, "_modelopt_smoothed_weights", {})
            mapped = {}
            for k, v in patches.items():
                key, offset, fn = (k, None, None) if isinstance(k, str) else (k[0], k[1], k[2] if len(k) > 2 else None)
                if key in smoothed and offset is None:
                    k = (key, None, _into_smoothed_basis(smoothed[key], fn))
                mapped[k] = v
            return cls.add_patches(self, mapped, strength_patch, strength_model)
        _PATCHER_CLASSES[cls] = type(cls.__name__, (cls,), {"add_patches": add_patches,
                                                            "_modelopt_smoothing_aware": True})
    return _PATCHER_CLASSES[cls]


def _into_smoothed_basis(smooth_scale: torch.Tensor, inner=None):
    def fn(delta):
        delta = inner(delta) if inner is not None else delta
        return delta / smooth_scale.to(delta.device, delta.dtype)
    return fn


def _branch_forward(self, x, *args, **kwargs):
    cast = comfy.model_management.cast_to_device
    if self.smooth_scale is not None:
        x = x * cast(self.smooth_scale, x.device, x.dtype)
    y = self._modelopt_base_forward(x, *args, **kwargs)
    down = cast(self.lowrank_down, x.device, x.dtype)
    up = cast(self.lowrank_up, x.device, x.dtype)
    return y + torch.nn.functional.linear(torch.nn.functional.linear(x, down), up)


__all__ = ["LOWRANK_PREFIX", "attach", "load_file", "load_state_dict", "needs_own_loader", "split_state_dict"]

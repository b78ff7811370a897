"""MODEL <-> weights.  Design: docs/design.md, ``comfyui/model.py``."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import comfy.lora
import comfy.model_management
import comfy.utils
from comfy.model_patcher import get_key_weight

from ..report import QuantReport
from . import ownloader
from ..fileformat import COMFY_QUANT
from ..safetensors_io import ST_DTYPES, TORCH_DTYPES

PREFIX = "diffusion_model."
ARTIFACT = "comfy_modelopt"  # attribute on the BaseModel holding what Save needs


class NodeError(RuntimeError):
    """A problem the user can fix; the message says how."""


@dataclass
class Artifact:
    """The quantized state dict exactly as it should be saved (tensors shared with the model)."""
    state_dict: dict
    metadata: dict
    report: QuantReport


class PatcherSource:
    """Pipeline source over a ModelPatcher (keys relative to the diffusion model)."""

    def __init__(self, patcher, device: torch.device):
        self.patcher, self.device = patcher, device
        sd = patcher.model_state_dict(filter_prefix=PREFIX)
        if not sd:
            raise NodeError("this MODEL has no diffusion_model weights")
        self.tensors, self.nbytes = {}, {}
        store = _storage_dtype(patcher)
        for k, v in sd.items():
            rel = k[len(PREFIX):]
            if type(v).__name__ == "QuantizedTensor" or k.endswith(COMFY_QUANT):
                raise NodeError("this MODEL is already quantized: connect the 16-bit model "
                                "(e.g. from Load Diffusion Model with weight_dtype default)")
            dtype = ST_DTYPES[v.dtype]
            # ComfyUI may hold weights in fp32 (e.g. on CPU): what is not quantized is stored 16-bit
            self.tensors[rel] = (store if dtype in ("F32", "F64") else dtype, tuple(v.shape))
            self.nbytes[rel] = v.numel() * torch.empty((), dtype=TORCH_DTYPES[self.tensors[rel][0]]).element_size()
        self.metadata = {}

    def read(self, rel: str) -> torch.Tensor:
        """A fresh copy of the tensor, patches applied (float32 where patched).  2-D weights go
        to the compute device for the math; everything else stays on the CPU."""
        key = PREFIX + rel
        weight, _set, convert = get_key_weight(self.patcher.model, key)
        target = self.device if (rel.endswith(".weight") and weight.dim() == 2) else torch.device("cpu")
        patches = self.patcher.patches.get(key)
        if not patches:
            return comfy.model_management.cast_to_device(weight.detach(), target, None, copy=True)
        w = comfy.model_management.cast_to_device(weight.detach(), target, torch.float32, copy=True)
        if convert is not None:
            w = convert(w, inplace=True)
        return comfy.lora.calculate_weight(patches, w, key)


def _storage_dtype(patcher) -> str:
    """The 16-bit dtype this model family prefers (first of its supported inference dtypes)."""
    for dt in patcher.model.model_config.supported_inference_dtypes:
        if dt in (torch.float16, torch.bfloat16):
            return ST_DTYPES[dt]
    return "BF16"


def _config_signature(model) -> dict:
    cfg = dict(model.model_config.unet_config)
    cfg.pop("dtype", None)
    return cfg


def build_quantized_model(state_dict: dict, metadata: dict, report: QuantReport, source_patcher=None):
    """A stock quantized MODEL from our state dict; refuses one ComfyUI would detect as another
    architecture."""
    # rebuildable: ComfyUI can make non-dynamic / per-GPU copies through our loader (the state
    # dict is kept for Save Quantized Model anyway)
    patcher = ownloader.load_state_dict(state_dict, dict(metadata), rebuildable=True)
    if patcher is None:
        raise NodeError("ComfyUI could not detect a model in the quantized weights; keep the layers "
                        "its detection reads in 16-bit (keep patterns) and report this model family")
    if source_patcher is not None:
        want, got = _config_signature(source_patcher.model), _config_signature(patcher.model)
        if type(source_patcher.model.model_config) is not type(patcher.model.model_config) or want != got:
            diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            raise NodeError(f"ComfyUI detects the quantized weights as a different model "
                            f"({type(patcher.model.model_config).__name__}, differing in {diff[:5]}): "
                            f"add keep patterns for the layers its detection reads")
        # sampling settings patched upstream (ModelSampling*, CFG tweaks, ...) carry over
        patcher.object_patches = source_patcher.object_patches.copy()
        patcher.model_options = comfy.utils.deepcopy_list_dict(source_patcher.model_options)
    setattr(patcher.model, ARTIFACT, Artifact(state_dict, metadata, report))
    return patcher


def artifact_of(patcher) -> Artifact | None:
    return getattr(patcher.model, ARTIFACT, None)


def compute_device() -> torch.device:
    dev = comfy.model_management.get_torch_device()
    return dev if isinstance(dev, torch.device) else torch.device(dev)


def log(msg: str) -> None:
    logging.info(f"[comfy-modelopt] {msg}")


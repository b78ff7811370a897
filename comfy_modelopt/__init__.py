"""comfy-modelopt: calibrated quantization of diffusion models into ComfyUI-native checkpoints.

The core (this package minus ``comfy_modelopt.comfyui``) is plain PyTorch + safetensors +
comfy-kitchen and never imports ComfyUI.
"""
__version__ = "0.1.0"

from .formats import FORMATS, Format, get_format  # noqa: E402
from .recipe import Recipe  # noqa: E402

__all__ = ["FORMATS", "Format", "Recipe", "get_format", "quantize_file", "inspect_file", "__version__"]


def quantize_file(*args, **kwargs):
    from .pipeline import quantize_file as _q
    return _q(*args, **kwargs)


def inspect_file(*args, **kwargs):
    from .checkpoint import inspect_file as _i
    return _i(*args, **kwargs)

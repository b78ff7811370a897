"""comfy-modelopt: calibrated quantization of diffusion models into ComfyUI-native checkpoints.

The core (this package minus ``comfy_modelopt.comfyui``) is plain PyTorch + safetensors +
comfy-kitchen and never imports ComfyUI.

    quantize(state_dict, recipe, stats=None) -> (state_dict, metadata, report)
    quantize_file(src, out, recipe, stats=None, ...) -> report
    inspect_file(path) -> InspectResult
    quantize_module(module, recipe, stats=None) -> module computing what ComfyUI computes
    export_state_dict(module) -> (state_dict, metadata): the file quantize_file would write
"""
__version__ = "0.1.0"

from .formats import FORMATS, Format, get_format  # noqa: E402
from .recipe import Recipe  # noqa: E402
from .pipeline import quantize, quantize_file  # noqa: E402
from .checkpoint import inspect_file  # noqa: E402
from .modules import export_file, export_state_dict, quantize_module  # noqa: E402

__all__ = ["FORMATS", "Format", "Recipe", "get_format", "quantize", "quantize_file", "inspect_file",
           "quantize_module", "export_state_dict", "export_file", "__version__"]

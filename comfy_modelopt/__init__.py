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

# imported on first use, so the command line (its --help) starts without torch
_FROM = {"formats": ("FORMATS", "Format", "get_format"), "recipe": ("Recipe",),
         "pipeline": ("quantize", "quantize_file"), "checkpoint": ("inspect_file",),
         "modules": ("export_file", "export_state_dict", "quantize_module")}


def __getattr__(name: str):
    for module, names in _FROM.items():
        if name in names:
            import importlib
            value = getattr(importlib.import_module(f".{module}", __name__), name)
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [n for names in _FROM.values() for n in names] + ["__version__"]

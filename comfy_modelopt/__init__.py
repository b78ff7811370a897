"""comfy-modelopt: calibrated quantization of diffusion models into ComfyUI-native checkpoints.

The core (this package minus ``comfy_modelopt.comfyui``) is plain PyTorch + safetensors +
comfy-kitchen and never imports ComfyUI.

    quantize(source, recipe, stats=None, out=None, ...) -> (state_dict, metadata, report)
        the one entry: source a path, a state dict or a source object; out a file (then the
        state dict and metadata are None)
    quantize_file(src, out, recipe, stats=None, ...) -> report
    inspect_file(path) -> InspectResult
    quantize_module(module, recipe, stats=None) -> module computing what ComfyUI computes
    export_state_dict(module) -> (state_dict, metadata): the file quantize_file would write
    save_stats(stats, path) / load_stats(path): calibration statistics as a file
"""
__version__ = "0.1.0"

# imported on first use, so the command line (its --help) starts without torch
_FROM = {"formats": ("FORMATS", "Format", "get_format"), "recipe": ("Recipe",),
         "pipeline": ("quantize", "quantize_file"), "checkpoint": ("inspect_file",),
         "modules": ("export_file", "export_state_dict", "quantize_module"),
         "statsfile": ("load_stats", "save_stats")}


from .lazy import exports  # noqa: E402

__getattr__ = exports(__name__, _FROM, globals())


__all__ = [n for names in _FROM.values() for n in names] + ["__version__"]

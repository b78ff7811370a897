"""ComfyUI entry point of the comfy-modelopt node pack (V3 node API).

Clone this repository into ComfyUI/custom_nodes/ and install requirements.txt; the nodes appear
under "modelopt".  The library and CLI live in the comfy_modelopt package next to this file.
Imported outside ComfyUI (test runners collecting this folder), it defines nothing.
"""
import importlib.util

if importlib.util.find_spec("comfy_api") is not None:
    from .comfy_modelopt.comfyui.nodes import comfy_entrypoint

    __all__ = ["comfy_entrypoint"]

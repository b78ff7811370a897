"""What this node pack needs of the packages ComfyUI installs, checked when ComfyUI loads it.

comfy-kitchen is ComfyUI's own dependency (ComfyUI 0.29 pins 0.2.24); the pack's requirements
accept that pin rather than replace it: the real-ComfyUI suite passes with 0.2.24 as with 0.2.40
(docs/status.md), but 0.2.24 has no INT8 attention kernel, so that runtime is refused there with
the reason; older kitchens are refused.
"""
from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

KITCHEN_MIN = (0, 2, 24)      # ComfyUI 0.29's pin: every format, encoder and loader path
KITCHEN_ALL = (0, 2, 40)      # + the INT8 attention kernel (runtime "... + int8 attention")


def _parse(text: str) -> tuple:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_kitchen() -> str:
    """The installed comfy-kitchen's version; an ImportError (ComfyUI shows it as the pack's
    import failure) when it is missing or older than the pack works with; a logged warning when
    it lacks something optional."""
    try:
        found = version("comfy-kitchen")
    except PackageNotFoundError:
        raise ImportError("comfy-modelopt needs comfy-kitchen (ComfyUI's own quantization kernels): "
                          "pip install -r custom_nodes/comfy-modelopt/requirements.txt") from None
    need = ".".join(map(str, KITCHEN_MIN))
    if _parse(found) < KITCHEN_MIN:
        raise ImportError(f"comfy-modelopt needs comfy-kitchen >= {need} (found {found}): its quantized layouts "
                          f"are older than the formats use; pip install 'comfy-kitchen>={need}'")
    if _parse(found) < KITCHEN_ALL:
        logging.info(f"[comfy-modelopt] comfy-kitchen {found}: every format works; the INT8 attention runtime "
                     f"needs {'.'.join(map(str, KITCHEN_ALL))} or newer")
    return found

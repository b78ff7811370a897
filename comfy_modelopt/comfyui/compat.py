"""What this node pack needs of the packages ComfyUI installs, checked when ComfyUI loads it.
Design: docs/design.md, ``comfyui/compat.py``.
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

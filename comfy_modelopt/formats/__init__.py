"""Quantization formats, one per ComfyUI ``QUANT_ALGOS`` key, one file each (base.py holds the
contract every format fulfils).  ``FORMATS`` is the one table of them; no other module tests a
format's name."""
from __future__ import annotations

from .base import F4_E2M1_MAX, F8_E4M3_MAX, Format, kitchen_reference
from .convrot_w4a4 import CONVROT_W4A4, ConvRotW4A4Format
from .fp8 import FLOAT8_E4M3FN, FLOAT8_E5M2, Fp8Format
from .int8 import INT8_TENSORWISE, Int8Format, RowwiseIntFormat, regular_hadamard, rotate_groups
from .mxfp8 import MXFP8, MxFp8Format
from .nvfp4 import NVFP4, NvFp4Format, clamp_blocks

FORMATS: dict[str, Format] = {f.name: f for f in (
    FLOAT8_E4M3FN, FLOAT8_E5M2, INT8_TENSORWISE, MXFP8, NVFP4, CONVROT_W4A4)}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of: {', '.join(FORMATS)}") from None


def values_per_element(name: str) -> int:
    """Weight values per stored element of format ``name`` (1 for names that are not formats)."""
    fmt = FORMATS.get(name)
    return fmt.values_per_element if fmt is not None else 1


__all__ = ["FORMATS", "Format", "get_format", "values_per_element", "kitchen_reference", "F8_E4M3_MAX",
           "F4_E2M1_MAX", "FLOAT8_E4M3FN", "FLOAT8_E5M2", "INT8_TENSORWISE", "MXFP8", "NVFP4", "CONVROT_W4A4",
           "Fp8Format", "Int8Format", "RowwiseIntFormat", "ConvRotW4A4Format", "NvFp4Format", "MxFp8Format",
           "clamp_blocks", "regular_hadamard", "rotate_groups"]

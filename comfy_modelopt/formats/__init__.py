"""Quantization formats, one per ComfyUI ``QUANT_ALGOS`` key, one file each (base.py holds the
contract every format fulfils).  ``FORMATS`` is the one table of them; no other module tests a
format's name.  A new format is its file, its line in ``TABLE`` and its test.
Design: docs/design.md, ``formats/__init__.py``.
"""
from __future__ import annotations

from ..lazy import exports

# every format's name and the file of this package that defines it, in the order the command line
# and the node list them
TABLE = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "int8_tensorwise": "int8", "mxfp8": "mxfp8",
         "nvfp4": "nvfp4", "convrot_w4a4": "convrot_w4a4"}
NAMES = tuple(TABLE)
# the regular Hadamard sizes kitchen's ConvRot rotation takes, largest first
CONVROT_GROUPS = (1024, 256, 64, 16)
# the group ComfyUI (and kitchen) assume where a layer's config does not name one; the recipe's default
CONVROT_GROUP_DEFAULT = 256

_FROM = {"base": ("F4_E2M1_MAX", "F8_E4M3_MAX", "Format", "kitchen_reference"),
         "convrot_w4a4": ("CONVROT_W4A4", "ConvRotW4A4Format"),
         "fp8": ("FLOAT8_E4M3FN", "FLOAT8_E5M2", "Fp8Format"),
         "int8": ("INT8_TENSORWISE", "Int8Format", "RowwiseIntFormat", "regular_hadamard", "rotate_groups"),
         "mxfp8": ("MXFP8", "MxFp8Format"),
         "nvfp4": ("NVFP4", "NvFp4Format", "clamp_blocks")}


_exported = exports(__name__, _FROM, globals())


def __getattr__(name: str):
    if name == "FORMATS":
        table = _discover()
        globals()["FORMATS"] = table
        return table
    return _exported(name)


def _discover() -> dict:
    """``TABLE``'s formats, each the one ``Format`` of that name its file defines (an ImportError
    names the file that lacks it)."""
    import importlib

    table = {}
    for name, file in TABLE.items():
        module = importlib.import_module(f"{__name__}.{file}")
        found = [v for v in vars(module).values() if getattr(v, "name", None) == name and hasattr(v, "planned")]
        if not found:
            raise ImportError(f"formats/{file}.py: defines no format named {name!r} (formats.TABLE says it does)")
        table[name] = found[0]
    return table


def get_format(name: str):
    """The Format named ``name`` (a ValueError naming the choices otherwise)."""
    try:
        return __getattr__("FORMATS")[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of: {', '.join(NAMES)}") from None


def values_per_element(name: str) -> int:
    """Weight values per stored element of format ``name`` (1 for names that are not formats)."""
    fmt = __getattr__("FORMATS").get(name)
    return fmt.values_per_element if fmt is not None else 1


__all__ = ["NAMES", "CONVROT_GROUPS", "CONVROT_GROUP_DEFAULT", "FORMATS", "get_format", "values_per_element",
           *(n for names in _FROM.values() for n in names)]

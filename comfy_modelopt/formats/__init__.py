"""Quantization formats, one per ComfyUI ``QUANT_ALGOS`` key, one file each (base.py holds the
contract every format fulfils).  ``FORMATS`` is the one table of them, built from the ``Format``
instances the files of this package define; no other module tests a format's name.  A new
format is its file (with its ``ORDER``) and its test.

``NAMES`` (and the ConvRot groups) are plain values, importable without torch - the command
line's help lists them - read from the format files' source (``_declared``); everything else is
imported from the format files on first use.
"""
from __future__ import annotations

import ast
import os

from ..lazy import exports


def _declared(*folders: str) -> tuple[str, ...]:
    """The format names the files in ``folders`` declare, read from their source without importing
    them (no torch): every top-level ``X = SomeFormat(name="...", ...)``, ordered by the file's
    literal ``ORDER`` (then by place in the file).  An ImportError names a file that declares
    formats without an ``ORDER``."""
    found = []
    for folder, file in sorted((d, f) for d in folders for f in os.listdir(d)):
        if not file.endswith(".py") or file.startswith("_"):
            continue
        with open(os.path.join(folder, file), encoding="utf-8") as f:
            body = ast.parse(f.read(), file).body
        names = [kw.value.value for node in body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                 for kw in node.value.keywords
                 if kw.arg == "name" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)]
        order = [node.value for node in body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "ORDER" for t in node.targets)]
        if names and not order:
            raise ImportError(f"formats/{file}: declares {', '.join(names)} without an ORDER (its place in the list)")
        if names:
            found.append((ast.literal_eval(order[0]), folder, file, names))
    return tuple(n for *_where, names in sorted(found) for n in names)


# the formats in the order FORMATS lists them (checked against it when it is built)
NAMES = _declared(*__path__)
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
    """Every ``Format`` instance defined at the top of a module of this package, in ``NAMES``'s
    order (an ImportError naming the file where a format and ``NAMES`` disagree)."""
    import importlib
    import pkgutil

    from .base import Format
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Format) and found.setdefault(value.name, (value, info.name))[0] is not value:
                raise ImportError(f"formats/{info.name}.py: a second format named {value.name!r} "
                                  f"(formats/{found[value.name][1]}.py has one)")
    if set(found) != set(NAMES):
        odd = [f"{n} (formats/{found[n][1]}.py)" for n in found if n not in NAMES] + \
            [f"{n} (no file defines it)" for n in NAMES if n not in found]
        raise ImportError(f"formats/__init__.py: NAMES {NAMES} and the formats defined disagree: {', '.join(odd)}")
    return {n: found[n][0] for n in NAMES}


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

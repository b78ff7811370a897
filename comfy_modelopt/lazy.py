"""Names a package exports from its submodules, imported on first use (PEP 562), so that what
needs none of them - the command line's --help - starts without torch."""
from __future__ import annotations

import importlib


def exports(package: str, table: dict[str, tuple[str, ...]], namespace: dict):
    """A module ``__getattr__`` for ``package``: each name of ``table`` (submodule -> names) is
    imported from its submodule when first asked for, and kept in ``namespace``."""
    def __getattr__(name: str):
        for module, names in table.items():
            if name in names:
                value = getattr(importlib.import_module(f".{module}", package), name)
                namespace[name] = value
                return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__

"""Names a package imports on first use, so that importing the package (or one of its
modules) does not import everything it offers: ``__getattr__ = lazy_names(__name__, {name:
module})`` in the package's ``__init__``."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` that imports ``names[name]`` (a module path,
    absolute or relative to ``package``) on the first lookup of ``name`` and keeps the value
    on the package, so later lookups skip it."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__

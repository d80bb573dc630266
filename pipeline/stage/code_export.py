"""The model's own source files, shipped in the stage so anyone can rebuild the model.

:func:`local_sources` starts at the module of ``model.factory`` and follows its imports
(read with :mod:`ast`, never executed beyond what building the model already imported),
keeping every module whose file lies in the run's folder or in this package: the code a
Hub user cannot ``pip install``. Each file is kept under its import path
(``examples/charlm/model.py``, with the ``__init__.py`` of every package on the way), so
putting the stage's ``code/`` folder first on ``sys.path`` imports exactly these files.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

from ..errors import ConfigError

__all__ = ["local_sources"]


def _origin(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(os.path.abspath(spec.origin))


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name ``tree`` may import: ``import a.b``, ``from a import b`` (``a`` and
    ``a.b``, which may be a submodule), relative imports resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module and base else (node.module or base)
            else:
                target = node.module or ""
            if target:
                names.add(target)
                names.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _installed_roots() -> tuple[Path, ...]:
    # A virtual environment inside the run's folder holds installed packages, not the user's code.
    return tuple({Path(os.path.abspath(p)) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def local_sources(factory: str, roots: tuple[Path, ...]) -> dict[str, Path]:
    """``{path relative to code/: file}`` for the module named in ``factory``
    (``package.module:function``) and every module it imports, transitively, whose file lies
    under one of ``roots`` and not in an installed location (the interpreter's prefixes).
    Empty when the factory's module is itself installed."""
    module = factory.partition(":")[0]
    roots = tuple(Path(os.path.abspath(root)) for root in roots)
    installed = _installed_roots()
    found: dict[str, Path] = {}
    pending = _with_parents(module)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        origin = _origin(name)
        if (origin is None or not any(origin.is_relative_to(root) for root in roots)
                or any(origin.is_relative_to(root) for root in installed)):
            continue
        is_package = origin.name == "__init__.py"
        relative = "/".join(name.split(".")) + ("/__init__.py" if is_package else ".py")
        found[relative] = origin
        try:
            tree = ast.parse(origin.read_bytes(), filename=str(origin))
        except (OSError, SyntaxError, ValueError) as exc:
            raise ConfigError(f"model.factory: cannot read {origin} to ship it with the model ({exc})") from None
        for imported in _imported_names(tree, name, is_package):
            pending.extend(_with_parents(imported))
    return dict(sorted(found.items()))

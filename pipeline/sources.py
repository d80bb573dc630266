"""The source files a run is computed with: the model's code closure, and a module's file.

The closure is what script 05 ships under ``code/`` so anyone can rebuild the model, and what
each checkpoint fingerprints as the model's code (:mod:`pipeline.provenance`): it lives below
both. :func:`model_sources` starts at the module that defines the model factory and follows
its imports (read with :mod:`ast`, never executed beyond what building the model already
imported), keeping every module whose file lies in the run's folder: the code a Hub user
cannot ``pip install``. Imports under ``if TYPE_CHECKING:`` and optional ones (in a ``try``
that catches ``ImportError``) are not needed to load the model and are not followed. Of
this project only the self-contained helpers (:data:`SELF_CONTAINED`: :mod:`pipeline.params`,
the default task's model) ship; model code that needs more of it, or that imports the data
factory's module, is refused, since the published repository would not load without this
project or would carry the data pipeline. Each file is kept under its import path
(``examples/charlm/model.py``, with the ``__init__.py`` of every package on the way), so
putting the stage's ``code/`` folder first on ``sys.path`` imports exactly these files;
:func:`module_file` names any one module's file the same way (a factory's).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from .errors import ConfigError, StageError

if TYPE_CHECKING:
    from .config import Config

__all__ = ["PACKAGE_ROOT", "SELF_CONTAINED", "model_sources", "module_file", "shipped_sources"]

# This project's own sources.
PACKAGE_ROOT = Path(__file__).resolve().parent

# Modules of this project written to import nothing else of it: the only ones that ship.
SELF_CONTAINED = frozenset({"pipeline", "pipeline.params", "pipeline.tasks", "pipeline.tasks.mlp"})
_PROJECT = "pipeline"


def _origin(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(os.path.abspath(spec.origin))


def _import_path(module: str, origin: Path) -> str:
    """``examples/charlm/model.py``: where ``module``'s file ``origin`` lies under its import path."""
    return "/".join(module.split(".")) + ("/__init__.py" if origin.name == "__init__.py" else origin.suffix)


def module_file(module: str) -> tuple[str, Path] | None:
    """``("examples/charlm/data.py", file)``: a module's file (any kind) under its import path."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        return None
    origin = Path(os.path.abspath(spec.origin))
    return _import_path(module, origin), origin


def _location(top_level: str) -> Path | None:
    """Where a top-level module or package (namespace packages included) lives, found
    without importing it."""
    try:
        spec = importlib.util.find_spec(top_level)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None:
        return None
    if spec.origin is not None and spec.origin.endswith(".py"):
        return Path(os.path.abspath(spec.origin))
    locations = list(spec.submodule_search_locations or [])
    return Path(os.path.abspath(locations[0])) if locations else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(kind, ast.Name) and kind.id in names for kind in kinds):
            return True
    return False


def _required_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node`` that run when the module loads or is used,
    skipping ``if TYPE_CHECKING:`` blocks and the body of a ``try`` that catches ImportError."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    for field, value in ast.iter_fields(node):
        if isinstance(node, ast.If) and field == "body" and _is_type_checking(node.test):
            continue
        if isinstance(node, ast.Try) and field == "body" and _catches_import_error(node):
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                yield from _required_imports(child)


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name ``tree`` may need: ``import a.b``, ``from a import b`` (``a`` and
    ``a.b``, which may be a submodule), relative imports resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _required_imports(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        if node.level:
            parts = package.split(".") if package else []
            if node.level - 1 > len(parts):
                continue
            base = ".".join(parts[: len(parts) - (node.level - 1)])
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


def _is_local(origin: Path, root: Path, installed: tuple[Path, ...]) -> bool:
    return origin.is_relative_to(root) and not any(origin.is_relative_to(p) for p in installed)


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def model_sources(
    module: str,
    root: Path,
    *,
    project_root: Path,
    data_modules: frozenset[str] = frozenset(),
    strict: bool = True,
) -> dict[str, Path]:
    """``{path relative to code/: file}`` for ``module`` (the one defining the model factory)
    and every module it needs, transitively, whose file lies under ``root`` (the run's
    folder) and not in an installed location, plus the :data:`SELF_CONTAINED` modules of
    this project (``project_root``) it needs. Empty when ``module`` is installed. Raises
    :class:`StageError` when the code needs another module of this project or one of
    ``data_modules`` (the data factories'); with ``strict=False`` those are left out instead
    (a training run records the closure; only the stage refuses to publish it)."""
    root, project_root = Path(os.path.abspath(root)), Path(os.path.abspath(project_root))
    installed = _installed_roots()
    found: dict[str, Path] = {}
    pending = [(name, module) for name in _with_parents(module)]
    seen: set[str] = set()
    while pending:
        name, needed_by = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        # find_spec("a.b") imports package a: look at a first, so that an installed package
        # (datasets, say) is never imported just to learn that it is not shipped.
        top = _location(name.partition(".")[0])
        if top is None or not (top.is_relative_to(project_root) or _is_local(top, root, installed)):
            continue
        origin = _origin(name)
        if origin is None:
            continue
        ours = origin.is_relative_to(project_root)
        if ours and name.split(".")[0] == _PROJECT and name not in SELF_CONTAINED:
            if not strict:
                continue
            raise StageError(
                f"the model's code ({needed_by}) imports {name}, which is not published with it: the "
                "repository would not load without this project; import only pipeline.params "
                "(read_params, ConfigError) in model code, and type-only imports under "
                "`if TYPE_CHECKING:` (docs/custom-model.md)"
            )
        if not ours and not _is_local(origin, root, installed):
            continue
        if name in data_modules:
            if not strict:
                continue
            raise StageError(
                f"the model's code ({needed_by}) imports {name}, the data factory's module, which would "
                "be published with it: move what the model needs (constants, helpers) into the model's "
                "own module (docs/custom-model.md)"
            )
        is_package = origin.name == "__init__.py"
        found[_import_path(name, origin)] = origin
        try:
            tree = ast.parse(origin.read_bytes(), filename=str(origin))
        except (OSError, SyntaxError, ValueError) as exc:
            raise ConfigError(
                f"model.factory: cannot read {origin} to ship it with the model ({exc})"
            ) from None
        for imported in _imported_names(tree, name, is_package):
            pending.extend((parent, name) for parent in _with_parents(imported))
    return dict(sorted(found.items()))


def shipped_sources(config: Config, *, strict: bool = True) -> dict[str, Path]:
    """:func:`model_sources` of the config's model factory, run from the working folder: what
    script 05 ships under ``code/`` and what each checkpoint fingerprints as the model's code."""
    # Imported here: it needs torch's side of the package (a run or a stage is being built).
    from .factories import defining_module, importable_working_folder

    with importable_working_folder():
        module = defining_module(config.model.factory, "model.factory")
        data_modules = frozenset(
            spec.partition(":")[0] for spec in (config.data.factory, config.data.prepare)
        )
        return model_sources(
            module, Path.cwd(), project_root=PACKAGE_ROOT, data_modules=data_modules, strict=strict
        )

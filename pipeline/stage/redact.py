"""Keep machine paths on the machine: what is published names paths relative to the run.

A config records where things lived (``data.dir``, ``checkpoint.dir``, a task's own file
parameters); on this machine those may be absolute, under a home folder that carries the
user's name. :func:`public_paths` rewrites every absolute path in a JSON tree relative to
the run's folder when it lies inside it, and replaces it by its role (the key that held
it, e.g. ``<data.dir>``) when it does not.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["public_paths"]


def _public(text: str, root: Path, role: str) -> str:
    if not os.path.isabs(text):
        # A path inside a longer text (a command line, a message): the run's folder goes, home becomes ~.
        home = os.path.expanduser("~")
        text = text.replace(f"{root}{os.sep}", "")
        return text.replace(f"{home}{os.sep}", f"~{os.sep}") if len(home) > 1 else text
    try:
        relative = Path(os.path.abspath(text)).relative_to(root)
    except ValueError:
        return f"<{role}>"
    return PurePosixPath(*relative.parts).as_posix() if relative.parts else "."


def public_paths(tree: Any, root: str | Path, role: str = "") -> Any:
    """A copy of ``tree`` (JSON types) in which every absolute path string is relative to
    ``root`` or, outside it, ``<role>`` (the dotted key path that held it)."""
    root = Path(os.path.abspath(root))
    if isinstance(tree, dict):
        return {
            key: public_paths(value, root, f"{role}.{key}" if role else str(key))
            for key, value in tree.items()
        }
    if isinstance(tree, list):
        return [public_paths(value, root, f"{role}[{i}]") for i, value in enumerate(tree)]
    if isinstance(tree, str):
        return _public(tree, root, role or "path")
    return tree

"""Where a result came from: code fingerprint and library versions."""

from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from .config import Config
from .hashing import fingerprint_files, fingerprint_table, sha256_file

__all__ = ["PACKAGE_ROOT", "code_fingerprint", "factory_sources", "factories_fingerprint",
           "sources_fingerprint", "library_versions"]

FACTORY_KEYS = ("data.prepare", "data.factory", "model.factory", "optimizer.factory", "scheduler.factory")

PACKAGE_ROOT = Path(__file__).resolve().parent


def code_fingerprint(extra_roots: tuple[Path, ...] = ()) -> str:
    """SHA-256 over the package's Python sources (and any extra source folders)."""
    files = sorted(PACKAGE_ROOT.rglob("*.py"))
    root = PACKAGE_ROOT.parent
    for extra in extra_roots:
        files += sorted(Path(extra).resolve().rglob("*.py"))
    return fingerprint_files(files, root=root)


def _version(name: str) -> str | None:
    # importlib.metadata reads installed metadata without importing the package, so
    # training never imports huggingface_hub (no code path to the network).
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    import numpy
    import torch

    return {
        "python": platform.python_version(),
        "platform": sys.platform,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "safetensors": _version("safetensors"),
        "huggingface_hub": _version("huggingface_hub"),
        "pipeline": _version("exact-resume-pipeline"),
        "cuda": torch.version.cuda,
    }


def _factory_source(path: str) -> dict[str, Any]:
    module = path.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None else None
    if origin is None or not Path(origin).is_file():
        return {"factory": path, "file": None, "sha256": None}
    return {"factory": path, "file": origin, "sha256": sha256_file(origin)}


def factory_sources(config: Config) -> dict[str, dict[str, Any]]:
    """The file defining each configured factory, hashed: a user's model code is part of
    what a checkpoint or a proof records, not only this package's."""
    out = {}
    for dotted in FACTORY_KEYS:
        section, _, key = dotted.partition(".")
        out[dotted] = _factory_source(getattr(getattr(config, section), key))
    return out


def factories_fingerprint(config: Config) -> str:
    """One SHA-256 over the configured factory paths and the files defining them."""
    return sources_fingerprint(factory_sources(config))


def sources_fingerprint(sources: dict[str, dict[str, Any]]) -> str:
    """:func:`factories_fingerprint` of a recorded :func:`factory_sources` table (a proof's)."""
    return fingerprint_table({f"{key}={entry['factory']}": {"sha256": entry["sha256"] or "missing"}
                              for key, entry in sources.items()})

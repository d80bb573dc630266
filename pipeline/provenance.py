"""Where a result came from: code fingerprint and library versions."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from pathlib import Path

from .hashing import fingerprint_files

__all__ = ["PACKAGE_ROOT", "code_fingerprint", "library_versions"]

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
        "pipeline": _version("pipeline"),
        "cuda": torch.version.cuda,
    }

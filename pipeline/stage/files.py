"""The stage folder, for 05 and 05 --from-folder alike: whether an existing one may be
replaced, each file written and hashed as it goes, the manifest, the Hub's per-file size, and
its permissions.

Permissions: a stage is built in a folder only its owner can enter (0700), so no one else can
open a file of it while it is built, whatever that file's mode; once built, the folder takes
back the mode the umask gives, and each staged file made from a file of the source (weights,
a tokenizer file) keeps no permission that source file lacks: weights only their owner may
read (0600) are staged 0600. Files 05 writes itself (card, record, manifest) follow the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Mapping

from ..audit import stage_marker_problem
from ..errors import StageError
from ..hashing import HashingWriter
from .weights import HUB_MAX_FILE_SIZE

__all__ = [
    "build_privately",
    "built_by_us",
    "check_file_sizes",
    "check_replaceable",
    "manifest_bytes",
    "modes_from_sources",
    "write_file",
]

# The repository keeps an empty hub_stage/ in git through this file; it is not stage content.
_GITKEEP = ".gitkeep"


def _why_not_replaceable(stage: Path) -> str | None:
    """``None`` if ``stage`` may be replaced: an earlier stage carrying a valid marker
    (:func:`~pipeline.audit.stage_marker_problem`), or an empty folder / the repository's
    placeholder. A mistyped --stage must never delete someone's folder."""
    if stage.is_symlink() or (stage.exists() and not stage.is_dir()):
        return "it is not a folder"
    if not stage.is_dir() or not {entry.name for entry in stage.iterdir()} - {_GITKEEP}:
        return None
    return stage_marker_problem(stage)


def built_by_us(stage: Path) -> bool:
    return _why_not_replaceable(stage) is None


def check_replaceable(stage: Path) -> None:
    problem = _why_not_replaceable(stage) if os.path.lexists(stage) else None
    if problem is not None:
        raise StageError(
            f"{stage} exists and was not built by scripts/05_stage.py ({problem}); refusing to "
            "replace it, nothing was touched: move it away or pass another --stage"
        )


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    with HashingWriter(path) as out:
        out.write(data)
    return {"sha256": out.sha256, "size": out.size}


def manifest_bytes(files: Mapping[str, Mapping[str, Any]]) -> bytes:
    return "".join(f"{files[name]['sha256']}  {name}\n" for name in sorted(files)).encode("utf-8")


def check_file_sizes(built: Path) -> None:
    """No staged file above the Hub's per-file maximum (the weights were planned below it)."""
    for path in sorted(built.rglob("*")):
        if path.is_file() and path.stat().st_size > HUB_MAX_FILE_SIZE:
            raise StageError(
                f"{path.relative_to(built)} is {path.stat().st_size:,} bytes, above the Hub's per-file "
                f"maximum of {HUB_MAX_FILE_SIZE:,} bytes; nothing was staged"
            )


def build_privately(built: Path) -> int:
    """Make ``built``, the folder a stage is being built in, its owner's alone (0700) and
    return the mode it had (the umask's), which :func:`modes_from_sources` gives back."""
    mode = stat.S_IMODE(os.stat(built).st_mode)
    os.chmod(built, 0o700)
    return mode


def modes_from_sources(built: Path, mode: int, sources: Mapping[str, int]) -> None:
    """Once ``built`` is complete: each staged file named in ``sources`` (staged name -> the
    permission bits of the file it was made from) loses every permission its source lacks;
    then the folder gets ``mode`` back."""
    for name, allowed in sources.items():
        path = built / name
        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & allowed)
    os.chmod(built, mode)

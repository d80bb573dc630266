"""Prepared data: script 01 writes files into ``data.dir`` with a SHA-256 manifest; training
and evaluation read them only after checking every file against it."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from ..config import Config
from ..durable import atomic_folder, json_bytes, recover
from ..errors import DataError
from ..factories import resolve
from ..hashing import fingerprint_table, sha256_file
from ..layout import DATA_MANIFEST_FILE

__all__ = ["prepare_data", "load_manifest", "load_task_data"]


def _files_table(folder: Path) -> dict[str, dict[str, Any]]:
    # Another data set prepared inside this folder (data/charlm/ in data/: a subfolder with
    # its own manifest) or being prepared there (.tmp-*) is not part of this one.
    nested = {path.parent for path in folder.rglob(DATA_MANIFEST_FILE) if path.parent != folder}
    return {
        path.relative_to(folder).as_posix(): {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(folder.rglob("*"))
        if path.is_file()
        and path.name != DATA_MANIFEST_FILE
        and not path.relative_to(folder).parts[0].startswith(".tmp-")
        and nested.isdisjoint(path.parents)
    }


def _is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def _check_target(target: Path) -> None:
    """Say exactly what is in the way of ``data.dir``: only an empty folder, or data that
    script 01 prepared there (it holds manifest.json), is ever used; nothing else is touched."""
    if not os.path.lexists(target) or _is_empty_folder(target):
        return
    hint = "move it away or point data.dir elsewhere (--set data.dir=PATH)"
    if target.is_symlink() or not target.is_dir():
        raise DataError(f"data.dir {target} exists and is not a folder: {hint}")
    if not (target / DATA_MANIFEST_FILE).is_file():
        names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in target.iterdir())
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise DataError(
            f"data.dir {target}/ already holds {shown} but no {DATA_MANIFEST_FILE}, so it is not "
            f"data prepared by scripts/01_prepare_data.py; nothing was touched: {hint}"
        )


def prepare_data(config: Config) -> tuple[Path, dict[str, Any], bool]:
    """Run ``data.prepare`` into a temporary folder, fingerprint it, and move it into place.

    Returns ``(folder, manifest, changed)``. Existing data with the same fingerprint is kept
    as is; different existing data is never overwritten (checkpoints depend on it); a folder
    that is neither empty nor prepared data is refused, naming what it holds.
    """
    prepare = resolve(config.data.prepare, "data.prepare")
    target = Path(config.data.dir)
    _check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)  # what a crashed earlier run left beside data.dir (only our .tmp-/.old- names)
    existing = None
    try:
        with atomic_folder(target, owned=_is_empty_folder) as staging:
            prepare(config, staging)
            files = _files_table(staging)
            if not files:
                raise DataError(f"{config.data.prepare} wrote no files")
            manifest = {
                "schema": "pipeline.data/1",
                "prepare": config.data.prepare,
                "seed": config.data.seed,
                "params": config.data.params,
                "files": files,
                "fingerprint": fingerprint_table(files),
            }
            if target.exists() and not _is_empty_folder(target):
                existing = load_manifest(config)
                if existing["fingerprint"] != manifest["fingerprint"]:
                    raise DataError(
                        f"{target}/ already holds different data (fingerprint "
                        f"{existing['fingerprint'][:12]}, new {manifest['fingerprint'][:12]}); "
                        "move it away or set data.dir to prepare the new data"
                    )
            else:
                # The manifest marks a folder this pipeline built (atomic_folder fsyncs it).
                (staging / DATA_MANIFEST_FILE).write_bytes(json_bytes(manifest))
    except FileExistsError:
        if existing is None:
            raise
        # Same data already in place: atomic_folder refused to replace it, as it should.
        return target, existing, False
    return target, manifest, True


def load_manifest(config: Config, *, verify: bool = True) -> dict[str, Any]:
    """Read ``data/manifest.json`` and (by default) check every file against it."""
    folder = Path(config.data.dir)
    path = folder / DATA_MANIFEST_FILE
    if not path.is_file():
        prepare = shlex.join(["scripts/01_prepare_data.py", *config.command_args])  # this config, as given
        raise DataError(f"no prepared data in {folder}/: run {prepare} first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        fingerprint = manifest["fingerprint"]
    except (ValueError, KeyError, TypeError):
        raise DataError(
            f"{path} is damaged: rerun scripts/01_prepare_data.py into an empty data.dir"
        ) from None
    if verify:
        actual = _files_table(folder)
        if set(actual) != set(files):
            extra = sorted(set(actual) ^ set(files))
            raise DataError(f"{folder}/ does not match its manifest (file {extra[0]} added or missing)")
        for name, entry in files.items():
            if actual[name] != entry:
                raise DataError(
                    f"{folder}/{name} changed since it was prepared (SHA-256 differs): "
                    "restore it or prepare the data again into an empty data.dir"
                )
        if fingerprint_table(files) != fingerprint:
            raise DataError(f"{path} fingerprint does not match its file table")
    return manifest


def load_task_data(config: Config) -> Any:
    """Build the task data with ``data.factory`` from the verified data folder."""
    factory = resolve(config.data.factory, "data.factory")
    return factory(config, Path(config.data.dir))

"""Prepared data: script 01 writes files into ``data.dir`` with a SHA-256 manifest; training
and evaluation read them only after checking every file against it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..commands import script_command
from ..config import Config
from ..durable import atomic_folder, json_bytes, json_loads_strict, recover
from ..errors import DataError, shown
from ..factories import resolve
from ..hashing import fingerprint_table, sha256_bytes, sha256_file
from ..layout import DATA_MANIFEST_FILE
from ..safe_read import read_own

_log = logging.getLogger(__name__)

__all__ = ["MANIFEST_SCHEMA", "prepare_data", "load_manifest", "load_task_data"]

MANIFEST_SCHEMA = "pipeline.data/1"
# Above any real table (a million files take about 150 MB); parsed, it takes several times that.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
# How a refusal names a recipe value a manifest does not record, or a config does not set.
_NOT_THERE = ("(not recorded)", "(not set)")
# The most characters a refusal shows of one value or key read from a manifest.
_SHOWN_AT_MOST = 200


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
    # A FIFO or a link there is not "no manifest": _read_manifest says what it is.
    if not os.path.lexists(target / DATA_MANIFEST_FILE):
        names = sorted(shown(entry.name) + ("/" if entry.is_dir() else "") for entry in target.iterdir())
        listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise DataError(
            f"data.dir {target}/ already holds {listed} but no {DATA_MANIFEST_FILE}, so it is not "
            f"data prepared by scripts/01_prepare_data.py; nothing was touched: {hint}"
        )


def _recipe(config: Config) -> dict[str, Any]:
    """What decides the data's content, as the manifest records it (plain JSON values)."""
    return json.loads(
        json.dumps({"prepare": config.data.prepare, "seed": config.data.seed, "params": config.data.params})
    )


def _recipe_difference(manifest: dict[str, Any], config: Config) -> tuple[str, Any, Any] | None:
    """The first key of ``data`` whose value the prepared data was made with differs from the
    config's: ``(key, there, here)``, a params entry named by its own key; else ``None``."""
    missing = _NOT_THERE[0]
    for key, here in _recipe(config).items():
        there = manifest.get(key, missing)
        if there == here:
            continue
        if key == "params" and isinstance(there, dict):
            for name in sorted(set(there) | set(here), key=str):
                if there.get(name, missing) != here.get(name, missing):
                    key_shown = f"data.params.{_cut(shown(name))}"
                    return key_shown, there.get(name, missing), here.get(name, _NOT_THERE[1])
        return f"data.{key}", there, here
    return None


def _own_folder_command(config: Config) -> tuple[str, str]:
    """Script 01 on this config into a folder of its own beside ``data.dir`` (named by the
    recipe, so each recipe gets one), and the ``--set`` that points the other scripts at it."""
    folder = f"{str(config.data.dir).rstrip('/')}-{sha256_bytes(json.dumps(_recipe(config), sort_keys=True).encode())[:8]}"
    return script_command(
        config, "01_prepare_data.py", "--set", f"data.dir={folder}"
    ), f"--set data.dir={folder}"


def _show(value: Any) -> str:
    """A recorded or configured value as a refusal shows it: JSON (so control characters are
    escaped), or the words for a value not there, cut to a line's worth: a manifest is data
    someone may have written."""
    return _cut(value if value in _NOT_THERE else json.dumps(value))


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN_AT_MOST else f"{text[:_SHOWN_AT_MOST]}... ({len(text):,} characters)"


def prepare_data(config: Config) -> tuple[Path, dict[str, Any], bool]:
    """Run ``data.prepare`` into a temporary folder, fingerprint it, and move it into place.

    Returns ``(folder, manifest, changed)``. Existing data prepared with the same recipe
    (``data.prepare``, ``data.seed``, ``data.params``) is kept as is, even when a
    non-deterministic ``data.prepare`` now writes other bytes (a warning says so: checkpoints
    depend on the data in place); data prepared with another recipe is never touched, and
    the refusal gives the command that prepares this one into a folder of its own; a folder
    that is neither empty nor prepared data is refused, naming what it holds.
    """
    prepare = resolve(config.data.prepare, "data.prepare")
    target = Path(config.data.dir)
    _check_target(target)
    existing = _read_manifest(target, config)
    if existing is not None:
        difference = _recipe_difference(existing, config)
        if difference is not None:
            key, there, here = difference
            command, point = _own_folder_command(config)
            raise DataError(
                f"{target}/ holds data prepared with {key} {_show(there)}, this config has {_show(here)}; "
                f"nothing was touched (checkpoints may be trained on it): prepare this config's data into a "
                f"folder of its own with {command}, and give {point} to the other scripts too"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)  # what a crashed earlier run left beside data.dir (only our .tmp-/.old- names)
    try:
        with atomic_folder(target, owned=_is_empty_folder) as staging:
            prepare(config, staging)
            files = _files_table(staging)
            if not files:
                raise DataError(f"{config.data.prepare} wrote no files")
            manifest = {
                "schema": MANIFEST_SCHEMA,
                **_recipe(config),
                "files": files,
                "fingerprint": fingerprint_table(files),
            }
            if existing is not None:
                _verify_files(target, existing)
                if existing["fingerprint"] != manifest["fingerprint"]:
                    _log.warning(
                        "warning: %s wrote other bytes than the data already in %s/ for this same config "
                        "(fingerprint %s, in place %s): it is not deterministic (a tokenizer trained on "
                        "several threads? an unseeded draw?). The data in place is kept and verifies: "
                        "checkpoints are trained on it",
                        config.data.prepare,
                        target,
                        manifest["fingerprint"][:12],
                        existing["fingerprint"][:12],
                    )
            else:
                # The manifest marks a folder this pipeline built (atomic_folder fsyncs it).
                (staging / DATA_MANIFEST_FILE).write_bytes(json_bytes(manifest))
    except FileExistsError:
        if existing is None:
            raise
        # Data of this recipe already in place: atomic_folder refused to replace it, as it should.
        return target, existing, False
    return target, manifest, True


def _read_manifest(folder: Path, config: Config) -> dict[str, Any] | None:
    """``folder/manifest.json``, parsed, with the fields every check uses, or ``None`` when
    there is none; a damaged one names the prepare step of ``config`` to run again. Opened once
    (:func:`~pipeline.safe_read.read_own`): a FIFO there would hang the reader, a link would
    make another file the data's record."""
    path = folder / DATA_MANIFEST_FILE
    prepare = script_command(config, "01_prepare_data.py")
    rerun = f"move {folder}/ aside (nothing in it is deleted) and rerun {prepare}"
    try:
        raw = read_own(path, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError as what:
        raise DataError(f"{path} {what}: not the manifest script 01 writes; {rerun}") from None
    try:
        manifest = json_loads_strict(raw)
        if not isinstance(manifest, dict) or not isinstance(manifest["files"], dict):
            raise TypeError
        manifest["fingerprint"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{path} is damaged: {rerun}") from None
    return manifest


def _verify_files(folder: Path, manifest: dict[str, Any]) -> None:
    files = manifest["files"]
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
    if fingerprint_table(files) != manifest["fingerprint"]:
        raise DataError(f"{folder / DATA_MANIFEST_FILE} fingerprint does not match its file table")


def load_manifest(config: Config, *, trained: str | None = None) -> dict[str, Any]:
    """Read ``data/manifest.json``, refuse data prepared with another recipe than the config's
    (``data.prepare``, ``data.seed``, ``data.params``), and check every file
    against the manifest. ``trained``: the checkpoint whose own config ``config`` is (04, 05),
    named by the refusal."""
    folder = Path(config.data.dir)
    manifest = _read_manifest(folder, config)
    if manifest is None:
        _check_target(folder)  # a file, or a folder of something else: 01 would refuse it too
        raise DataError(
            f"no prepared data in {folder}/: run {script_command(config, '01_prepare_data.py')} first"
        )
    difference = _recipe_difference(manifest, config)
    if difference is not None and trained is not None:
        key, there, here = difference
        raise DataError(
            f"{folder}/ holds data prepared with {key} {_show(there)}, but {trained} was trained on data "
            f"prepared with {_show(here)}: point data.dir at the data it was trained on"
        )
    if difference is not None:
        key, there, here = difference
        command, point = _own_folder_command(config)
        raise DataError(
            f"{folder}/ holds data prepared with {key} {_show(there)}, but this config has {_show(here)}: "
            f"prepare this config's data into a folder of its own with {command}, then add {point} here "
            "(the data in place stays: checkpoints may be trained on it)"
        )
    _verify_files(folder, manifest)
    return manifest


def load_task_data(config: Config) -> Any:
    """Build the task data with ``data.factory`` from the verified data folder."""
    factory = resolve(config.data.factory, "data.factory")
    return factory(config, Path(config.data.dir))

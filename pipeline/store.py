"""Local checkpoint store: atomic, hashed, rolling step folders under ``estados_local/``.

Layout of one checkpoint::

    estados_local/step-00000010/
        modelo.safetensors         model weights only (the publishable artifact)
        estado_treino.safetensors  optimizer, RNG and other training-state tensors
        meta.json                  schema, step, config, fingerprints, JSON state, file hashes

A save writes into ``.tmp-step-…`` (every file fsynced, ``meta.json`` last), renames the
folder into place and fsyncs the parent. Only folders named by :func:`step_dir_name` and
holding ``meta.json`` count as checkpoints; "latest" is the highest integer step. Old
checkpoints are pruned only after the new one is committed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from .errors import (
    ChecksumMismatch,
    CheckpointError,
    CheckpointLocked,
    NoCheckpoint,
    SchemaMismatch,
)
from .durable import fsync_dir, json_bytes
from .hashing import HashingWriter, sha256_file
from .layout import META_FILE, MODEL_FILE, STATE_FILE
from .serialization import write_safetensors

__all__ = [
    "SCHEMA_VERSION",
    "MODEL_FILE",
    "STATE_FILE",
    "META_FILE",
    "META_KEYS",
    "MAX_META_BYTES",
    "step_dir_name",
    "parse_step_dir",
    "CheckpointStore",
    "read_meta",
    "verify_checkpoint",
    "check_listing",
    "resolve_checkpoint",
]

SCHEMA_VERSION = "pipeline.checkpoint/1"
CHECKPOINT_FILES = (MODEL_FILE, STATE_FILE)
META_KEYS = frozenset(
    {"schema", "step", "created", "config", "fingerprints", "versions", "device", "model", "training_state", "files"}
)
# meta.json is parsed before anything is trusted; a bound keeps a hostile file from
# exhausting memory.
MAX_META_BYTES = 64 * 1024 * 1024

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TEMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".deleting-"
_LOCK_NAME = ".lock"


def step_dir_name(step: int) -> str:
    """``10 -> "step-00000010"``; zero-padded so listings sort, but parsed as integers."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """Inverse of :func:`step_dir_name`; ``None`` for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    step: int
    path: Path
    files: dict[str, dict[str, Any]]


class CheckpointStore:
    """Owns one checkpoint folder. Use as a context manager to hold its lock while writing."""

    def __init__(self, root: str | Path, *, keep_last: int = 1) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self._lock_fd: int | None = None

    # -- locking -------------------------------------------------------------------------
    def __enter__(self) -> "CheckpointStore":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take an exclusive ``flock`` so two trainers never write one folder. The kernel
        drops it when the process dies, even by SIGKILL, so there are no stale locks."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise CheckpointLocked(f"{self.root}/ is in use by another trainer (pid {holder}); wait for it "
                                       "to finish or use another --checkpoint-dir") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- listing -------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps of committed checkpoints, ascending as integers."""
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            step = parse_step_dir(entry.name)
            if step is not None and (entry / META_FILE).is_file():
                steps.append(step)
        return sorted(steps)

    def path_for(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def clean_stale(self) -> list[Path]:
        """Remove temporary and half-deleted folders left by a crash. Requires the lock."""
        assert self._lock_fd is not None, "clean_stale needs the store's lock"
        removed = []
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry.is_dir() and entry.name.startswith((_TEMP_PREFIX, _TRASH_PREFIX)):
                    shutil.rmtree(entry)
                    removed.append(entry)
        if removed:
            fsync_dir(self.root)
        return removed

    # -- saving --------------------------------------------------------------------------
    def save(self, step: int, model_tensors: Mapping[str, torch.Tensor], state_tensors: Mapping[str, torch.Tensor],
             meta: Mapping[str, Any]) -> SavedCheckpoint:
        """Write one checkpoint atomically, then prune. Requires the lock."""
        assert self._lock_fd is not None, "save needs the store's lock"
        final = self.path_for(step)
        if final.exists():
            raise CheckpointError(f"{final} already exists; refusing to overwrite a committed checkpoint")
        temporary = self.root / f"{_TEMP_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
        temporary.mkdir()
        try:
            files: dict[str, dict[str, Any]] = {}
            for name, tensors in ((MODEL_FILE, model_tensors), (STATE_FILE, state_tensors)):
                sha256, size = write_safetensors(temporary / name, tensors, metadata={"format": "pt", "step": str(step)})
                files[name] = {"sha256": sha256, "size": size}
            record = {**meta, "schema": SCHEMA_VERSION, "step": step, "files": files}
            assert set(record) == META_KEYS, f"meta keys differ: {sorted(set(record) ^ META_KEYS)}"
            # meta.json last: its presence marks a complete folder.
            with HashingWriter(temporary / META_FILE) as out:
                out.write(json_bytes(record))
            fsync_dir(temporary)
            os.rename(temporary, final)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        fsync_dir(self.root)
        self.prune()
        return SavedCheckpoint(step=step, path=final, files=files)

    def prune(self) -> list[int]:
        """Delete all but the newest ``keep_last`` committed checkpoints, oldest first.

        Each victim is first renamed out of the step namespace (atomic), so a crash while
        deleting never leaves a half-deleted folder that looks like a checkpoint.
        """
        steps = self.committed_steps()
        victims = steps[:-self.keep_last] if len(steps) > self.keep_last else []
        for step in victims:
            doomed = self.root / f"{_TRASH_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
            os.rename(self.path_for(step), doomed)
            fsync_dir(self.root)
            shutil.rmtree(doomed)
        return victims


def read_meta(folder: Path) -> dict[str, Any]:
    """Parse and schema-check ``meta.json`` without touching the other files."""
    path = folder / META_FILE
    if not path.is_file():
        raise SchemaMismatch(f"{path} is missing: not a committed checkpoint")
    size = path.stat().st_size
    if size > MAX_META_BYTES:
        raise SchemaMismatch(f"{path} is {size} bytes, over the {MAX_META_BYTES}-byte limit for meta.json")
    try:
        meta = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaMismatch(f"{path} is not valid JSON ({exc.__class__.__name__}): the file is damaged") from None
    if not isinstance(meta, dict):
        raise SchemaMismatch(f"{path} is not a JSON object: the file is damaged")
    schema = meta.get("schema")
    if schema != SCHEMA_VERSION:
        raise SchemaMismatch(f"{path} has schema {schema!r}, this version reads {SCHEMA_VERSION!r}: "
                             "the checkpoint comes from another tool or version and is not loaded")
    if set(meta) != META_KEYS:
        odd = sorted(set(meta) ^ META_KEYS)
        raise SchemaMismatch(f"{path} has unexpected or missing fields ({', '.join(odd)}): the file is damaged")
    files = meta["files"]
    if not isinstance(files, dict) or set(files) != set(CHECKPOINT_FILES) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
            for e in files.values()):
        raise SchemaMismatch(f"{path} has a malformed files table: the file is damaged")
    if not isinstance(meta["step"], int) or parse_step_dir(folder.name) != meta["step"]:
        raise SchemaMismatch(f"{path} records step {meta['step']!r} but the folder is {folder.name}")
    return meta


def verify_checkpoint(folder: str | Path) -> dict[str, Any]:
    """Check ``meta.json`` and every file's size and SHA-256 before anything is used.

    Returns the parsed meta. Raises :class:`ChecksumMismatch` or :class:`SchemaMismatch`
    naming the file; nothing is modified or deleted.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NoCheckpoint(f"{folder} is not a checkpoint folder")
    if parse_step_dir(folder.name) is None:
        # Temporary (.tmp-…) and half-deleted (.deleting-…) folders never count.
        raise NoCheckpoint(f"{folder} is not a committed checkpoint (expected a folder named like "
                           f"{step_dir_name(10)})")
    meta = read_meta(folder)
    check_listing(folder, meta)
    for name, entry in sorted(meta["files"].items()):
        if sha256_file(folder / name) != entry["sha256"]:
            raise ChecksumMismatch(f"{folder / name} SHA-256 differs from meta.json: the file is damaged or was "
                                   "modified")
    return meta


def check_listing(folder: Path, meta: dict[str, Any]) -> None:
    """The checks short of hashing: no stray file, none missing, every size right (cheap,
    and catches truncation before a long hash)."""
    unexpected = sorted({p.name for p in folder.iterdir()} - set(meta["files"]) - {META_FILE})
    if unexpected:
        raise ChecksumMismatch(f"{folder / unexpected[0]} is not listed in meta.json: the folder was modified")
    for name, entry in sorted(meta["files"].items()):
        path = folder / name
        if not path.is_file():
            raise ChecksumMismatch(f"{path} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ChecksumMismatch(f"{path} is {size} bytes, meta.json records {entry['size']}: "
                                   "the file is truncated or was modified")


def resolve_checkpoint(spec: str | Path, root: str | Path) -> tuple[Path, dict[str, Any]]:
    """Turn ``"latest"`` or a folder path into a verified (folder, meta).

    ``latest`` is the highest committed step. If it fails verification and an older one
    verifies, refuse and name the older one: silently resuming from older state would
    repeat work the user believes was saved.
    """
    if str(spec) != "latest":
        folder = Path(spec)
        return folder, verify_checkpoint(folder)
    store = CheckpointStore(root)
    steps = store.committed_steps()
    if not steps:
        raise NoCheckpoint(f"no committed checkpoint in {Path(root)}/: train first with scripts/02_train.py, "
                           "or point --checkpoint-dir at the folder that holds them")
    newest = store.path_for(steps[-1])
    try:
        return newest, verify_checkpoint(newest)
    except CheckpointError as damage:
        for step in reversed(steps[:-1]):
            older = store.path_for(step)
            try:
                verify_checkpoint(older)
            except CheckpointError:
                continue
            raise CheckpointError(f"{damage} The older checkpoint {older} verifies: resume from it with "
                                  f"--resume {older} (nothing was deleted).") from None
        raise

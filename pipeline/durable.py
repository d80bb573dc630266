"""Durable writes: fsync a folder after a rename, and replace a JSON file atomically."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from .hashing import HashingWriter

__all__ = ["fsync_dir", "json_bytes", "write_json_atomic"]


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_bytes(payload: Any) -> bytes:
    return (json.dumps(payload, indent=1, sort_keys=True, allow_nan=True) + "\n").encode("utf-8")


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON beside ``path``, fsync, rename over it, fsync the folder."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with HashingWriter(temporary) as out:
            out.write(json_bytes(payload))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(path.parent)

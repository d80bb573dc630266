"""SHA-256 fingerprints: files, byte streams hashed while written, and source trees."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Iterable

from .errors import naming

__all__ = ["sha256_file", "sha256_bytes", "HashingWriter", "fingerprint_files", "fingerprint_table"]

CHUNK = 8 * 1024 * 1024


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, *, chunk: int = CHUNK) -> str:
    """Stream a file through SHA-256 without holding it in memory."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


class HashingWriter:
    """Write to a new file, hashing the bytes as they pass, then fsync on close.

    The SHA-256 recorded in meta.json is therefore of the bytes we wrote, not of a later
    read-back that the page cache could satisfy from stale memory.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # "xb": never overwrite; the caller writes into a fresh temporary folder.
        self._handle: BinaryIO = open(self.path, "xb")
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        with naming(self.path):  # a full disk fails the write: say which file
            written = self._handle.write(view)
        self.size += len(view)
        return written

    def close(self) -> None:
        if self._handle.closed:
            return
        with naming(self.path):
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()

    def abort(self) -> None:
        try:
            self._handle.close()
        except OSError:
            pass  # the flush of what is buffered failed too: the error being raised says why

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def __enter__(self) -> "HashingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def fingerprint_files(paths: Iterable[str | Path], *, root: str | Path | None = None) -> str:
    """One SHA-256 over (relative path, content) of many files, independent of order given."""
    root = Path(root) if root is not None else None
    table = {}
    for path in paths:
        path = Path(path)
        name = path.relative_to(root).as_posix() if root is not None else path.as_posix()
        table[name] = {"sha256": sha256_file(path)}
    return fingerprint_table(table)


def fingerprint_table(files: dict[str, dict]) -> str:
    """One SHA-256 over ``{name: {"sha256": ...}}``: names and contents, not order or mtimes."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name]["sha256"].encode() + b"\n")
    return digest.hexdigest()

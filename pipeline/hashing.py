"""SHA-256 fingerprints: files, byte streams hashed while written (whole, or by fixed-size
chunks), and source trees."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Iterable

from .errors import naming

__all__ = [
    "MIN_CHUNK_SIZE",
    "MAX_CHUNK_SIZE",
    "chunk_size_for",
    "ChunkDigests",
    "sha256_file",
    "sha256_bytes",
    "HashingWriter",
    "fingerprint_files",
    "fingerprint_table",
]

CHUNK = 8 * 1024 * 1024
# Bytes per chunk digest of a checkpoint's file (docs/format.md, "Why chunk digests"): the
# smallest power of two from MIN_CHUNK_SIZE to MAX_CHUNK_SIZE that cuts the file into at most
# CHUNKS_PER_FILE chunks. Small chunks spread even a file of a few MiB over every core of a load, and let a
# rank that needs a few bytes of another rank's shard (its header, a step count) hash little
# more than those; large ones keep the table small for large files (16 digests per GiB), and
# a digest's fixed cost vanishes at either end.
MIN_CHUNK_SIZE = 4 * 1024 * 1024
MAX_CHUNK_SIZE = 64 * 1024 * 1024
CHUNKS_PER_FILE = 64


def chunk_size_for(size: int) -> int:
    """The chunk size a save records for a file of ``size`` bytes (readers take any)."""
    chunk_size = MIN_CHUNK_SIZE
    while chunk_size < MAX_CHUNK_SIZE and chunk_size * CHUNKS_PER_FILE < size:
        chunk_size *= 2
    return chunk_size


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


class ChunkDigests:
    """SHA-256 of each ``chunk_size`` piece of a byte stream fed in order, in pieces of any
    size: piece k covers bytes [k * chunk_size, (k + 1) * chunk_size), the last one shorter."""

    def __init__(self, chunk_size: int) -> None:
        if type(chunk_size) is not int or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self._done: list[str] = []
        self._current = hashlib.sha256()
        self._filled = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), self.chunk_size - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_size:
                self._done.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def hexdigests(self) -> list[str]:
        return self._done + ([self._current.hexdigest()] if self._filled else [])


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

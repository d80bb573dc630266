"""Count the bytes a process reads from each file under a folder, and rewrite a file the
moment the process has read all of it (test-owned).

:class:`ReadRecorder` replaces ``os.open``, ``open``, ``os.pread``, ``os.preadv``,
``mmap.mmap`` and ``os.close`` in the running process with wrappers that note, per file
under ``root``, how many bytes were read through a descriptor of it (a map counts as its
whole length read: its pages are the file's). Nothing in ``pipeline/`` knows about it: the real code
runs, its reads are seen from outside, as the kernel sees them (no FUSE needed).

``rewrite``: once every byte of a file whose path starts with one of ``only`` was read,
every byte of its last 8 is flipped on disk (the size unchanged), as a writer racing the
reader would: a reader that uses bytes other than those it read and hashed then uses the
rewritten ones. ``restore``: ``{relative path: bytes}``: once a file's header (its 8-byte
length and the JSON after it) was read, the file is written back to those bytes, as a
writer that swapped in a file and back would.
"""

from __future__ import annotations

import builtins
import mmap
import os
from pathlib import Path
from typing import Any

__all__ = ["ReadRecorder"]


class ReadRecorder:
    """Install while the block runs (a context manager); ``read``: ``{relative path: bytes}``,
    ``rewritten``: the relative paths flipped (``rewrite``)."""

    def __init__(
        self,
        root: str | Path,
        *,
        rewrite: bool = False,
        only: tuple[str, ...] = ("",),
        restore: dict[str, bytes] | None = None,
    ) -> None:
        self.root = os.path.abspath(root)
        self.rewrite = rewrite
        self.only = only
        self.restore = dict(restore or {})
        self.read: dict[str, int] = {}
        self.rewritten: list[str] = []
        self._fds: dict[int, str] = {}
        self._saved: dict[str, Any] = {}
        self._spans: dict[str, list[tuple[int, int]]] = {}
        self._py_open: Any = None
        self._py_mmap: Any = None

    def _ours(self, path: Any) -> str | None:
        try:
            full = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return None
        if full.startswith(self.root + os.sep):
            return os.path.relpath(full, self.root)
        return None

    def _every_byte_read(self, name: str, offset: int, got: int, size: int) -> bool:
        """Note bytes ``offset:offset+got`` of ``name`` read; whether all ``size`` now were."""
        spans = sorted([*self._spans.get(name, []), (offset, offset + got)])
        merged = [spans[0]]
        for start, end in spans[1:]:
            if start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self._spans[name] = merged
        return merged[0][0] == 0 and merged[0][1] >= size

    def _count(self, fd: int, got: int, offset: int) -> None:
        name = self._fds.get(fd)
        if name is None or got <= 0:
            return
        self.read[name] = self.read.get(name, 0) + got
        full = os.path.join(self.root, name)
        original = self.restore.get(name)
        if original is not None and self.read[name] >= 8 + int.from_bytes(original[:8], "little"):
            del self.restore[name]
            with open(full, "r+b") as handle:
                handle.write(original)
        if (
            self.rewrite
            and name.startswith(self.only)
            and name not in self.rewritten
            and self._every_byte_read(name, offset, got, os.stat(full).st_size)
        ):
            self.rewritten.append(name)
            with open(full, "r+b") as handle:
                handle.seek(-8, os.SEEK_END)
                tail = handle.read(8)
                handle.seek(-8, os.SEEK_END)
                handle.write(bytes(b ^ 0xFF for b in tail))

    def __enter__(self) -> "ReadRecorder":
        real = self._saved = {name: getattr(os, name) for name in ("open", "pread", "preadv", "close")}
        py_open, py_mmap = self._py_open, self._py_mmap = builtins.open, mmap.mmap

        def note(fd: int, path: Any, reading: bool) -> None:
            name = self._ours(path) if reading else None
            if name is None:
                self._fds.pop(fd, None)  # a descriptor number reused
            else:
                self._fds[fd] = name

        def os_open(path, flags, *args, **kwargs):
            fd = real["open"](path, flags, *args, **kwargs)
            note(fd, path, not flags & (os.O_WRONLY | os.O_RDWR))
            return fd

        def builtin_open(file, mode="r", *args, **kwargs):
            handle = py_open(file, mode, *args, **kwargs)
            if not isinstance(file, int):
                note(handle.fileno(), file, not set(mode) & set("wax+"))
            return handle

        recorder = self

        class Mapped(py_mmap):  # a type still, for the isinstance checks of the code under test
            def __new__(cls, fileno, length, *args, **kwargs):
                buffer = super().__new__(cls, fileno, length, *args, **kwargs)
                recorder._count(fileno, len(buffer), 0)
                return buffer

        def pread(fd, count, offset):
            data = real["pread"](fd, count, offset)
            self._count(fd, len(data), offset)
            return data

        def preadv(fd, buffers, offset, *args):
            got = real["preadv"](fd, buffers, offset, *args)
            self._count(fd, got, offset)
            return got

        def close(fd):
            self._fds.pop(fd, None)
            return real["close"](fd)

        os.open, os.pread, os.preadv, os.close = os_open, pread, preadv, close
        builtins.open, mmap.mmap = builtin_open, Mapped
        return self

    def __exit__(self, *exc: object) -> None:
        for name, call in self._saved.items():
            setattr(os, name, call)
        builtins.open, mmap.mmap = self._py_open, self._py_mmap

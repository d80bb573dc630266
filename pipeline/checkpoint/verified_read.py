"""Verified reading: the hashed bytes are the used bytes.

:func:`read_verified` reads a checkpoint's files into memory of this process (into the
tensors that will be used, such as a resumed model's parameters) and hashes each chunk
there once read, so no later write to a file reaches what was verified; a file only
verified is hashed on the page cache's pages. The format and the order of a load's checks:
docs/format.md, "How a load is verified".
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from .tensorfile import _DTYPES, _HASH_CHUNK, _MAX_HEADER, parse_header

__all__ = ["read_verified"]

# Bytes per read of read_verified: small, so that a file's hasher follows its reader closely.
_READ_CHUNK = 2 * 1024 * 1024


class _Hashing(threading.Thread):
    """SHA-256 of the chunks handed to it, in order, as a reader finishes them (``None`` ends)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=f"sha256-{name}", daemon=True)
        self.chunks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.digest = hashlib.sha256()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while (chunk := self.chunks.get()) is not None:
                self.digest.update(chunk)
        except BaseException as exc:  # raised by read_verified, in the calling thread
            self.error = exc


class _FileRead:
    """One file being read into this process's memory: its header, read and parsed from the
    same bytes, and every tensor's destination with the (view, file offset) chunks to fill."""

    def __init__(self, path: Path, destinations: Mapping[str, torch.Tensor] | None) -> None:
        self.path = path
        self.hashing = _Hashing(path.name)
        self.tensors: dict[str, torch.Tensor] = {}
        self.error: ValueError | None = None
        self.digest: Any = None  # set here for a malformed file, hashed in this thread
        self.changed = False  # shorter than when listed: damaged (the digest cannot match)
        self.chunks: list[tuple[memoryview, int]] = []
        self.map: mmap.mmap | None = None
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self._plan(destinations)
        except BaseException:
            os.close(self.fd)
            raise

    def _plan(self, destinations: Mapping[str, torch.Tensor] | None) -> None:
        self.size = os.fstat(self.fd).st_size
        first = self._pread(8, 0)
        length = int.from_bytes(first, "little") if len(first) == 8 else 0
        head = first + self._pread(min(length, _MAX_HEADER, max(self.size - 8, 0)), 8)
        try:
            header, data_start = parse_header(head, size=self.size)
        except ValueError as exc:
            # Nothing of a malformed file is used: its hash, then the parser, refuse it.
            self.error, self.digest = exc, hashlib.sha256(head)
            for start in range(len(head), self.size, _READ_CHUNK):
                self.digest.update(self._pread(min(_READ_CHUNK, self.size - start), start))
            return
        self.hashing.chunks.put(head)
        if destinations is None:
            # Hashed only, nothing used: the shared pages, no copy; only the header (read above) is parsed.
            if self.size > len(head):
                self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
                self.map.madvise(mmap.MADV_SEQUENTIAL)
                whole = memoryview(self.map)
                for start in range(len(head), self.size, _HASH_CHUNK):
                    self.hashing.chunks.put(whole[start : start + _HASH_CHUNK])
            return
        for _, name in sorted(
            (entry["data_offsets"][0], name) for name, entry in header.items() if name != "__metadata__"
        ):
            entry = header[name]
            dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
            target = destinations.get(name)
            fits = (
                target is not None
                and target.dtype == dtype
                and list(target.shape) == shape
                and target.device.type == "cpu"
                and target.is_contiguous()
            )
            tensor = target.detach() if fits else torch.empty(shape, dtype=dtype)
            self.tensors[name] = tensor
            begin, end = entry["data_offsets"]
            if begin == end:
                continue
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
            self.chunks += [
                (view[start : start + _READ_CHUNK], data_start + begin + start)
                for start in range(0, end - begin, _READ_CHUNK)
            ]

    def _pread(self, count: int, offset: int) -> bytes:
        data = os.pread(self.fd, count, offset)
        if len(data) < count:
            self.changed = True
        return data

    def read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                self.changed = True
                return
            done += got


def read_verified(
    paths: Mapping[str, Path], destinations: Mapping[str, Mapping[str, torch.Tensor] | None]
) -> dict[str, tuple[str, dict[str, torch.Tensor] | ValueError]]:
    """Hash every file of ``paths``, reading those whose tensors are used into memory of
    this process: ``{name: (sha256, tensors)}``, or ``(sha256, the parser's ValueError)``
    for a file that does not parse (nothing of it is used); the sha256 is empty for a file
    that shrank while read.

    ``destinations[name]``: where the file's tensors go (by tensor name), or ``None`` for a
    file that is only verified (its tensors come back empty: hashed on the page cache's
    pages, no copy). A file read is verified after materialising (module docstring): each
    tensor is read, in file order, into its destination (the tensor of that name if dtype,
    shape, device and layout fit; a fresh tensor otherwise) and hashed there, so the digest
    is the file's, computed over the bytes that will be used, which no later write to the
    file can reach. One thread reads every file, a little of each in turn (``pread``: one
    kernel copy, no page-table work); each file's hasher follows its reader chunk by chunk
    on another core, so a load costs about the read plus the last chunk's hash.
    """
    reads: dict[str, _FileRead] = {}
    try:
        for name, path in paths.items():
            reads[name] = _FileRead(Path(path), destinations.get(name))
        for read in reads.values():
            if read.digest is None:
                read.hashing.start()
        position = {name: 0 for name in reads}
        total = {name: sum(len(view) for view, _ in read.chunks) or 1 for name, read in reads.items()}
        done = dict.fromkeys(reads, 0)
        pending = [name for name in reads if reads[name].chunks]
        while pending:
            # The file least far along next: every hasher keeps working until the end.
            name = min(pending, key=lambda n: done[n] / total[n])
            read = reads[name]
            view, offset = read.chunks[position[name]]
            read.read_into(view, offset)
            read.hashing.chunks.put(view)  # the destination's bytes, once read
            position[name] += 1
            done[name] += len(view)
            if position[name] == len(read.chunks):
                pending.remove(name)
    finally:
        for read in reads.values():
            read.hashing.chunks.put(None)
            if read.hashing.is_alive():
                read.hashing.join()
            os.close(read.fd)
    for read in reads.values():
        if read.hashing.error is not None:
            raise read.hashing.error
    return {
        name: (
            "" if read.changed else (read.digest or read.hashing.digest).hexdigest(),
            read.error if read.error is not None else read.tensors,
        )
        for name, read in reads.items()
    }

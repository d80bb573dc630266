"""Verified reading: the hashed bytes are the used bytes, hashed on every core.

:func:`read_verified` reads a checkpoint's files into memory of this process (into the
tensors that will be used, such as a resumed model's parameters) and hashes each piece
there once read, so no later write to a file reaches what was verified; a file only
verified is hashed on the page cache's pages. A file with a chunk table is hashed chunk
by chunk on a pool of threads (hashlib drops the GIL), so a load costs about
max(read, bytes / (cores x one core's SHA-256 rate)); a file sealed with its whole
digest only is one chunk. The format and the order of a load's checks: docs/format.md,
"How a load is verified" and "Why chunk digests".
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import torch

from ..hashing import ChunkDigests
from .tensorfile import _DTYPES, _HASH_CHUNK, _MAX_HEADER, parse_header

__all__ = ["read_verified"]

# Bytes per read of read_verified: small, so that a chunk's hasher follows its reader closely.
_READ_CHUNK = 2 * 1024 * 1024


def _hash_queue(pieces: queue.SimpleQueue[Any]) -> str:
    """SHA-256 of the pieces handed to ``pieces``, in order, as a reader finishes them (``None`` ends)."""
    digest = hashlib.sha256()
    while (piece := pieces.get()) is not None:
        digest.update(piece)
    return digest.hexdigest()


class _FileRead:
    """One file being read into this process's memory: its header, read and parsed from the
    same bytes, and its pieces in file order, each (view, file offset, whether it must
    be read into the view first), split at chunk boundaries: chunk k is bytes
    [k * chunk_size, (k + 1) * chunk_size), or the whole file when ``chunk_size`` is None."""

    def __init__(self, path: Path, destinations: Mapping[str, torch.Tensor] | None, chunk_size: int | None):
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}
        self.error: ValueError | None = None
        self.digests: list[str] | None = None  # set here for a malformed file, hashed in this thread
        self.changed = False  # shorter than when listed: damaged (the digest cannot match)
        self.pieces: list[tuple[memoryview | bytes, int, bool]] = []
        self.map: mmap.mmap | None = None
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.size = os.fstat(self.fd).st_size
            self.chunk_size = chunk_size if chunk_size is not None else max(self.size, 1)
            self._plan(destinations, chunk_size)
        except BaseException:
            os.close(self.fd)
            raise
        # Per chunk: its queue of pieces and its digest's future, opened at its first piece.
        self.queues: dict[int, queue.SimpleQueue[Any]] = {}
        self.futures: dict[int, Future[str]] = {}

    def _plan(self, destinations: Mapping[str, torch.Tensor] | None, chunk_size: int | None) -> None:
        first = self._pread(8, 0)
        length = int.from_bytes(first, "little") if len(first) == 8 else 0
        head = first + self._pread(min(length, _MAX_HEADER, max(self.size - 8, 0)), 8)
        try:
            header, data_start = parse_header(head, size=self.size)
        except ValueError as exc:
            # Nothing of a malformed file is used: its hash, then the parser, refuse it.
            self.error = exc
            whole, table = hashlib.sha256(head), ChunkDigests(self.chunk_size)
            table.update(head)
            for start in range(len(head), self.size, _READ_CHUNK):
                data = self._pread(min(_READ_CHUNK, self.size - start), start)
                whole.update(data)
                table.update(data)
            self.digests = table.hexdigests() if chunk_size is not None else [whole.hexdigest()]
            return
        self._add(memoryview(head), 0, read=False)
        if destinations is None:
            # Hashed only, nothing used: the shared pages, no copy; only the header (read above) is parsed.
            if self.size > len(head):
                self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
                self.map.madvise(mmap.MADV_SEQUENTIAL)  # each chunk is read front to back, once
                self._add(memoryview(self.map)[len(head) :], len(head), read=False, piece=_HASH_CHUNK)
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
            if begin < end:
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
                self._add(view, data_start + begin, read=True)

    def _add(self, view: memoryview, offset: int, *, read: bool, piece: int = _READ_CHUNK) -> None:
        """Plan ``view`` (the file's bytes from ``offset`` on) in pieces of at most ``piece``
        bytes that never straddle a chunk boundary."""
        done = 0
        while done < len(view):
            at = offset + done
            take = min(piece, len(view) - done, self.chunk_size - at % self.chunk_size)
            self.pieces.append((view[done : done + take], at, read))
            done += take

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

    def hand(self, pool: ThreadPoolExecutor, view: memoryview | bytes, offset: int) -> None:
        """Give a piece (read) to its chunk's hasher; end the chunk at its last byte."""
        chunk = offset // self.chunk_size
        if chunk not in self.queues:
            self.queues[chunk] = queue.SimpleQueue()
            self.futures[chunk] = pool.submit(_hash_queue, self.queues[chunk])
        self.queues[chunk].put(view)
        if offset + len(view) == min((chunk + 1) * self.chunk_size, self.size):
            self.queues[chunk].put(None)

    def close(self) -> None:
        for pieces in self.queues.values():
            pieces.put(None)  # a chunk left open by an error: its hasher ends (a second None is unread)
        os.close(self.fd)  # the map, if any, stays valid until its views are dropped


def read_verified(
    paths: Mapping[str, Path],
    destinations: Mapping[str, Mapping[str, torch.Tensor] | None],
    chunk_sizes: Mapping[str, int | None],
) -> dict[str, tuple[list[str] | None, dict[str, torch.Tensor] | ValueError]]:
    """Hash every file of ``paths``, reading those whose tensors are used into memory of
    this process: ``{name: (chunk digests, tensors)}``, or ``(chunk digests, the parser's
    ValueError)`` for a file that does not parse (nothing of it is used); the digests are
    None for a file that shrank while read.

    ``chunk_sizes[name]``: the file's chunk size (its digests are one per chunk), or None
    for one digest of the whole file. ``destinations[name]``: where the file's tensors go
    (by tensor name), or ``None`` for a file that is only verified (its tensors come back
    empty: hashed on the page cache's pages, no copy). A file read is verified after
    materialising (module docstring): each tensor is read, in file order, into its
    destination (the tensor of that name if dtype, shape, device and layout fit; a fresh
    tensor otherwise) and hashed there, so the digests are over the bytes that will be
    used, which no later write to the file can reach. One thread reads every file, a little
    of each in turn (``pread``: one kernel copy, no page-table work); the chunks' hashers
    follow it on a pool of a thread per core, each chunk hashed as its pieces arrive.
    """
    reads: dict[str, _FileRead] = {}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="sha256") as pool:
        try:
            for name, path in paths.items():
                reads[name] = _FileRead(Path(path), destinations.get(name), chunk_sizes.get(name))
            position = dict.fromkeys(reads, 0)
            total = {name: sum(len(v) for v, _, _ in read.pieces) or 1 for name, read in reads.items()}
            done = dict.fromkeys(reads, 0)
            pending = [name for name in reads if reads[name].pieces]
            while pending:
                # The file least far along next: every hasher keeps working until the end.
                name = min(pending, key=lambda n: done[n] / total[n])
                read = reads[name]
                view, offset, must_read = read.pieces[position[name]]
                if must_read:
                    read.read_into(view, offset)
                read.hand(pool, view, offset)  # the destination's bytes, once read
                position[name] += 1
                done[name] += len(view)
                if position[name] == len(read.pieces):
                    pending.remove(name)
        finally:
            for read in reads.values():
                read.close()
        digests = {
            name: read.digests
            if read.digests is not None
            else [read.futures[k].result() for k in sorted(read.futures)]
            for name, read in reads.items()
        }
    return {
        name: (
            None if read.changed else digests[name],
            read.error if read.error is not None else read.tensors,
        )
        for name, read in reads.items()
    }

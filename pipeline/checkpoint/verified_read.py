"""Verified reading: the hashed bytes are the used bytes, read and hashed on every core.

:func:`read_verified` reads a checkpoint's files into memory of this process (into the
tensors that will be used, such as a resumed model's parameters) and hashes each piece
there once read, so no later write to a file reaches what was verified; a file only
verified is hashed on the page cache's pages. Each chunk of a file (its chunk table's, or
the whole file for one sealed with its whole digest only) is read and hashed by one thread
of a pool of a thread per core (``pread`` and hashlib both drop the GIL), so a load costs
about (read + hash) / cores, not one core's SHA-256 pass over the largest file. The format
and the order of a load's checks: docs/format.md, "How a load is verified" and "Why chunk
digests".
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

import torch

from ..hashing import ChunkDigests
from .tensorfile import _DTYPES, _HASH_CHUNK, _MAX_HEADER, parse_header

__all__ = ["read_verified"]

# Bytes per read of read_verified: small, so that a piece is still in the CPU cache when hashed.
_READ_CHUNK = 2 * 1024 * 1024


def _verify_chunk(read: _FileRead, pieces: list[tuple[memoryview | bytes, int, bool]]) -> str:
    """SHA-256 of one chunk: each piece read into its destination first if it must be, then
    hashed there (the destination's bytes, once read)."""
    digest = hashlib.sha256()
    for view, offset, must_read in pieces:
        if must_read:
            read.read_into(view, offset)
        digest.update(view)
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

    def chunks(self) -> list[list[tuple[memoryview | bytes, int, bool]]]:
        """The planned pieces grouped by chunk, in file order."""
        grouped: dict[int, list[tuple[memoryview | bytes, int, bool]]] = {}
        for piece in self.pieces:
            grouped.setdefault(piece[1] // self.chunk_size, []).append(piece)
        return [grouped[index] for index in sorted(grouped)]


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
    used, which no later write to the file can reach. Each chunk is one task of a pool of a
    thread per core, which reads its pieces (``pread``: one kernel copy, no page-table work)
    and hashes each once read.
    """
    reads: dict[str, _FileRead] = {}
    try:
        for name, path in paths.items():
            reads[name] = _FileRead(Path(path), destinations.get(name), chunk_sizes.get(name))
        chunks = {name: read.chunks() for name, read in reads.items()}
        # The files' chunks in turn (file A's first, file B's first, A's second, ...): the
        # files' reads spread over the pool from the start.
        rounds = max((len(c) for c in chunks.values()), default=0)
        order = [(name, k) for k in range(rounds) for name in chunks if k < len(chunks[name])]
        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="sha256") as pool:
            futures = {
                key: pool.submit(_verify_chunk, reads[key[0]], chunks[key[0]][key[1]]) for key in order
            }
            digests = {
                name: read.digests
                if read.digests is not None
                else [futures[name, k].result() for k in range(len(chunks[name]))]
                for name, read in reads.items()
            }
    finally:
        for read in reads.values():
            os.close(read.fd)  # the map, if any, stays valid until its views are dropped
    return {
        name: (
            None if read.changed else digests[name],
            read.error if read.error is not None else read.tensors,
        )
        for name, read in reads.items()
    }

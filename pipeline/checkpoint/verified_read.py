"""Verified reading: the hashed bytes are the used bytes, read and hashed on every core.

:func:`read_verified` reads a checkpoint's files into memory of this process (into the
tensors that will be used, such as a resumed model's parameters) and hashes each piece
there once read, so no later write to a file reaches what was verified; a file only
verified is hashed on the page cache's pages. :func:`sha256_mapped` hashes files mapped
privately (:func:`~pipeline.checkpoint.tensorfile.map_file`: the reader of a distributed
checkpoint in one process, whose tensors view the maps): the pages of a file whose tensors
will be viewed are made this process's own copy before they are hashed (a private map's
page never written reads the file again, so a later write to the file would otherwise
reach a verified tensor); of any other file only the header's pages are, so the header a
parser then reads from the map is the hashed one. Pages hashed and not used are given
back at once (the OS counts every mapped page touched, and a file may be larger than
memory).

Each chunk of a file (its chunk table's, or the whole file for one sealed with its whole
digest only) is read and hashed by one task of a pool of a thread per core (``pread``,
``madvise`` and hashlib drop the GIL), so a load costs about (read + hash) / cores, not
one core's SHA-256 pass over the largest file. The format and the order of a load's
checks: docs/format.md, "How a load is verified" and "Why chunk digests".
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Callable, Collection, Iterable, Mapping, Sequence, TypeVar

import torch

from ..hashing import ChunkDigests
from ..safetensors_header import MAX_HEADER as _MAX_HEADER
from .tensorfile import _DTYPES, _PAGE, parse_header

__all__ = ["read_verified", "sha256_mapped"]

_T = TypeVar("_T")

# Bytes per read of read_verified, and per page range sha256_mapped owns (copies) or gives
# back: small, so that a piece is still in the CPU cache when hashed, and a map's pages
# hashed but not kept stay a few MiB per thread.
_READ_CHUNK = 2 * 1024 * 1024
# Linux's madvise(MADV_POPULATE_WRITE) (5.14+; Python 3.11 lacks the name): fault the
# pages in as if written, which gives a private map its own copy of them.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def read_and_hash(
    fd: int,
    pieces: Iterable[tuple[memoryview | bytes, int, bool]],
    hashed: Callable[[int, int], None] | None = None,
) -> str | None:
    """SHA-256 of one chunk's pieces, in file order, each ``(view, file offset, whether it
    must be read into the view first)``: read there (``pread``, one kernel copy into the
    memory that will be used) if it must be, then hashed there, while still in the CPU
    cache; ``hashed(offset, count)`` is told after each. None if the file ends before a
    piece is filled (it is shorter than when listed: damaged). The one read-and-hash step of
    every verified read: :func:`read_verified` and a distributed resume's
    (:mod:`.verified_dcp`)."""
    digest = hashlib.sha256()
    for view, offset, must_read in pieces:
        if must_read and not _fill(fd, view, offset):
            return None
        digest.update(view)
        if hashed is not None:
            hashed(offset, len(view))
    return digest.hexdigest()


def _fill(fd: int, view: memoryview | bytes, offset: int) -> bool:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            return False
        done += got
    return True


def _verify_chunk(read: _FileRead, pieces: list[tuple[memoryview | bytes, int, bool]]) -> str:
    digest = read_and_hash(read.fd, pieces, read.hashed)
    if digest is None:
        read.changed = True  # its digests come back None (read_verified)
        return ""
    return digest


class _FileRead:
    """One file being read into this process's memory: its header, read and parsed from the
    same bytes, and its pieces in file order, each (view, file offset, whether it must
    be read into the view first), split at chunk boundaries: chunk k is bytes
    [k * chunk_size, (k + 1) * chunk_size), or the whole file when ``chunk_size`` is None."""

    def __init__(
        self,
        path: Path,
        destinations: Mapping[str, torch.Tensor] | None,
        chunk_size: int | None,
        wanted: Callable[[str], bool] | None = None,
    ):
        self.path = path
        self.wanted = wanted
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
                self._add(self._mapped()[len(head) :], len(head), read=False)
            return
        for _, name in sorted(
            (entry["data_offsets"][0], name) for name, entry in header.items() if name != "__metadata__"
        ):
            entry = header[name]
            if self.wanted is not None and not self.wanted(name):
                begin, end = (data_start + offset for offset in entry["data_offsets"])
                if begin < end:  # hashed where it lies, like a file only verified
                    self._add(self._mapped()[begin:end], begin, read=False)
                continue
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

    def _mapped(self) -> memoryview:
        """The file's shared pages (mapped on first use), for bytes hashed and never used."""
        if self.map is None:
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
            self.map.madvise(mmap.MADV_SEQUENTIAL)  # each chunk is read front to back, once
        return memoryview(self.map)

    def _add(self, view: memoryview, offset: int, *, read: bool) -> None:
        """Plan ``view`` (the file's bytes from ``offset`` on) in pieces of at most
        ``_READ_CHUNK`` bytes that never straddle a chunk boundary."""
        done = 0
        while done < len(view):
            at = offset + done
            take = min(_READ_CHUNK, len(view) - done, self.chunk_size - at % self.chunk_size)
            self.pieces.append((view[done : done + take], at, read))
            done += take

    def _pread(self, count: int, offset: int) -> bytes:
        data = os.pread(self.fd, count, offset)
        if len(data) < count:
            self.changed = True
        return data

    def hashed(self, offset: int, count: int) -> None:
        """Bytes ``offset:offset+count`` were hashed: of a file only verified, the map's pages
        under them are given back (the OS counts every mapped page touched; none is used, and
        one shared with a neighbouring piece is read again if touched)."""
        if self.map is not None:
            first = offset // _PAGE * _PAGE
            self.map.madvise(mmap.MADV_DONTNEED, first, offset + count - first)

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
    *,
    wanted: Mapping[str, Callable[[str], bool]] | None = None,
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
    and hashes each once read. ``wanted[name]``: of a file read, only the tensors whose name
    it accepts are read and handed out (a training state's evaluations, not its optimizer);
    the others are hashed on the page cache's pages, as a file only verified.
    """
    reads: dict[str, _FileRead] = {}
    wanted = wanted or {}
    try:
        for name, path in paths.items():
            reads[name] = _FileRead(
                Path(path), destinations.get(name), chunk_sizes.get(name), wanted.get(name)
            )
        pooled = on_pool(
            {
                name: [partial(_verify_chunk, read, chunk) for chunk in read.chunks()]
                for name, read in reads.items()
            }
        )
    finally:
        for read in reads.values():
            os.close(read.fd)  # the map, if any, stays valid until its views are dropped
    return {
        name: (
            None if read.changed else read.digests if read.digests is not None else pooled[name],
            read.error if read.error is not None else read.tensors,
        )
        for name, read in reads.items()
    }


def sha256_mapped(
    maps: Mapping[str, mmap.mmap | bytes],
    chunk_sizes: Mapping[str, int | None],
    *,
    own: Collection[str] | None = None,
) -> dict[str, list[str]]:
    """The chunk digests of each file mapped privately (``maps``: name -> its
    :func:`~pipeline.checkpoint.tensorfile.map_file`): of each ``chunk_sizes[name]`` bytes,
    or of the whole file for None (or a name not given), each chunk one task of the pool.

    ``own``: the files whose tensors will be viewed (default: all); each piece of their
    pages is made this process's own copy, then hashed there (module docstring). Of the
    other files only the header's pages are owned (before any chunk is hashed), and every
    other page is given back once hashed.
    """
    return on_pool(
        {
            name: _mapped_chunks(buffer, chunk_sizes.get(name), own=own is None or name in own)
            for name, buffer in maps.items()
        }
    )


def on_pool(tasks: Mapping[str, Sequence[Callable[[], _T]]]) -> dict[str, list[_T]]:
    """Run each file's chunk tasks (each returns its chunk's digest) on a pool of a thread
    per core; each file's digests in chunk order. The one pool of every verified read."""
    # The files' chunks in turn (file A's first, file B's first, A's second, ...): the
    # files' reads spread over the pool from the start.
    rounds = max((len(chunks) for chunks in tasks.values()), default=0)
    order = [(name, k) for k in range(rounds) for name in tasks if k < len(tasks[name])]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="sha256") as pool:
        futures = {key: pool.submit(tasks[key[0]][key[1]]) for key in order}
        return {name: [futures[name, k].result() for k in range(len(tasks[name]))] for name in tasks}


def _mapped_chunks(
    buffer: mmap.mmap | bytes, chunk_size: int | None, *, own: bool
) -> list[Callable[[], str]]:
    """The tasks hashing each chunk of a map (:func:`sha256_mapped`); of a file not owned,
    the header's pages owned here first."""
    size = len(buffer)
    mapped = isinstance(buffer, mmap.mmap)  # else the bytes of an empty file: nothing to own
    kept = _own_header(buffer) if mapped and not own else None
    step = chunk_size if chunk_size is not None else max(size, 1)
    count = -(-size // step) if chunk_size is not None else 1
    return [
        partial(_hash_mapped, buffer, k * step, min((k + 1) * step, size), own=own and mapped, kept=kept)
        for k in range(count)
    ]


def _own_header(buffer: mmap.mmap) -> int:
    """Own the pages of the header (its 8-byte length, then as much of the JSON as the
    parser reads); the offset from which pages may be given back."""
    size = len(buffer)
    _own_pages(buffer, 0, min(size, 8))
    end = min(size, 8 + min(int.from_bytes(buffer[:8], "little"), _MAX_HEADER))
    _own_pages(buffer, 0, end)
    return -(-end // _PAGE) * _PAGE


def _hash_mapped(buffer: mmap.mmap | bytes, start: int, stop: int, *, own: bool, kept: int | None) -> str:
    """SHA-256 of bytes ``start:stop`` of a map, piece by piece: each owned first if
    ``own``, and its pages from ``kept`` on given back once hashed (None: none)."""
    digest = hashlib.sha256()
    with memoryview(buffer) as view:
        for begin in range(start, stop, _READ_CHUNK):
            end = min(begin + _READ_CHUNK, stop)
            if own:
                _own_pages(buffer, begin, end)
            digest.update(view[begin:end])
            if kept is not None and end > kept:
                # A neighbouring chunk's page given back too is read again if touched: it is
                # hashed only, never used.
                first = max(begin // _PAGE * _PAGE, kept)
                buffer.madvise(mmap.MADV_DONTNEED, first, end - first)
    return digest.hexdigest()


def _own_pages(buffer: mmap.mmap, start: int, stop: int) -> None:
    """Make bytes ``start:stop`` of a private map this process's own copy, so no later
    write to the file can change them (module docstring). Two chunks may share a page."""
    first = start // _PAGE * _PAGE
    try:
        buffer.madvise(_MADV_POPULATE_WRITE, first, stop - first)
    except (OSError, ValueError):
        # A kernel without MADV_POPULATE_WRITE: write a byte of each page to itself, never
        # one outside start:stop (another thread may be hashing a shared page's other part).
        with memoryview(buffer) as view:
            for page in range(first, stop, _PAGE):
                at = max(page, start)
                view[at] = view[at]

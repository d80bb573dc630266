"""THE safetensors reader and writer of the project: every safetensors file we write or
read (checkpoints, stage, warm start, proof snapshots, prepared data) goes through here.

Writing streams the standard layout (8-byte little-endian header length, JSON header
padded to 8 bytes, tensors back to back) straight from the tensors' memory, hashed from
the same buffers by other threads (the whole-file digest, and optionally the chunk
digests), so a save costs about max(write, hash) and makes no in-memory copy of the file.

Verified reading, where the hashed bytes are the used bytes, is
:mod:`~pipeline.checkpoint.verified_read`'s (it parses with this module's parser).
Unverified reading (:func:`read_tensors`) maps the file privately and returns views.

**One strict parser.** :func:`parse_header` (:mod:`pipeline.safetensors_header`, torch-free
so the leak scan of the publish side uses it too) refuses what safetensors' own reader
refuses and more; read here, every refusal is a :class:`~pipeline.errors.SchemaMismatch`
naming the file and the rule.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from ..errors import InternalError, SchemaMismatch
from ..hashing import ChunkDigests
from ..safetensors_header import check_tensor_name, parse_header

__all__ = [
    "PUBLISHED_METADATA",
    "SAFETENSORS_DTYPES",
    "write_safetensors",
    "write_safetensors_files",
    "Written",
    "write_safetensors_streamed",
    "read_tensors",
    "map_file",
    "MappedTensors",
    "tensors_from_map",
    "parse_header",
    "check_tensor_name",
    "safetensors_sha256",
]


class Written(NamedTuple):
    """One file :func:`write_safetensors_files` wrote: its SHA-256 and size, and its chunk
    size and chunk digests (None when none were asked for)."""

    sha256: str
    size: int
    chunk_size: int | None
    chunks: list[str] | None


# The header metadata of every weights file written from tensors rather than copied (a
# staged file, a distributed checkpoint's weights consolidated): what transformers checks.
PUBLISHED_METADATA = {"format": "pt"}

# Bytes per write/hash call: large enough that per-call overhead vanishes, small enough
# that the hashing thread never lags the writer by much.
WRITE_CHUNK = 8 * 1024 * 1024
# Written bytes between hints that start their writeback (see _write_all).
WRITEBACK_WINDOW = 8 * 1024 * 1024
_ADVISE = hasattr(os, "posix_fadvise")
_PAGE = mmap.PAGESIZE

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


# -- writing ------------------------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _header(specs: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    """The padded JSON header of tensors with these dtypes and shapes (``specs``: tensors,
    or ``meta`` tensors standing for them), and the tensor names in file order.

    Widest elements first, then by name, as safetensors' own writer orders them: with no
    gaps allowed between tensors, that is what keeps every tensor aligned to its element
    size, so a memory-mapped load hands out aligned tensors without copying.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    order = sorted(specs, key=lambda n: (-specs[n].element_size(), n))
    offset = 0
    for name in order:
        spec = specs[name]
        check_tensor_name(name)
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {spec.dtype}, which safetensors cannot store")
        nbytes = spec.numel() * spec.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded, order


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _safetensors_layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[torch.Tensor]]:
    """The padded JSON header and the tensors (CPU, contiguous) in file order."""
    header, order = _header(tensors, metadata)
    return header, [_cpu_contiguous(tensors[name]) for name in order]


def _chunks(pieces: list[memoryview], size: int) -> list[memoryview]:
    return [piece[start : start + size] for piece in pieces for start in range(0, len(piece), size)]


class _Hasher(threading.Thread):
    """SHA-256 of each file's in-memory chunks, the files in the order they are written, on
    another core while the writer sends the same chunks to disk: ``make()`` gives each
    file's digest in ``digests`` (a whole-file ``hashlib.sha256``, or :class:`ChunkDigests`).

    hashlib drops the GIL for large buffers, so hashing and ``write`` run in parallel and a
    save costs max(hash, write) instead of their sum. The chunks are the source buffers
    themselves, never a read-back of the file. One thread per kind of digest for all the
    files: the whole-file digests and the chunk table are two passes over the same memory,
    each on its own core, neither waiting for the other.
    """

    def __init__(self, files: list[list[memoryview]], digests: list[Any]) -> None:
        super().__init__(name="safetensors-sha256", daemon=True)
        self._files = files
        self.digests = digests
        self.error: BaseException | None = None
        self.cancelled = threading.Event()

    def run(self) -> None:
        try:
            for digest, chunks in zip(self.digests, self._files):
                for chunk in chunks:
                    if self.cancelled.is_set():
                        return
                    digest.update(chunk)
        except BaseException as exc:  # handed to the writing thread, which raises it
            self.error = exc


class _Fsync(threading.Thread):
    """``fsync`` then ``close`` a written file on a thread of its own, started at once; the
    error, if any, is raised by the writing thread after ``join``."""

    def __init__(self, fd: int) -> None:
        super().__init__(name="safetensors-fsync", daemon=True)
        self._fd = fd
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            os.fsync(self._fd)
        except BaseException as exc:
            self.error = exc
        try:
            os.close(self._fd)
        except OSError as exc:
            self.error = self.error or exc


def _write_all(fd: int, chunks: list[memoryview]) -> int:
    """Write every chunk, pushing finished ranges to disk as we go; return the byte count."""
    written = flushed = 0
    advise = _ADVISE
    for chunk in chunks:
        view = chunk
        while view:
            view = view[os.write(fd, view) :]
        written += len(chunk)
        if advise and written - flushed >= WRITEBACK_WINDOW:
            # Start writeback of what is written (Linux does so for DONTNEED; PostgreSQL's
            # pg_flush_data relies on the same). Otherwise the whole file sits dirty until
            # fsync, which then waits for all of it, and a checkpoint evicts the page cache.
            try:
                os.posix_fadvise(fd, flushed, written - flushed, os.POSIX_FADV_DONTNEED)
            except OSError:
                advise = False  # only a hint; durability comes from the fsync
            flushed = written
    return written


def write_safetensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[str, int]:
    """Write a safetensors file, hashing as bytes go to disk; fsync; return (sha256, size).

    Streaming avoids ``safetensors.torch.save``'s full in-memory copy of the file. The
    layout is the standard one (8-byte little-endian header length, JSON header padded to
    8 bytes, then the tensors back to back), so any safetensors reader loads it. SHA-256
    runs on another thread over the very buffers being written (see :class:`_Hasher`).
    The tensors must not change until this returns.
    """
    written = write_safetensors_files([(path, tensors, metadata)])[0]
    return written.sha256, written.size


def write_safetensors_files(
    files: Sequence[tuple[str | Path, Mapping[str, torch.Tensor], Mapping[str, str] | None]],
    *,
    chunk_size: Callable[[int], int] | None = None,
) -> list[Written]:
    """:func:`write_safetensors` of several files (path, tensors, metadata), written one after
    the other and each fsynced; what was written of each (:class:`Written`), in order, with
    its chunk digests (:class:`~pipeline.hashing.ChunkDigests` of ``chunk_size(its size)``
    bytes, e.g. :func:`~pipeline.hashing.chunk_size_for`) if ``chunk_size`` is given.

    The hashers start at once, over the tensors' memory, not the files: hashing does not wait
    for the writer, so one save costs max(write, hash) rather than their sum, and the
    writer's fsyncs overlap the hashing.
    """
    layouts = []
    for path, tensors, metadata in files:
        header, ordered = _safetensors_layout(tensors, metadata)
        layouts.append(
            (path, _chunks([memoryview(header), *(_tensor_bytes(t) for t in ordered)], WRITE_CHUNK))
        )
    hashers = [_Hasher([chunks for _, chunks in layouts], [hashlib.sha256() for _ in layouts])]
    planned = [sum(len(c) for c in chunks) for _, chunks in layouts]
    sizes_of_chunks = [None if chunk_size is None else chunk_size(size) for size in planned]
    # A file of one chunk has the whole digest as its chunk table: only larger files are
    # hashed a second time, by chunks.
    chunked = (
        []
        if chunk_size is None
        else [index for index, size in enumerate(planned) if size > sizes_of_chunks[index]]
    )
    if chunk_size is not None:
        hashers.append(
            _Hasher([layouts[i][1] for i in chunked], [ChunkDigests(sizes_of_chunks[i]) for i in chunked])
        )
    for hasher in hashers:
        hasher.start()
    syncs: list[_Fsync] = []
    try:
        sizes = []
        for path, chunks in layouts:
            # "x": never overwrite; callers write into a fresh temporary folder.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                sizes.append(_write_all(fd, chunks))
            except BaseException:
                os.close(fd)
                raise
            # The file's fsync waits for its last writeback while the next file is written.
            syncs.append(_Fsync(fd))
        for sync in syncs:
            sync.join()
            if sync.error is not None:
                raise sync.error
        for hasher in hashers:
            hasher.join()
            if hasher.error is not None:
                raise hasher.error
    finally:
        for sync in syncs:
            sync.join()
        for hasher in hashers:
            hasher.cancelled.set()
            hasher.join()
    for (path, chunks), size in zip(layouts, sizes):
        if size != sum(len(c) for c in chunks):
            raise InternalError(f"{path}: wrote {size} bytes, the layout has {sum(len(c) for c in chunks)}")
    written = []
    for index, (digest, size) in enumerate(zip(hashers[0].digests, sizes)):
        whole = digest.hexdigest()
        if chunk_size is None:
            table = None
        elif index in chunked:
            table = hashers[1].digests[chunked.index(index)].hexdigests()
        else:
            table = [whole] if size else []
        written.append(Written(whole, size, sizes_of_chunks[index], table))
    return written


def write_safetensors_streamed(
    path: str | Path,
    specs: Mapping[str, torch.Tensor],
    produce: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> tuple[str, int]:
    """:func:`write_safetensors` for tensors that need not be in memory together: the header
    comes from ``specs`` (``meta`` tensors of each dtype and shape), then each tensor is asked
    of ``produce(name)`` in file order, written, hashed and dropped before the next, so about
    one tensor is in memory at a time whatever the file's size. fsync; return (sha256, size)."""
    header, order = _header(specs, metadata)
    digest = hashlib.sha256(header)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        written = _write_at(fd, memoryview(header), 0)
        for name in order:
            tensor = produce(name)
            if tensor.dtype != specs[name].dtype or tensor.shape != specs[name].shape:
                raise InternalError(
                    f"{path}: tensor {name} came as {tensor.dtype} {tuple(tensor.shape)}, the header "
                    f"says {specs[name].dtype} {tuple(specs[name].shape)}"
                )
            data = _tensor_bytes(_cpu_contiguous(tensor))
            for start in range(0, len(data), WRITE_CHUNK):
                digest.update(data[start : start + WRITE_CHUNK])
            written = _write_at(fd, data, written)
            del tensor, data
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest(), written


def _write_at(fd: int, data: memoryview, offset: int) -> int:
    """Write ``data`` (the file's bytes from ``offset`` on) and start its writeback; the new end."""
    for start in range(0, len(data), WRITE_CHUNK):
        view = data[start : start + WRITE_CHUNK]
        while view:
            view = view[os.write(fd, view) :]
    if _ADVISE and len(data):
        with contextlib.suppress(OSError):  # only a hint (see _write_all)
            os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
    return offset + len(data)


def safetensors_sha256(
    specs: Mapping[str, torch.Tensor],
    produce: Callable[[str], torch.Tensor] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> tuple[str, int]:
    """(SHA-256, size) of the file :func:`write_safetensors_streamed` would write, without
    writing it: ``produce(name)`` (default ``specs[name]``) is asked for each tensor in file order."""
    header, order = _header(specs, metadata)
    digest, size = hashlib.sha256(header), len(header)
    for name in order:
        data = _tensor_bytes(_cpu_contiguous(specs[name] if produce is None else produce(name)))
        digest.update(data)
        size += len(data)
    return digest.hexdigest(), size


_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


# -- reading ------------------------------------------------------------------------------


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, memory-mapped (no pickle, no code execution).

    A malformed file raises :class:`~pipeline.errors.SchemaMismatch` naming ``path``."""
    path = Path(path)
    return tensors_from_map(path, map_file(path))


class MappedTensors:
    """A safetensors file mapped privately and parsed by the strict parser, read one tensor
    at a time: :meth:`release` hands a tensor's pages back once it was used, so reading a
    file of any size holds about one tensor (the OS counts mapped pages a process touched).
    Only for files this process will not write through the map (a released page reads the
    file again when touched), such as a private copy it verified."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.buffer = map_file(self.path)
        try:
            self.header, self.data_start = parse_header(self.buffer)
        except ValueError as exc:
            raise SchemaMismatch(
                f"{self.path} is not a valid safetensors file: {str(exc).splitlines()[0]}"
            ) from None
        self.specs = {
            name: torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]], device="meta")
            for name, entry in self.header.items()
            if name != "__metadata__"
        }
        # The map's address, to find the pages under a view of it (release_view).
        self._base = (
            torch.frombuffer(self.buffer, dtype=torch.uint8, count=1).data_ptr()
            if isinstance(self.buffer, mmap.mmap)
            else None
        )

    def tensor(self, name: str) -> torch.Tensor:
        """A view of the tensor's bytes in the map (no copy)."""
        return _tensor(self.buffer, self.data_start, self.header[name])

    def release(self, name: str) -> None:
        """Give back the pages that hold ``name`` (a neighbour sharing a page reads it again if used)."""
        begin, end = self.header[name]["data_offsets"]
        self._release(self.data_start + begin, self.data_start + end)

    def release_view(self, view: torch.Tensor) -> None:
        """Give back the pages under ``view`` if it is a contiguous view of this map (else nothing)."""
        if self._base is not None and view.is_contiguous():
            start = view.data_ptr() - self._base
            if 0 <= start <= len(self.buffer):
                self._release(start, min(start + view.numel() * view.element_size(), len(self.buffer)))

    def _release(self, start: int, stop: int) -> None:
        first = start // _PAGE * _PAGE
        if isinstance(self.buffer, mmap.mmap) and stop > start:
            self.buffer.madvise(mmap.MADV_DONTNEED, first, stop - first)


def map_file(path: Path) -> mmap.mmap | bytes:
    """The whole file, mapped privately (writable in memory, never written back)."""
    with open(path, "rb") as handle:
        if not handle.seek(0, 2):
            return b""  # mmap refuses empty files; the header check rejects it
        # ACCESS_COPY: private pages, writable in memory, never written back to the file.
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_WILLNEED"):
        # The whole file is about to be hashed: let the kernel read ahead of the hasher.
        mapped.madvise(mmap.MADV_WILLNEED)
    return mapped


def tensors_from_map(path: Path, buffer: mmap.mmap | bytes) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer``; a malformed file raises SchemaMismatch naming ``path`` and the rule."""
    try:
        header, data_start = parse_header(buffer)
    except ValueError as exc:
        raise SchemaMismatch(f"{path} is not a valid safetensors file: {str(exc).splitlines()[0]}") from None
    return {
        name: _tensor(buffer, data_start, entry) for name, entry in header.items() if name != "__metadata__"
    }


def _tensor(buffer: mmap.mmap | bytes, data_start: int, entry: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    shape = entry["shape"]
    begin, end = entry["data_offsets"]
    if begin == end:
        return torch.empty(shape, dtype=dtype)
    # Aligned when written by write_safetensors; like safe_open, an older file's misaligned
    # tensor is still a view (CPU kernels accept it), never a copy.
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
    return raw.view(dtype).view(shape)

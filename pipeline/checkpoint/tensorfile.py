"""THE safetensors reader and writer of the project: every safetensors file we write or
read (checkpoints, stage, warm start, proof snapshots, prepared data) goes through here.

Writing streams the standard layout (8-byte little-endian header length, JSON header
padded to 8 bytes, tensors back to back) straight from the tensors' memory, hashing the
same buffers on a second thread, so a save costs max(hash, write) and makes no in-memory
copy of the file.

Reading maps the file once, privately (copy on write): the SHA-256 can run over that map
(:func:`sha256_mapped`, several files side by side) and the tensors are views of the same
map (:func:`tensors_from_map`), so every byte is read once, nothing is copied, and training
may update the tensors in place without touching the file. The one header parser is
:func:`parse_header`.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import InternalError, SchemaMismatch

__all__ = ["SAFETENSORS_DTYPES", "write_safetensors", "read_tensors", "map_file", "sha256_mapped",
           "tensors_from_map", "parse_header"]

# Bytes per write/hash call: large enough that per-call overhead vanishes, small enough
# that the hashing thread never lags the writer by much.
WRITE_CHUNK = 8 * 1024 * 1024
# Written bytes between hints that start their writeback (see _write_all).
WRITEBACK_WINDOW = 8 * 1024 * 1024
_ADVISE = hasattr(os, "posix_fadvise")
_HASH_CHUNK = 8 * 1024 * 1024
# The reference implementation's bound: a larger header is not a safetensors file.
_MAX_HEADER = 100 * 1024 * 1024

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


def _safetensors_layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
                        ) -> tuple[bytes, list[torch.Tensor]]:
    """The padded JSON header and the tensors (CPU, contiguous) in file order.

    Widest elements first, then by name, as safetensors' own writer orders them: with no
    gaps allowed between tensors, that is what keeps every tensor aligned to its element
    size, so a memory-mapped load hands out aligned tensors without copying.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    ordered = []
    offset = 0
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)):
        tensor = tensors[name]
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        ordered.append(tensor)
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded, ordered


def _chunks(pieces: list[memoryview], size: int) -> list[memoryview]:
    return [piece[start:start + size] for piece in pieces for start in range(0, len(piece), size)]


class _Hasher(threading.Thread):
    """SHA-256 of the same in-memory chunks the writer is sending to disk, on a second core.

    hashlib drops the GIL for large buffers, so hashing and ``write`` run in parallel and a
    save costs max(hash, write) instead of their sum. The chunks are the source buffers
    themselves, never a read-back of the file.
    """

    def __init__(self, chunks: list[memoryview]) -> None:
        super().__init__(name="safetensors-sha256", daemon=True)
        self._chunks = chunks
        self.digest = hashlib.sha256()
        self.error: BaseException | None = None
        self.cancelled = threading.Event()

    def run(self) -> None:
        try:
            for chunk in self._chunks:
                if self.cancelled.is_set():
                    return
                self.digest.update(chunk)
        except BaseException as exc:  # handed to the writing thread, which raises it
            self.error = exc


def _write_all(fd: int, chunks: list[memoryview]) -> int:
    """Write every chunk, pushing finished ranges to disk as we go; return the byte count."""
    written = flushed = 0
    advise = _ADVISE
    for chunk in chunks:
        view = chunk
        while view:
            view = view[os.write(fd, view):]
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


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> tuple[str, int]:
    """Write a safetensors file, hashing as bytes go to disk; fsync; return (sha256, size).

    Streaming avoids ``safetensors.torch.save``'s full in-memory copy of the file. The
    layout is the standard one (8-byte little-endian header length, JSON header padded to
    8 bytes, then the tensors back to back), so any safetensors reader loads it. SHA-256
    runs in a second thread over the very buffers being written (see :class:`_Hasher`).
    The tensors must not change until this returns.
    """
    header, ordered = _safetensors_layout(tensors, metadata)
    chunks = _chunks([memoryview(header), *(_tensor_bytes(t) for t in ordered)], WRITE_CHUNK)
    hasher = _Hasher(chunks)
    # "x": never overwrite; callers write into a fresh temporary folder.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    hasher.start()
    try:
        size = _write_all(fd, chunks)
        os.fsync(fd)  # while the hasher finishes: neither needs the other
        hasher.join()
        if hasher.error is not None:
            raise hasher.error
    finally:
        hasher.cancelled.set()
        hasher.join()
        os.close(fd)
    if size != sum(len(c) for c in chunks):
        raise InternalError(f"{path}: wrote {size} bytes, the layout has {sum(len(c) for c in chunks)}")
    return hasher.digest.hexdigest(), size


_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


# -- reading ------------------------------------------------------------------------------

def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, memory-mapped (no pickle, no code execution).

    A malformed file raises :class:`~pipeline.errors.SchemaMismatch` naming ``path``."""
    path = Path(path)
    return tensors_from_map(path, map_file(path))


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


def _sha256(buffer: mmap.mmap | bytes) -> str:
    digest = hashlib.sha256()
    with memoryview(buffer) as view:
        for start in range(0, len(view), _HASH_CHUNK):
            digest.update(view[start:start + _HASH_CHUNK])
    return digest.hexdigest()


def sha256_mapped(maps: dict[str, mmap.mmap | bytes]) -> dict[str, str]:
    """One thread per file (hashlib drops the GIL): the files hash side by side."""
    digests: dict[str, str] = {}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            digests[name] = _sha256(maps[name])
        except BaseException as exc:  # raised below, in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(name,), name=f"sha256-{name}") for name in maps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return digests


def tensors_from_map(path: Path, buffer: mmap.mmap | bytes) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer``; a malformed header raises SchemaMismatch naming ``path``."""
    try:
        header, data_start = parse_header(buffer)
        return {name: _tensor(buffer, data_start, entry, len(buffer) - data_start)
                for name, entry in header.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise SchemaMismatch(f"{path} is not a valid safetensors file ({exc}): the file is damaged") from None


def parse_header(buffer: mmap.mmap | bytes) -> tuple[dict[str, Any], int]:
    """(header dict, offset of the first data byte); ``ValueError`` if malformed."""
    if len(buffer) < 8:
        raise ValueError("shorter than the 8-byte header length")
    length = int.from_bytes(buffer[:8], "little")
    if length > min(_MAX_HEADER, len(buffer) - 8):
        raise ValueError(f"header length {length} runs past the file")
    header = json.loads(bytes(buffer[8:8 + length]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + length


def _tensor(buffer: mmap.mmap | bytes, data_start: int, entry: dict[str, Any], data_size: int) -> torch.Tensor:
    dtype = _DTYPES[entry["dtype"]]
    shape = entry["shape"]
    begin, end = entry["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"bad shape {shape!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_size
            and end - begin == nbytes):
        raise ValueError(f"data offsets {[begin, end]} do not fit a {entry['dtype']} tensor of shape {shape}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # Aligned when written by write_safetensors; like safe_open, an older file's misaligned
    # tensor is still a view (CPU kernels accept it), never a copy.
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=data_start + begin)
    return raw.view(dtype).view(shape)

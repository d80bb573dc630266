"""THE safetensors reader and writer of the project: every safetensors file we write or
read (checkpoints, stage, warm start, proof snapshots, prepared data) goes through here.

Writing streams the standard layout (8-byte little-endian header length, JSON header
padded to 8 bytes, tensors back to back) straight from the tensors' memory, hashing the
same buffers on a second thread, so a save costs max(hash, write) and makes no in-memory
copy of the file.

Reading maps the file once, privately (copy on write), and hashes it on that map
(:func:`sha256_mapped`, several files side by side, one thread each), so every byte is
read once; the tensors are views of the same map (:func:`tensors_from_map`), which
training may update in place without touching the file.

**The hashed bytes are the used bytes.** A private map still shows later writes to the
file by anyone else in every page this process has not written to yet (Linux shares
those pages with the page cache), so a concurrent writer could change a tensor after its
hash was checked. Two ways to close that, chosen per file by :func:`sha256_mapped`:

- *Verify after materialising* (``into``: resume, whose weights are copied into the live
  model anyway): the header is copied out of the map once, hashed and parsed from that
  copy; then, in file order, each tensor is copied from the map into its destination (the
  model's own parameter of that name, dtype and shape; a fresh tensor otherwise) and the
  *destination's* bytes are hashed. The strict parser guarantees that the tensors tile the
  data from byte 0 to the end, so header + tensors in file order is the whole file: the
  digest is the file's, computed over the bytes that will be used. The copy is one the
  load made anyway (into the parameters), so this costs no more than the zero-copy load
  it replaced. A digest that then differs from ``meta.json`` refuses the checkpoint after
  the parameters were overwritten: they belong to a model built for this load, which the
  refusal discards (the process exits 2), and nothing else was touched.
- *Copy on read* (every other file whose tensors are used: the training state's
  optimizer moments, evaluate's and stage's weights): each chunk of the map is made this
  process's own copy (``MADV_POPULATE_WRITE``: in the kernel) *before* it is hashed, and
  the tensors are views of those owned pages; from then on no write to the file reaches
  them. That costs one fresh page per byte, which a zero-copy view pays later anyway, at
  the first write to each page (the first optimizer step writes every Adam moment).

A file whose tensors nobody will use is hashed on the shared pages, owning only its
header, which the parser reads (``benchmarks/README.md``, "Resume load").

**One strict parser.** :func:`parse_header` refuses what safetensors' own reader refuses
(header over 100 MB or past the end, not starting with ``{``, not UTF-8 JSON, non-string
``__metadata__`` values, unknown dtypes, sizes that overflow, offsets that disagree with
dtype and shape, tensors that do not tile the data from byte 0 to the end) and also a
key twice (after decoding escapes), a tensor named ``__metadata__``, booleans or floats
as offsets or dims, extra fields, and nesting too deep. Every refusal is a
:class:`~pipeline.errors.SchemaMismatch` naming the file and the rule.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Collection, Mapping

import torch

from ..durable import json_loads_strict
from ..errors import InternalError, SchemaMismatch

__all__ = ["SAFETENSORS_DTYPES", "write_safetensors", "safetensors_sha256", "read_tensors", "map_file", "sha256_mapped",
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
# Linux's madvise(MADV_POPULATE_WRITE) (5.14+; Python 3.11 lacks the name): fault the
# pages in as if written, which gives a private map its own copy of them.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PAGE = mmap.PAGESIZE
# A tensor's byte count must fit a signed 64-bit size (torch's and the reference's bound).
_MAX_BYTES = 2**63 - 1
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

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


def safetensors_sha256(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                       ) -> tuple[str, int]:
    """(SHA-256, size) of the file :func:`write_safetensors` would write, without writing it."""
    header, ordered = _safetensors_layout(tensors, metadata)
    digest, size = hashlib.sha256(header), len(header)
    for tensor in ordered:
        data = _tensor_bytes(tensor)
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


def _own_pages(buffer: mmap.mmap, start: int, stop: int) -> None:
    """Make bytes ``start:stop`` of a private map this process's own copy, so no later
    write to the file can change them (see the module docstring)."""
    try:
        buffer.madvise(_MADV_POPULATE_WRITE, start, stop - start)
    except (OSError, ValueError):
        # A kernel without MADV_POPULATE_WRITE: write each page's first byte to itself.
        with memoryview(buffer) as view:
            for page in range(start, stop, _PAGE):
                view[page] = view[page]


def _sha256(buffer: mmap.mmap | bytes, *, own: bool) -> str:
    digest = hashlib.sha256()
    if not isinstance(buffer, mmap.mmap):
        own = False  # bytes are this process's own already
    with memoryview(buffer) as view:
        size = len(view)
        if isinstance(buffer, mmap.mmap) and not own:
            # Nothing will view the data, but the header is parsed: own it, so the parsed
            # header is the hashed one.
            _own_pages(buffer, 0, min(size, 8))
            _own_pages(buffer, 0, min(size, 8 + min(int.from_bytes(view[:8], "little"), _MAX_HEADER)))
        for start in range(0, size, _HASH_CHUNK):
            stop = min(start + _HASH_CHUNK, size)
            if own:
                _own_pages(buffer, start, stop)
            digest.update(view[start:stop])
    return digest.hexdigest()


def _sha256_into(buffer: mmap.mmap | bytes, destinations: Mapping[str, torch.Tensor],
                 out: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the file, verified after materialising (see the module docstring): the
    header from one copy of it, then every tensor, in file order, from its destination in
    ``destinations`` (or a fresh tensor) once copied there; ``out`` receives them all."""
    digest = hashlib.sha256()
    with memoryview(buffer) as view:
        size = len(view)
        first = bytes(view[:8])  # read once: the length that slices is the length parsed
        length = int.from_bytes(first, "little") if size >= 8 else 0
        head = first + bytes(view[8:8 + min(length, _MAX_HEADER, max(size - 8, 0))])
        digest.update(head)
        try:
            header, data_start = parse_header(head, size=size)
        except ValueError:
            # Nothing of a malformed file is used: its hash and then the parser refuse it.
            for start in range(len(head), size, _HASH_CHUNK):
                digest.update(view[start:start + _HASH_CHUNK])
            return digest.hexdigest()
        for _, name in sorted((entry["data_offsets"][0], name) for name, entry in header.items()
                              if name != "__metadata__"):
            out[name] = _materialise(buffer, data_start, header[name], destinations.get(name), digest)
    return digest.hexdigest()


def _materialise(buffer: mmap.mmap | bytes, data_start: int, entry: dict[str, Any],
                 destination: torch.Tensor | None, digest: Any) -> torch.Tensor:
    dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
    fits = (destination is not None and destination.dtype == dtype and list(destination.shape) == shape
            and destination.device.type == "cpu" and destination.is_contiguous())
    tensor = destination.detach() if fits else torch.empty(shape, dtype=dtype)
    begin, end = entry["data_offsets"]
    if begin == end:
        return tensor
    source = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
    target = tensor.reshape(-1).view(torch.uint8)
    hashed = target.numpy()
    for start in range(0, end - begin, _HASH_CHUNK):
        stop = min(start + _HASH_CHUNK, end - begin)
        target[start:stop].copy_(source[start:stop])
        digest.update(hashed[start:stop])  # the destination's bytes, after the copy
    return tensor


def sha256_mapped(maps: dict[str, mmap.mmap | bytes], *, own: Collection[str] | None = None,
                  into: Mapping[str, Mapping[str, torch.Tensor]] | None = None
                  ) -> tuple[dict[str, str], dict[str, dict[str, torch.Tensor]]]:
    """(SHA-256 of each map, the tensors materialised for ``into``), every file hashed so
    that the hashed bytes are the bytes its tensors will use (see the module docstring).

    ``into``: per file name, where its tensors go (by name); such a file is verified after
    materialising and its tensors returned, each its destination or, where none fits
    (name, dtype, shape, CPU, contiguous), a fresh tensor; none if it does not parse.
    ``own``: of the other files, those whose tensors will be viewed (default: all); their
    pages are copied before they are hashed. Of the rest only the header's pages are.
    One thread per file (hashlib, madvise and copies drop the GIL): the files hash side by side.
    """
    into = into or {}
    digests: dict[str, str] = {}
    materialised: dict[str, dict[str, torch.Tensor]] = {name: {} for name in into}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            if name in into:
                digests[name] = _sha256_into(maps[name], into[name], materialised[name])
            else:
                digests[name] = _sha256(maps[name], own=own is None or name in own)
        except BaseException as exc:  # raised below, in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(name,), name=f"sha256-{name}") for name in maps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return digests, materialised


def tensors_from_map(path: Path, buffer: mmap.mmap | bytes) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer``; a malformed file raises SchemaMismatch naming ``path`` and the rule."""
    try:
        header, data_start = parse_header(buffer)
    except ValueError as exc:
        raise SchemaMismatch(f"{path} is not a valid safetensors file: {str(exc).splitlines()[0]}") from None
    return {name: _tensor(buffer, data_start, entry) for name, entry in header.items() if name != "__metadata__"}


def parse_header(buffer: mmap.mmap | bytes, *, size: int | None = None) -> tuple[dict[str, Any], int]:
    """(header dict, offset of the first data byte), every rule of the module docstring
    checked; ``ValueError`` naming the rule otherwise. ``header["__metadata__"]``, if present,
    maps str to str; every other entry is a tensor that :func:`_tensor` can view.
    ``buffer``: the file, or its first bytes (length and header) with ``size`` the file's."""
    size = len(buffer) if size is None else size
    if size < 8:
        raise ValueError("shorter than the 8-byte header length")
    length = int.from_bytes(buffer[:8], "little")
    if length > _MAX_HEADER:
        raise ValueError(f"header length {length} is over the {_MAX_HEADER}-byte limit")
    if length > size - 8:
        raise ValueError(f"header length {length} runs past the end of the file")
    raw = bytes(buffer[8:8 + length])
    if not raw.startswith(b"{"):
        raise ValueError("the header does not start with '{'")
    try:
        header = json_loads_strict(raw)
    except ValueError as exc:
        raise ValueError(f"the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(value, str) for value in metadata.values())):
        raise ValueError("__metadata__ must map strings to strings (no tensor may be named __metadata__)")
    spans = []
    for name, entry in header.items():
        if name != "__metadata__":
            spans.append((*_check_entry(name, entry), name))
    position, data_size = 0, size - 8 - length
    for begin, end, name in sorted(spans):
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else (
                "leaves a hole before it" if position else "does not start the data at byte 0")
            raise ValueError(f"tensor {name!r} at data bytes {begin}..{end} {what}")
        position = end
    if position != data_size:
        what = "trailing bytes after the last tensor" if position < data_size else "tensors run past the end"
        raise ValueError(f"{what} (tensors end at data byte {position}, the file holds {data_size})")
    return header, 8 + length


def _check_entry(name: str, entry: Any) -> tuple[int, int]:
    """A tensor entry's (begin, end) data offsets, once its dtype, shape and size agree."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise ValueError(f"tensor {name!r} must have exactly dtype, shape and data_offsets")
    dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r} has unknown dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    # type() is int: JSON true/false decode to bools, which are ints to isinstance.
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape must be a list of non-negative integers, not {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise ValueError(f"tensor {name!r}: data_offsets must be two non-negative integers, not {offsets!r}")
    # Zero dims make the tensor empty, but the others must still fit: [0, 2**62, 4] is not a shape.
    bound = dtype.itemsize
    for dim in shape:
        bound *= max(dim, 1)
        if bound > _MAX_BYTES:
            raise ValueError(f"tensor {name!r}: shape {shape} overflows a 64-bit size")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end < begin or end - begin != nbytes:
        raise ValueError(f"tensor {name!r}: data offsets {offsets} do not hold a {entry['dtype']} tensor of "
                         f"shape {shape} ({nbytes} bytes)")
    return begin, end


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

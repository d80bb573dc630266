"""State <-> (JSON, tensors) without pickle, and safetensors files hashed as they are written.

Any nested state (an optimizer's ``state_dict()``, RNG states, sampler progress) is split
into a JSON tree and a flat ``{name: tensor}`` table. Tensors and NumPy arrays become
references into the table; tuples and dicts with non-string keys get small markers so the
round trip is exact (``betas`` comes back as a tuple, optimizer state keys as ints).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import _remove_duplicate_names

__all__ = [
    "split_state",
    "join_state",
    "write_safetensors",
    "dedupe_shared_tensors",
    "SAFETENSORS_DTYPES",
    "WRITE_CHUNK",
    "WRITEBACK_WINDOW",
]

# Bytes per write/hash call: large enough that per-call overhead vanishes, small enough
# that the hashing thread never lags the writer by much.
WRITE_CHUNK = 8 * 1024 * 1024
# Written bytes between hints that start their writeback (see _write_all).
WRITEBACK_WINDOW = 8 * 1024 * 1024
_ADVISE = hasattr(os, "posix_fadvise")

_TENSOR = "__tensor__"
_NDARRAY = "__ndarray__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_MARKERS = (_TENSOR, _NDARRAY, _TUPLE, _DICT)

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


def split_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Return a JSON-able tree for ``obj``; tensors found in it are added to ``tensors``.

    Tensor names are the path to them (``optimizer/state/0/exp_avg``), so a saved file is
    readable by eye with plain ``safetensors``.
    """
    if isinstance(obj, torch.Tensor):
        if prefix in tensors:
            raise ValueError(f"two state entries map to the tensor name {prefix!r}")
        tensors[prefix] = obj.detach()
        return {_TENSOR: prefix}
    if isinstance(obj, np.ndarray):
        raw = np.ascontiguousarray(obj)
        tensors[prefix] = torch.from_numpy(raw.reshape(-1).view(np.uint8).copy())
        return {_NDARRAY: prefix, "dtype": raw.dtype.str, "shape": list(raw.shape)}
    if isinstance(obj, np.generic):
        return split_state(obj.item(), prefix, tensors)
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: split_state(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
        return {_DICT: [[split_state(k, f"{prefix}/key{i}", tensors), split_state(v, f"{prefix}/{k}", tensors)]
                        for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {_TUPLE: [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_state(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        # JSON has no inf/nan; Python's json writes them anyway and reads them back exactly.
        return obj
    raise TypeError(f"cannot save {type(obj).__name__} at {prefix!r}: only tensors, arrays, numbers, "
                    "strings, lists, tuples and dicts are stored (no pickle)")


def join_state(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`. Missing tensors raise ``KeyError`` naming them."""
    if isinstance(tree, dict):
        if _TENSOR in tree:
            return tensors[tree[_TENSOR]]
        if _NDARRAY in tree:
            raw = tensors[tree[_NDARRAY]].numpy().tobytes()
            return np.frombuffer(raw, dtype=np.dtype(tree["dtype"])).reshape(tree["shape"]).copy()
        if _TUPLE in tree:
            return tuple(join_state(v, tensors) for v in tree[_TUPLE])
        if _DICT in tree:
            return {_hashable(join_state(k, tensors)): join_state(v, tensors) for k, v in tree[_DICT]}
        return {k: join_state(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_state(v, tensors) for v in tree]
    return tree


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def dedupe_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep one name per shared storage (tied weights), the way ``safetensors.torch.save_model`` does.

    Using safetensors' own choice of the kept name means ``safetensors.torch.load_model``
    (strict) loads our file into a fresh model with no project code.
    """
    state_dict = dict(state_dict)
    for kept, removed in _remove_duplicate_names(state_dict).items():
        for name in removed:
            del state_dict[name]
        assert kept in state_dict
    return state_dict


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
    assert size == sum(len(c) for c in chunks)
    return hasher.digest.hexdigest(), size

"""Resume in one pass over the bytes: verify a checkpoint and load its tensors together.

``verify_checkpoint`` followed by ``read_tensors`` reads every byte twice: once through
``read()`` into a buffer to hash it, once more through a fresh memory map when the tensors
are used. Here each file is mapped once, privately (copy on write): the SHA-256 runs over
that map, both files in parallel, and the tensors are built on the same map. Every byte is
read once, nothing is copied, and training may write to the tensors (optimizer state is
updated in place) without touching the file.

The checks are ``verify_checkpoint``'s, and nothing is returned before every file passed
them. When a check fails, :func:`load_resume` lets :func:`resolve_checkpoint` diagnose
the folder again, so a refusal carries exactly its message.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ChecksumMismatch, CheckpointError, NoCheckpoint, SchemaMismatch
from .serialization import SAFETENSORS_DTYPES
from .layout import MODEL_FILE, STATE_FILE
from .store import CheckpointStore, check_listing, read_meta, resolve_checkpoint

__all__ = ["LoadedCheckpoint", "load_checkpoint", "load_resume"]

_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_HASH_CHUNK = 8 * 1024 * 1024
# The reference implementation's bound: a larger header is not a safetensors file.
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    folder: Path
    meta: dict[str, Any]
    model_tensors: dict[str, torch.Tensor]
    state_tensors: dict[str, torch.Tensor]


def load_resume(spec: str | Path, root: str | Path) -> LoadedCheckpoint:
    """:func:`resolve_checkpoint` (``"latest"`` or a folder), loading while verifying."""
    if str(spec) != "latest":
        folder = Path(spec)
    else:
        store = CheckpointStore(root)
        steps = store.committed_steps()
        if not steps:
            resolve_checkpoint(spec, root)  # raises NoCheckpoint with its advice
        folder = store.path_for(steps[-1])
    try:
        return load_checkpoint(folder)
    except CheckpointError:
        # Re-diagnose with the store's own logic: same message, and it names an older
        # checkpoint that verifies. If it finds nothing wrong, our refusal stands.
        resolve_checkpoint(spec, root)
        raise


def load_checkpoint(folder: str | Path) -> LoadedCheckpoint:
    """``verify_checkpoint(folder)`` plus ``read_tensors`` of both files, in one pass.

    Raises what ``verify_checkpoint`` raises, before any tensor exists.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NoCheckpoint(f"{folder} is not a checkpoint folder")
    meta = read_meta(folder)
    check_listing(folder, meta)
    maps = {name: _map(folder / name) for name in meta["files"]}
    digests = _sha256_parallel(maps)
    for name, entry in sorted(meta["files"].items()):
        if digests[name] != entry["sha256"]:
            raise ChecksumMismatch(f"{folder / name} SHA-256 differs from meta.json: "
                                   "the file is damaged or was modified")
    return LoadedCheckpoint(folder=folder, meta=meta,
                            model_tensors=_tensors(folder / MODEL_FILE, maps[MODEL_FILE]),
                            state_tensors=_tensors(folder / STATE_FILE, maps[STATE_FILE]))


def _map(path: Path) -> mmap.mmap | bytes:
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


def _sha256_parallel(maps: dict[str, mmap.mmap | bytes]) -> dict[str, str]:
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


def _tensors(path: Path, buffer: mmap.mmap | bytes) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffer``; a malformed header raises SchemaMismatch naming ``path``."""
    try:
        header, data_start = _header(buffer)
        return {name: _tensor(buffer, data_start, entry, len(buffer) - data_start)
                for name, entry in header.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise SchemaMismatch(f"{path} is not a valid safetensors file ({exc}): the file is damaged") from None


def _header(buffer: mmap.mmap | bytes) -> tuple[dict[str, Any], int]:
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

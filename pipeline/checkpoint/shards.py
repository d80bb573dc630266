"""The parts of a distributed (torchrun) checkpoint that a single-process one lacks:
the launch record in ``meta.json``, and shard coverage.

Model and optimizer are written by ``torch.distributed.checkpoint``'s
``HuggingFaceStorageWriter``: plain safetensors files, each chunk's place in its full
tensor in the header's ``__metadata__``. Torch's reader reads whatever files it finds and
does not check that they cover each tensor (with one of two shard files deleted it loads
half the rows without a word), so :func:`shard_tensors` checks it here, on the verified
maps, before anything reads a value: every chunk inside its tensor's bounds and of its
dtype, no two overlapping, and their volumes adding up to the whole (so no gap either).
:func:`consolidate` then builds the single-process ``modelo.safetensors`` content.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import SEALED_BUT_UNFIT, ChecksumMismatch, SchemaMismatch
from ..layout import DIST_MODEL_DIR, DIST_OPTIM_DIR, STATE_FILE, rank_rng_file
from .tensorfile import (
    SAFETENSORS_DTYPES,
    MappedTensors,
    parse_header,
    tensors_from_map,
)

__all__ = [
    "PARALLEL_MODES",
    "check_launch_record",
    "tensor_specs",
    "shard_tensors",
    "consolidate",
    "ConsolidatedTensors",
]

PARALLEL_MODES = ("ddp", "fsdp2")
SHARDED_PARTS = (DIST_MODEL_DIR, DIST_OPTIM_DIR)
# Where torch's HuggingFaceStorageWriter records a chunk's place in the full tensor.
_SHARDING_KEY = "DCP_SHARDING_INFO"
_OFFSETS_KEY = "saved_offsets"
_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
# Bytes of a chunk copied before its mapped pages are given back (see _assemble).
_SLICE_BYTES = 8 * 1024 * 1024


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``{name: {"dtype", "shape"}}`` of full tensors, as meta.json's ``tensors`` records them."""
    return {
        name: {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape)}
        for name, t in sorted(tensors.items())
    }


def _spec_ok(spec: Any) -> bool:
    return (
        isinstance(spec, dict)
        and set(spec) == {"dtype", "shape"}
        and spec["dtype"] in SAFETENSORS_DTYPES.values()
        and isinstance(spec["shape"], list)
        and all(type(d) is int and d >= 0 for d in spec["shape"])
    )


def check_launch_record(path: Path, meta: dict[str, Any]) -> None:
    """``parallel``, ``tensors``, ``resharded_from`` and the files table's names of a
    distributed meta.json (called by :func:`pipeline.checkpoint.meta.read_meta`)."""
    parallel, tensors, resharded = meta["parallel"], meta["tensors"], meta["resharded_from"]
    if not (
        isinstance(parallel, dict)
        and set(parallel) == {"mode", "world_size", "ddp_find_unused_parameters"}
        and type(parallel["world_size"]) is int
        and parallel["world_size"] >= 1
        and parallel["mode"] in PARALLEL_MODES
        and type(parallel["ddp_find_unused_parameters"]) is bool
    ):
        raise SchemaMismatch(f"{path} has a malformed parallel record: {SEALED_BUT_UNFIT}")
    if not (resharded is None or (type(resharded) is int and resharded >= 1)):
        raise SchemaMismatch(f"{path} has a malformed resharded_from: {SEALED_BUT_UNFIT}")
    if not (
        isinstance(tensors, dict)
        and set(tensors) == set(SHARDED_PARTS)
        and all(
            isinstance(part, dict) and all(_spec_ok(spec) for spec in part.values())
            for part in tensors.values()
        )
    ):
        raise SchemaMismatch(f"{path} has a malformed tensors table: {SEALED_BUT_UNFIT}")
    ranks = {rank_rng_file(rank) for rank in range(parallel["world_size"])}
    for name in meta["files"]:
        top = name.split("/")[0]
        if name != STATE_FILE and name not in ranks and not (top in SHARDED_PARTS and "/" in name):
            raise SchemaMismatch(f"{path} lists {name!r}, which has no place in a distributed checkpoint")
    missing = sorted(ranks - set(meta["files"]))
    if missing:
        raise SchemaMismatch(f"{path} does not list {missing[0]}: the checkpoint is incomplete")
    if not all(any(name.startswith(f"{part}/") for name in meta["files"]) for part in SHARDED_PARTS) and any(
        tensors[part] for part in SHARDED_PARTS
    ):
        raise SchemaMismatch(
            f"{path} lists no shard file for the model or the optimizer: the checkpoint is incomplete"
        )


def shard_offsets(header: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any], list[int]]]:
    """``(tensor, header entry, offsets in the full tensor)`` for each tensor of a DCP shard
    file's parsed header (DCP records the offsets in its ``__metadata__``; a tensor it does not
    list starts at 0). Malformed sharding info raises ``ValueError``, ``TypeError``,
    ``KeyError`` or ``AttributeError`` while iterating: the caller names the file."""
    extra = header.get("__metadata__") or {}
    sharding = json.loads(extra[_SHARDING_KEY]) if _SHARDING_KEY in extra else {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = sharding.get(key, {}).get(_OFFSETS_KEY, [0] * len(entry["shape"]))
        if not (
            isinstance(offsets, list)
            and len(offsets) == len(entry["shape"])
            and all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise ValueError(f"bad offsets for {key}")
        yield key, entry, offsets


def _chunks(folder: Path, part: str, maps: Mapping[str, Any]) -> dict[str, list[tuple[list[int], str]]]:
    """``{tensor: [(offsets, file)]}`` from the headers of ``part/``'s files, each parsed by
    the one strict parser (:func:`~pipeline.checkpoint.tensorfile.parse_header`)."""
    chunks: dict[str, list[tuple[list[int], str]]] = {}
    for name in sorted(n for n in maps if n.startswith(f"{part}/")):
        tensors_from_map(folder / name, maps[name])  # every rule of the strict parser, one line if broken
        header, _ = parse_header(maps[name])
        try:
            for key, _entry, offsets in shard_offsets(header):
                chunks.setdefault(key, []).append((offsets, name))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SchemaMismatch(
                f"{folder / name} has a malformed {_SHARDING_KEY} ({exc}): the file is damaged"
            ) from None
    return chunks


def _covered(
    folder: Path, part: str, expected: Mapping[str, Any], maps: Mapping[str, Any]
) -> dict[str, list[tuple[list[int], str, torch.Tensor]]]:
    """``{tensor: [(offsets, file, chunk view)]}`` of ``part/`` once every expected tensor is
    tiled exactly by its chunks; :class:`ChecksumMismatch` naming the tensor otherwise."""
    where = f"{folder / part}/"
    chunks = _chunks(folder, part, maps)
    extra = sorted(set(chunks) - set(expected))
    if extra:
        raise ChecksumMismatch(f"{where} holds tensor {extra[0]} that meta.json does not list")
    views: dict[str, dict[str, torch.Tensor]] = {}
    result: dict[str, list[tuple[list[int], str, torch.Tensor]]] = {}
    for name, spec in sorted(expected.items()):
        full, pieces = spec["shape"], []
        for offsets, file in chunks.get(name, []):
            if file not in views:
                views[file] = tensors_from_map(folder / file, maps[file])
            pieces.append((offsets, file, views[file][name]))
        if not pieces:
            raise ChecksumMismatch(f"{where} holds no shard of tensor {name}: a shard file is missing")
        volume = 0
        for offsets, _, view in pieces:
            if (
                SAFETENSORS_DTYPES[view.dtype] != spec["dtype"]
                or view.dim() != len(full)
                or any(o + s > f for o, s, f in zip(offsets, view.shape, full))
            ):
                raise ChecksumMismatch(
                    f"{where}: a shard of {name} does not fit its {spec['dtype']} tensor of shape {full}"
                )
            volume += view.numel()
        for i, (a, _, va) in enumerate(pieces):
            for b, _, vb in pieces[i + 1 :]:
                if va.numel() and all(
                    max(ao, bo) < min(ao + as_, bo + bs) for ao, as_, bo, bs in zip(a, va.shape, b, vb.shape)
                ):
                    raise ChecksumMismatch(f"{where}: two shards of {name} overlap")
        if volume != math.prod(full):
            raise ChecksumMismatch(
                f"{where}: the shards of {name} cover {volume} of its {math.prod(full)} "
                "elements: a shard file is missing or damaged"
            )
        result[name] = pieces
    return result


def shard_tensors(
    folder: Path, part: str, expected: Mapping[str, Any], maps: Mapping[str, Any]
) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """``{tensor: [(offsets, chunk view)]}`` of ``part/`` once every expected tensor is tiled
    exactly by its chunks; :class:`ChecksumMismatch` naming the tensor otherwise."""
    return {
        name: [(offsets, view) for offsets, _, view in pieces]
        for name, pieces in _covered(folder, part, expected, maps).items()
    }


def _assemble(
    chunks: list[tuple[list[int], torch.Tensor]],
    shape: list[int],
    release: Callable[[torch.Tensor], None] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full tensor from its covered chunks: a tensor held whole by one chunk is that
    view (no copy); a sharded one (FSDP2) is assembled once, into ``out`` if given. ``release``:
    called on each copied slice of a chunk (about 8 MiB), so its mapped pages can go as the
    copy proceeds."""
    if len(chunks) == 1:
        return chunks[0][1]
    full = torch.empty(shape, dtype=chunks[0][1].dtype) if out is None else out
    for offsets, view in chunks:
        target = full[tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))]
        if release is None or view.dim() == 0 or view.numel() == 0:
            target.copy_(view)
            continue
        rows = max(1, _SLICE_BYTES // max(1, view[0].numel() * view.element_size()))
        for row in range(0, view.shape[0], rows):
            target[row : row + rows].copy_(view[row : row + rows])
            release(view[row : row + rows])
    return full


class ConsolidatedTensors:
    """The full tensors of one part (``model/``) of a distributed checkpoint, one at a time,
    in bounded memory: :meth:`tensor` assembles one alone from its chunks' mapped pages
    (into one buffer reused by the next call: copy or consume it before asking again),
    giving them back as it copies (a tensor held whole by one chunk is that view, no copy),
    and :meth:`release` gives back a view's, so a consumer that writes or loads each tensor
    before asking for the next holds about one tensor whatever the model's size. Iterating
    yields ``(name, tensor)`` in name order, releasing each once the next is asked for.

    ``files``: the part's shard files, each a :class:`~pipeline.checkpoint.tensorfile.MappedTensors`
    keyed by its name in ``meta.json``'s files table (``model/…``), opened on files this
    process verified and does not write (a private copy); coverage is checked here."""

    def __init__(
        self, folder: Path, part: str, expected: Mapping[str, Any], files: Mapping[str, MappedTensors]
    ) -> None:
        self._files = files
        self._pieces = _covered(folder, part, expected, {name: file.buffer for name, file in files.items()})
        self.specs = {
            name: torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]], device="meta")
            for name, spec in sorted(expected.items())
        }
        self._largest = max((s.numel() * s.element_size() for s in self.specs.values()), default=0)
        self._buffer: torch.Tensor | None = None

    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor ``name``; an assembled one lives in a buffer reused by the next
        call (one allocation of the largest size, not one per tensor: a freed large block
        that the allocator keeps would count as memory too)."""
        pieces = self._pieces[name]
        files = [self._files[file] for file in sorted({file for _, file, _ in pieces})]

        def release(piece: torch.Tensor) -> None:
            for file in files:  # the one whose map holds it gives its pages back
                file.release_view(piece)

        spec = self.specs[name]
        out = None
        if len(pieces) > 1:
            nbytes = spec.numel() * spec.element_size()
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._buffer = None  # freed before the larger one is taken
                self._buffer = torch.empty(max(nbytes, self._largest), dtype=torch.uint8)
            out = self._buffer[:nbytes].view(spec.dtype).view(spec.shape)
        return _assemble([(offsets, view) for offsets, _, view in pieces], list(spec.shape), release, out)

    def release(self, name: str) -> None:
        for _, file, view in self._pieces[name]:
            self._files[file].release_view(view)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.specs:
            yield name, self.tensor(name)
            self.release(name)


def consolidate(
    pieces: Mapping[str, list[tuple[list[int], torch.Tensor]]], expected: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """Full tensors from covered chunks (:func:`_assemble`), all at once: a tensor held whole
    by one chunk is that view of the mapped file (no copy)."""
    return {name: _assemble(chunks, expected[name]["shape"]) for name, chunks in pieces.items()}

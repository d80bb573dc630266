"""A distributed resume uses only bytes its own rank hashed.

:class:`SealedReads` is one rank's reading of a distributed checkpoint. Of each file a
rank needs, the sealed chunks (``meta.json``'s chunk table, :mod:`.meta`) covering the
bytes it uses are read into this process's memory, once, and each hashed there against
its digest before any byte of it is served; DCP's read requests are then served from those
bytes (:class:`VerifiedShardReader`, a ``torch.distributed.checkpoint`` ``StorageReader``),
so no later write to a file reaches what was verified, and a rank reads of another rank's
shard only the chunks of its header and of the pieces it loads (under FSDP2, the optimizer's
step counts, which DCP saves once for all ranks). A file sealed with its whole digest only
(distributed schema 2) is one chunk: read whole, hashed whole.

Planning needs every shard file's header (which rank's piece is where): the headers are
read small and unhashed, parsed by the one strict parser, and every tensor's coverage is
checked on them against ``meta.json``'s shapes (torch's planner would leave a gap as the
freshly built values). A header only steers reads: every byte it steers to is hashed before
it is used, and the hashed header must be the planned one byte for byte.

A refusal is kept, not raised, while DCP's collectives run (a rank raising there would
leave the others waiting in the next one); :meth:`SealedReads.agree` then decides on every
rank with one collective, before any state is set. docs/distributed.md, "Resume".
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch.distributed.checkpoint import Metadata, StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import ChecksumMismatch, PipelineError, SchemaMismatch, StateMismatch
from ..safetensors_header import MAX_HEADER as _MAX_HEADER
from ..world import World
from .shards import shard_offsets
from .tensorfile import _DTYPES, parse_header, tensors_from_map
from .verified_read import _READ_CHUNK, on_pool, read_and_hash

__all__ = ["SealedReads", "VerifiedShardReader"]

# The refusals a rank can keep for the agreement, by name (the agreement carries text).
_REFUSALS = {cls.__name__: cls for cls in (ChecksumMismatch, SchemaMismatch, StateMismatch)}


class SealedReads:
    """This rank's reads of the checkpoint ``folder`` whose verified ``meta.json`` is
    ``meta``: the chunks of each file that this rank uses read into memory and hashed there
    (:meth:`read`), refusals kept until :meth:`agree`."""

    def __init__(self, folder: Path, meta: Mapping[str, Any]) -> None:
        self.folder = folder
        self.meta = meta
        self.refusals: list[PipelineError] = []

    def prefetch(self, names: Iterable[str]) -> None:
        """Start the kernel reading files ``names`` of the folder into the page cache, on a
        thread of its own, while DCP plans and the first files are hashed: a hint, no more.
        Nothing it reads is used (every byte used is read and hashed by :meth:`read`), and a
        file it cannot open is left to the read that needs it to name."""
        paths = [self.folder / name for name in names if name in self.meta["files"]]
        threading.Thread(target=_prefetch, args=(paths,), name="checkpoint-prefetch", daemon=True).start()

    def reader(self, part: str) -> "VerifiedShardReader":
        """A DCP ``StorageReader`` of ``part/`` (model or optimizer) whose reads come from here."""
        return VerifiedShardReader(self, part)

    def refuse(self, error: PipelineError) -> None:
        self.refusals.append(error)

    def read(
        self,
        name: str,
        spans: Iterable[tuple[int, int]] | None = None,
        into: Mapping[int, memoryview] | None = None,
    ) -> memoryview | None:
        """File ``name``'s bytes in a buffer of its size, of which the sealed chunks covering
        ``spans`` (``[start, end)`` byte ranges; None: the whole file) are read into memory
        of this process and each hashed there against its digest in ``meta.json`` (a file
        sealed with its whole digest only is one chunk); the rest of the buffer is never read
        nor touched. ``None`` (a refusal kept) if a chunk is not the sealed bytes.

        ``into``: ``{file offset: memoryview}``, ranges read straight into their final place
        (a tensor that takes a whole stored chunk) and hashed there; the buffer's pages of
        those ranges are never touched."""
        path = self.folder / name
        sealed = self.meta["files"][name]
        size = sealed["size"]
        chunk_size = sealed.get("chunk_size", max(size, 1))
        digests = sealed.get("chunk_sha256", [sealed["sha256"]])
        spans = [(0, size)] if spans is None else [(a, b) for a, b in spans if b > a]
        if any(a < 0 or b > size for a, b in spans):
            self.refuse(
                ChecksumMismatch(f"{path}: a planned read falls outside the file: the file was modified")
            )
            return None
        wanted = sorted({k for a, b in spans for k in range(a // chunk_size, (b - 1) // chunk_size + 1)})
        # Anonymous pages: none is touched but those read into (a chunk read in place never is).
        whole = memoryview(mmap.mmap(-1, max(size, 1))).cast("B")[:size]
        direct = _disjoint(into or {}, size)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for k in wanted:  # the kernel reads ahead within each chunk (its reads go in order)
                begin = k * chunk_size
                os.posix_fadvise(fd, begin, min(chunk_size, size - begin), os.POSIX_FADV_WILLNEED)
            got = on_pool(
                {
                    name: [
                        partial(
                            read_and_hash,
                            fd,
                            _pieces(whole, direct, k * chunk_size, min((k + 1) * chunk_size, size)),
                        )
                        for k in wanted
                    ]
                }
            )[name]
            # A file grown since it was listed is not the sealed one either.
            grown = os.fstat(fd).st_size != size
        finally:
            os.close(fd)
        for k, digest in zip(wanted, got):
            if grown or digest != digests[k]:
                where = f" (chunk {k}: bytes {k * chunk_size}-{min((k + 1) * chunk_size, size)})"
                self.refuse(
                    ChecksumMismatch(
                        f"{path} SHA-256 differs from meta.json{where if 'chunk_sha256' in sealed else ''}: "
                        "the file is damaged or was modified"
                    )
                )
                return None
        return whole

    def agree(self, world: World) -> None:
        """One collective: every rank learns whether any rank refused a file it read, and
        every rank raises the same one line (the lowest refusing rank's first), so the
        launch prints it once."""
        mine = f"{type(self.refusals[0]).__name__}\t{self.refusals[0]}" if self.refusals else ""
        said = world.gather_text(mine)
        first = next((line for line in said if line), None)
        if first is not None:
            kind, _, message = first.partition("\t")
            raise _REFUSALS.get(kind, ChecksumMismatch)(message)


def _prefetch(paths: list[Path]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _disjoint(into: Mapping[int, memoryview], size: int) -> list[tuple[int, memoryview]]:
    """The ranges of ``into`` in file order. Ranges that overlap or run past the end come
    from a planned header that is not this file's (the strict parser lets no real one tile
    so): left out, so read into the buffer instead, and the file is refused for that header
    (:meth:`VerifiedShardReader.read_data`)."""
    kept: list[tuple[int, memoryview]] = []
    position = 0
    for start, view in sorted(into.items()):
        if start >= position and start + len(view) <= size:
            kept.append((start, view))
            position = start + len(view)
    return kept


def _pieces(
    whole: memoryview, direct: list[tuple[int, memoryview]], begin: int, end: int
) -> list[tuple[memoryview, int, bool]]:
    """The file's bytes ``[begin, end)`` as pieces for :func:`~.verified_read.read_and_hash`:
    the ranges of ``direct`` into their views, the rest into ``whole``, in pieces of at most
    ``_READ_CHUNK`` (still in the CPU cache when hashed)."""
    spans: list[tuple[int, memoryview]] = []
    position = begin
    for start, view in direct:
        low, high = max(start, begin), min(start + len(view), end)
        if low >= high:
            continue
        spans.append((position, whole[position:low]))
        spans.append((low, view[low - start : high - start]))
        position = high
    spans.append((position, whole[position:end]))
    return [
        (view[at : at + _READ_CHUNK], offset + at, True)
        for offset, view in spans
        for at in range(0, len(view), _READ_CHUNK)
    ]


def _head(path: Path) -> tuple[bytes, int]:
    """A safetensors file's first bytes up to the end of its header, and the file's size."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, 8, 0)
        length = int.from_bytes(first, "little") if len(first) == 8 else 0
        return first + os.pread(fd, min(length, _MAX_HEADER, max(size - 8, 0)), 8), size
    finally:
        os.close(fd)


class VerifiedShardReader(StorageReader):
    """DCP's reads of one part (``model/`` or ``optim/``) of a distributed checkpoint, in the
    layout torch's ``HuggingFaceStorageWriter`` writes, served from :class:`SealedReads`.

    :meth:`read_metadata` plans from every file's header (module docstring);
    :meth:`read_data` reads each file this rank's plan names, whole, hashed, then copies
    the requested slices out of those bytes. A file refused serves nothing."""

    def __init__(self, reads: SealedReads, part: str) -> None:
        super().__init__()
        self.reads = reads
        self.part = part
        self.heads: dict[str, bytes] = {}
        self.headers: dict[str, tuple[dict[str, Any], int]] = {}
        self.storage_data: dict[MetadataIndex, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder, expected = self.reads.folder, self.reads.meta["tensors"][self.part]
        tensors: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, str] = {}
        for name in sorted(n for n in self.reads.meta["files"] if n.startswith(f"{self.part}/")):
            path = folder / name
            head, size = _head(path)
            try:
                header, _ = parse_header(head, size=size)
                for key, entry, offsets in shard_offsets(header):
                    spec = expected.get(key)
                    if spec is None:
                        raise ChecksumMismatch(f"{path} holds tensor {key} that meta.json does not list")
                    chunk = ChunkStorageMetadata(
                        offsets=torch.Size(offsets), sizes=torch.Size(entry["shape"])
                    )
                    if (
                        _DTYPES[spec["dtype"]] != _DTYPES[entry["dtype"]]
                        or any(o + s > f for o, s, f in zip(offsets, entry["shape"], spec["shape"]))
                        or len(offsets) != len(spec["shape"])
                    ):
                        raise ChecksumMismatch(
                            f"{path}: a shard of {key} does not fit its {spec['dtype']} tensor of "
                            f"shape {spec['shape']}"
                        )
                    tensors.setdefault(
                        key,
                        TensorStorageMetadata(
                            properties=TensorProperties(dtype=_DTYPES[spec["dtype"]]),
                            size=torch.Size(spec["shape"]),
                            chunks=[],
                        ),
                    ).chunks.append(chunk)
                    storage[MetadataIndex(fqn=key, offset=torch.Size(offsets))] = name
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                if isinstance(exc, PipelineError):
                    raise
                raise SchemaMismatch(
                    f"{path} is not a valid shard file: {str(exc).splitlines()[0]}"
                ) from None
            self.heads[name] = head
            self.headers[name] = parse_header(head, size=size)
        _check_coverage(folder / self.part, expected, tensors)
        self.storage_data = storage
        return Metadata(state_dict_metadata=tensors, storage_data=storage, storage_meta=StorageMeta())

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index], []).append(item)
        for name, items in sorted(per_file.items()):
            path = self.reads.folder / name
            targets = [planner.resolve_tensor(item).detach() for item in items]
            header, data_start = self.headers[name]
            # The header (to check the hashed one is the planned one) and each request's bytes.
            spans = [(0, data_start)] + [
                _span(header[item.storage_index.fqn], data_start, item) for item in items
            ]
            into: dict[int, memoryview] = {}
            direct = [False] * len(items)
            for index, (item, target) in enumerate(zip(items, targets)):
                # A request for a whole stored chunk into a tensor laid out like it is read
                # straight into that tensor (an FSDP2 resume at its own world size: all of them).
                entry = header[item.storage_index.fqn]
                begin, end = entry["data_offsets"]
                if (
                    end > begin
                    and not any(item.storage_offsets)
                    and list(item.lengths) == entry["shape"]
                    and target.device.type == "cpu"
                    and target.is_contiguous()
                    and target.dtype == _DTYPES[entry["dtype"]]
                    and target.numel() * target.element_size() == end - begin
                    and data_start + begin not in into
                ):
                    into[data_start + begin] = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast(
                        "B"
                    )
                    direct[index] = True
            data = self.reads.read(name, spans, into)
            if data is None:
                continue
            head = self.heads[name]
            if bytes(data[: len(head)]) != head:
                # Hashed and sealed, but not what the plan was made from: changed meanwhile.
                self.reads.refuse(
                    ChecksumMismatch(f"{path} changed while it was read: the file was modified")
                )
                continue
            views = tensors_from_map(path, data)
            for item, target, in_place in zip(items, targets, direct):
                if in_place:  # read into it already
                    planner.commit_tensor(item, target)
                    continue
                source = views[item.storage_index.fqn][
                    tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                ]
                if target.shape != source.shape:
                    raise SchemaMismatch(
                        f"{path}: a read of {item.storage_index.fqn} does not fit its target"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)
            del views, data  # one file's bytes held at a time
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _span(entry: Mapping[str, Any], data_start: int, item: Any) -> tuple[int, int]:
    """The file's bytes ``[start, end)`` from the first to the last element of a request
    (a slice of a stored row-major chunk); empty for an empty one."""
    if not all(item.lengths):
        return (0, 0)
    size = _DTYPES[entry["dtype"]].itemsize
    strides = [math.prod(entry["shape"][i + 1 :]) for i in range(len(entry["shape"]))]
    first = sum(o * s for o, s in zip(item.storage_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, item.lengths, strides))
    begin = data_start + entry["data_offsets"][0]
    return (begin + first * size, begin + (last + 1) * size)


def _check_coverage(
    where: Path, expected: Mapping[str, Any], tensors: Mapping[str, TensorStorageMetadata]
) -> None:
    """Every tensor ``meta.json`` lists tiled exactly by its chunks: none missing, no two
    overlapping, their volumes adding up to the whole."""
    for name, spec in sorted(expected.items()):
        chunks = tensors[name].chunks if name in tensors else []
        if not chunks:
            raise ChecksumMismatch(f"{where}/ holds no shard of tensor {name}: a shard file is missing")
        for i, a in enumerate(chunks):
            for b in chunks[i + 1 :]:
                if math.prod(a.sizes) and all(
                    max(ao, bo) < min(ao + asz, bo + bsz)
                    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)
                ):
                    raise ChecksumMismatch(f"{where}/: two shards of {name} overlap")
        volume = sum(math.prod(chunk.sizes) for chunk in chunks)
        if volume != math.prod(spec["shape"]):
            raise ChecksumMismatch(
                f"{where}/: the shards of {name} cover {volume} of its {math.prod(spec['shape'])} "
                "elements: a shard file is missing or damaged"
            )

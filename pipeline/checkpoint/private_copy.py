"""A checkpoint's weights read from a verified private copy, one tensor in memory at a time.

For readers that need every weight but not all at once (the stage, and evaluate or the
proof on a distributed checkpoint): :func:`open_weights` copies the weights of a
checkpoint that :func:`~pipeline.checkpoint.load_checkpoint` verified into a scratch
folder, hashing on the way and comparing with ``meta.json`` again, then maps the copy.
Every read is of this copy, which no one else writes, so the bytes used are the bytes
verified without owning (and counting) every page of the model, as a load does. A
distributed checkpoint's sharded tensors come assembled one at a time
(:class:`~pipeline.checkpoint.shards.ConsolidatedTensors`). The copy costs the weights'
size in disk space beside the scratch folder's owner.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import ChecksumMismatch, InternalError
from ..hashing import CHUNK, HashingWriter, sha256_file
from ..layout import DIST_MODEL_DIR, MODEL_FILE
from .meta import is_distributed
from .shards import ConsolidatedTensors
from .tensorfile import PUBLISHED_METADATA, MappedTensors, safetensors_sha256
from .weights import check_derived_buffers, check_weights_fit

__all__ = ["CheckpointWeights", "open_weights"]


def _copy_verified(source: Path, target: Path, entry: Mapping[str, Any]) -> dict[str, Any]:
    """Copy while hashing, compare with the checkpoint's record, then re-hash the copy
    from disk: both what was read and what landed must be the recorded bytes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, HashingWriter(target) as out:
        while chunk := src.read(CHUNK):
            out.write(chunk)
    if out.sha256 != entry["sha256"] or out.size != entry["size"]:
        raise ChecksumMismatch(f"{source} changed while it was copied (SHA-256 differs from its meta.json)")
    if sha256_file(target) != entry["sha256"]:
        raise ChecksumMismatch(f"the copy of {source} reads back with another SHA-256: check the disk")
    return {"sha256": out.sha256, "size": out.size}


class CheckpointWeights:
    """A checkpoint's stored tensors, read from a verified private copy one at a time.

    ``specs``: stored name -> a ``meta`` tensor of its dtype and shape. ``copy``: for a
    single-process checkpoint, the copied ``modelo.safetensors`` and its ``entry`` (SHA-256,
    size), which the stage publishes as is when nothing is renamed or split. ``origin``:
    where they were stored (named by refusals); ``record``: meta.json's ``model`` record."""

    def __init__(
        self,
        source: MappedTensors | ConsolidatedTensors,
        copy: Path | None,
        entry: dict[str, Any] | None,
        files: list[MappedTensors],
        *,
        origin: str,
        record: Any,
    ) -> None:
        self._source: MappedTensors | ConsolidatedTensors | None = source
        self._files = files
        self.specs: dict[str, torch.Tensor] = dict(source.specs)
        self.copy = copy
        self.entry = entry
        self.origin = origin
        self.record = record

    def check_fit(self, model: torch.nn.Module) -> dict[str, str]:
        """Refuse weights that do not fit ``model`` (names, dtypes, shapes, ties, and the
        meta.json record: :func:`~pipeline.checkpoint.weights.check_weights_fit`) or whose
        buffers recorded as derived are no longer what it computes; the tied aliases."""
        tied = check_weights_fit(model, self.specs, record=self.record, source=self.origin)
        derived = self.record.get("derived_buffers") if isinstance(self.record, Mapping) else None
        names = (
            [name for name in derived if isinstance(name, str) and name in self.specs]
            if isinstance(derived, list)
            else []
        )
        # Buffers are never sharded: each is a view of its file, not the reused assembly buffer.
        check_derived_buffers(model, {name: self.tensor(name) for name in names}, derived, source=self.origin)
        for name in names:
            self.release(name)
        return tied

    def load_into(self, model: torch.nn.Module) -> None:
        """Once :meth:`check_fit` passed, copy every tensor into ``model``'s own, one at a
        time (tied aliases share the kept tensor's storage): the load of
        :func:`~pipeline.checkpoint.weights.load_model_weights`, in bounded memory."""
        self.check_fit(model)
        own = model.state_dict()
        with torch.no_grad():
            for name in sorted(self.specs):
                own[name].copy_(self.tensor(name))
                self.release(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor (a view of the mapped copy, or assembled from its shards into a
        buffer the next call reuses: use it before asking for the next)."""
        return self._open().tensor(name)

    def release(self, name: str) -> None:
        """Give back the memory of a tensor that was used (see :meth:`MappedTensors.release`)."""
        self._open().release(name)

    def sha256(self) -> str:
        """The SHA-256 of these weights as one ``modelo.safetensors``: the copied file's, or
        for a distributed checkpoint the file written from its full tensors (what 04 names
        as the weights it evaluated), hashed one tensor at a time without writing it."""
        if self.entry is not None:
            return self.entry["sha256"]
        source, produced = self._open(), []

        def produce(name: str) -> torch.Tensor:
            if produced:
                source.release(produced[-1])
            produced.append(name)
            return source.tensor(name)

        digest = safetensors_sha256(self.specs, produce, PUBLISHED_METADATA)[0]
        if produced:
            source.release(produced[-1])
        return digest

    def _open(self) -> MappedTensors | ConsolidatedTensors:
        if self._source is None:
            raise InternalError("a checkpoint's weights were read after they were closed")
        return self._source

    def close(self) -> None:
        """Let go of the maps and any assembly buffer (nothing can be read after)."""
        files, self._files, self._source = self._files, [], None
        for file in files:
            if hasattr(file.buffer, "close"):
                with contextlib.suppress(BufferError):  # a view still alive keeps the map; it goes with it
                    file.buffer.close()


def open_weights(folder: Path, meta: dict[str, Any], scratch: Path) -> CheckpointWeights:
    """The weights of the verified checkpoint ``folder``, copied into ``scratch`` (hashed
    on the way and compared with ``meta.json``), every copy parsed by the strict parser and
    a distributed checkpoint's shards checked to tile each tensor."""
    if not is_distributed(meta):
        copy = scratch / MODEL_FILE
        entry = _copy_verified(folder / MODEL_FILE, copy, meta["files"][MODEL_FILE])
        mapped = MappedTensors(copy)
        return CheckpointWeights(
            mapped, copy, entry, [mapped], origin=str(folder / MODEL_FILE), record=meta["model"]
        )
    files = {}
    for name, entry in sorted(meta["files"].items()):
        if name.startswith(f"{DIST_MODEL_DIR}/"):
            _copy_verified(folder / name, scratch / name, entry)
            files[name] = MappedTensors(scratch / name)
    consolidated = ConsolidatedTensors(scratch, DIST_MODEL_DIR, meta["tensors"][DIST_MODEL_DIR], files)
    return CheckpointWeights(
        consolidated,
        None,
        None,
        list(files.values()),
        origin=str(folder / DIST_MODEL_DIR),
        record=meta["model"],
    )

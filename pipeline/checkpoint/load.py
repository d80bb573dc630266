"""Verify a checkpoint and load it, in one function and one pass over the bytes.

Every consumer of a checkpoint (resume, evaluate, stage, the resume proof, warm start)
calls :func:`load_checkpoint`. Its checks, in order: the folder exists and is named
``step-…``; ``meta.json`` parses and has the schema; no stray or missing file and every
size right (cheap: catches truncation before a long hash); then each file is mapped once,
privately, hashed on that map (both files in parallel; each page copied before it is
hashed, so the hashed bytes are the used ones) and compared with ``meta.json``; then both
headers go through the one strict parser. Tensors are views of the same maps, and nothing
is returned before every file passed.

A distributed (torchrun) checkpoint goes through the same checks, every file through
the same parser, plus every shard's coverage (:mod:`.shards`); its ``model_tensors`` are
the consolidated weights a single process would have saved.

For ``"latest"``, a refusal names an older checkpoint that verifies, if there is one:
silently resuming from older state would repeat work the user believes was saved.

:func:`pinned_checkpoint` is the same load for readers that run beside a trainer (scripts
04 and 05): it pins the folder (see :func:`pipeline.checkpoint.store.pin`) until the block
ends, and for "latest" takes the newest checkpoint again if a prune won the race.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import CheckpointError, ChecksumMismatch, NoCheckpoint
from ..layout import CHECKPOINT_DIR, DIST_MODEL_DIR, DIST_OPTIM_DIR, MODEL_FILE, STATE_FILE
from .shards import consolidate, shard_tensors
from .store import check_listing, is_distributed, parse_step_dir, pin, read_meta, resolve, step_dir_name
from .tensorfile import map_file, sha256_mapped, tensors_from_map

__all__ = ["LoadedCheckpoint", "load_checkpoint", "pinned_checkpoint"]

# A trainer that saves and prunes every step can win the race between listing and pinning
# a few times in a row; it cannot win forever.
_PIN_ATTEMPTS = 50


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """A verified checkpoint. The tensors are empty when loaded with ``tensors=False``."""

    folder: Path
    meta: dict[str, Any]
    model_tensors: dict[str, torch.Tensor]
    state_tensors: dict[str, torch.Tensor]

    @property
    def derived_buffers(self) -> Any:
        """Names of the stored buffers that were still their freshly built value when saved
        (checked by :func:`~pipeline.checkpoint.weights.check_derived_buffers`)."""
        model = self.meta["model"]
        return model.get("derived_buffers") if isinstance(model, dict) else None


def load_checkpoint(spec: str | Path = "latest", root: str | Path = CHECKPOINT_DIR, *, tensors: bool = True,
                    committed: bool = False) -> LoadedCheckpoint:
    """Verify ``spec`` (``"latest"`` in ``root``, or a checkpoint folder) and load it.

    ``tensors=False`` verifies every byte but builds no tensors (stage, diagnostics).
    ``committed``: see :func:`pipeline.checkpoint.store.resolve`. Raises
    :class:`~pipeline.errors.CheckpointError` subclasses naming the file; reads only.
    """
    folder, older = resolve(spec, root, committed=committed)
    return _load_or_name_older(folder, older, tensors=tensors)


@contextlib.contextmanager
def pinned_checkpoint(spec: str | Path = "latest", root: str | Path = CHECKPOINT_DIR, *, tensors: bool = True,
                      committed: bool = False) -> Iterator[LoadedCheckpoint]:
    """:func:`load_checkpoint`, with the folder pinned against pruning until the block ends,
    so every later read of its files (a copy, a hash) sees the verified bytes."""
    with contextlib.ExitStack() as held:
        for attempt in range(_PIN_ATTEMPTS):
            folder, older = resolve(spec, root, committed=committed)
            try:
                held.enter_context(pin(folder))
                break
            except NoCheckpoint:
                if str(spec) != "latest" or attempt == _PIN_ATTEMPTS - 1:
                    raise
        yield _load_or_name_older(folder, older, tensors=tensors)


def _load_or_name_older(folder: Path, older: list[Path], *, tensors: bool) -> LoadedCheckpoint:
    try:
        return _load(folder, tensors=tensors)
    except CheckpointError as damage:
        for candidate in older:
            try:
                _load(candidate, tensors=False)
            except (CheckpointError, OSError):  # damaged too, or pruned meanwhile by a trainer
                continue
            raise CheckpointError(f"{damage} The older checkpoint {candidate} verifies: resume from it with "
                                  f"--resume {candidate} (nothing was deleted).") from None
        raise


def _load(folder: Path, *, tensors: bool) -> LoadedCheckpoint:
    if not folder.is_dir():
        raise NoCheckpoint(f"{folder} is not a checkpoint folder")
    if parse_step_dir(folder.name) is None:
        # Temporary (.tmp-…) and half-deleted (.deleting-…) folders never count.
        raise NoCheckpoint(f"{folder} is not a committed checkpoint (expected a folder named like "
                           f"{step_dir_name(10)})")
    meta = read_meta(folder)
    check_listing(folder, meta)
    maps = {name: map_file(folder / name) for name in meta["files"]}
    digests = sha256_mapped(maps)
    for name, entry in sorted(meta["files"].items()):
        if digests[name] != entry["sha256"]:
            raise ChecksumMismatch(f"{folder / name} SHA-256 differs from meta.json: "
                                   "the file is damaged or was modified")
    # Parsed even with tensors=False: a file whose hash matches may still be malformed, and
    # evaluate, stage and resume must refuse exactly the same files. Views cost nothing.
    state = tensors_from_map(folder / STATE_FILE, maps[STATE_FILE])
    if is_distributed(meta):
        # Every shard header parsed and every tensor's coverage checked before torch's
        # reader (resume) or the consolidation below (evaluate, stage) reads a value.
        model_pieces = shard_tensors(folder, DIST_MODEL_DIR, meta["tensors"][DIST_MODEL_DIR], maps)
        shard_tensors(folder, DIST_OPTIM_DIR, meta["tensors"][DIST_OPTIM_DIR], maps)
        for name in meta["files"]:
            if name.startswith(f"{DIST_OPTIM_DIR}/") or name.startswith(f"{DIST_MODEL_DIR}/"):
                continue
            tensors_from_map(folder / name, maps[name])
        model = consolidate(model_pieces, meta["tensors"][DIST_MODEL_DIR]) if tensors else {}
    else:
        model = tensors_from_map(folder / MODEL_FILE, maps[MODEL_FILE])
    if not tensors:
        return LoadedCheckpoint(folder=folder, meta=meta, model_tensors={}, state_tensors={})
    return LoadedCheckpoint(folder=folder, meta=meta, model_tensors=model, state_tensors=state)

"""Verify a checkpoint and load it, in one function and one pass over the bytes.

Every consumer of a checkpoint (resume, evaluate, stage, the resume proof, warm start)
calls :func:`load_checkpoint`. Its checks, in order: the folder exists and is named
``step-…``; ``meta.json`` parses and has the schema; no stray or missing file and every
size right (cheap: catches truncation before a long hash); then each file is mapped once,
privately, hashed on that map (both files in parallel; each page of a file whose tensors
are handed out copied before it is hashed, so the hashed bytes are the used ones) and
compared with ``meta.json``; then both
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

__all__ = ["LoadedCheckpoint", "load_checkpoint", "pinned_checkpoint", "WEIGHTS_ONLY"]

# load_checkpoint(tensors=WEIGHTS_ONLY): the weights' tensors, not the training state's
# (evaluate, stage); its bytes are verified all the same.
WEIGHTS_ONLY = "weights"
# The files whose tensors each ``tensors`` value hands out.
_USED = {True: (MODEL_FILE, STATE_FILE), WEIGHTS_ONLY: (MODEL_FILE,), False: ()}

# A trainer that saves and prunes every step can win the race between listing and pinning
# a few times in a row; it cannot win forever.
_PIN_ATTEMPTS = 50


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """A verified checkpoint. The tensors of a file not asked for (``tensors=``) are empty."""

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


def load_checkpoint(spec: str | Path = "latest", root: str | Path = CHECKPOINT_DIR, *, tensors: bool | str = True,
                    committed: bool = False) -> LoadedCheckpoint:
    """Verify ``spec`` (``"latest"`` in ``root``, or a checkpoint folder) and load it.

    ``tensors=False`` verifies every byte but builds no tensors (diagnostics);
    ``tensors=WEIGHTS_ONLY`` builds the weights' tensors only (evaluate, stage).
    ``committed``: see :func:`pipeline.checkpoint.store.resolve`. Raises
    :class:`~pipeline.errors.CheckpointError` subclasses naming the file; reads only.
    """
    folder, older = resolve(spec, root, committed=committed)
    return _load_or_name_older(folder, older, tensors=tensors)


@contextlib.contextmanager
def pinned_checkpoint(spec: str | Path = "latest", root: str | Path = CHECKPOINT_DIR, *, tensors: bool | str = True,
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


def _load_or_name_older(folder: Path, older: list[Path], *, tensors: bool | str) -> LoadedCheckpoint:
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


def _load(folder: Path, *, tensors: bool | str) -> LoadedCheckpoint:
    if not folder.is_dir():
        raise NoCheckpoint(f"{folder} is not a checkpoint folder")
    if parse_step_dir(folder.name) is None:
        # Temporary (.tmp-…) and half-deleted (.deleting-…) folders never count.
        raise NoCheckpoint(f"{folder} is not a committed checkpoint (expected a folder named like "
                           f"{step_dir_name(10)})")
    meta = read_meta(folder)
    check_listing(folder, meta)
    maps = {name: map_file(folder / name) for name in meta["files"]}
    used = _USED[tensors]
    if is_distributed(meta) and MODEL_FILE in used:
        # The consolidated weights are built from the model shards' mapped pages.
        used = (*used, *(name for name in meta["files"] if name.startswith(f"{DIST_MODEL_DIR}/")))
    # Owning a page costs a copy of it (benchmarks/README.md): only what is used is owned.
    digests = sha256_mapped(maps, own=used)
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
        model = consolidate(model_pieces, meta["tensors"][DIST_MODEL_DIR]) if MODEL_FILE in used else {}
    else:
        model = tensors_from_map(folder / MODEL_FILE, maps[MODEL_FILE])
    return LoadedCheckpoint(folder=folder, meta=meta, model_tensors=model if MODEL_FILE in used else {},
                            state_tensors=state if STATE_FILE in used else {})

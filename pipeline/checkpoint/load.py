"""Verify a checkpoint and load it, in one function and one pass over the bytes.

Every consumer of a checkpoint (resume, evaluate, stage, the resume proof, warm start)
calls :func:`load_checkpoint`. Its checks, in order: the folder exists and is named
``step-…``; ``meta.json`` parses and has the schema; no stray or missing file and every
size right (cheap: catches truncation before a long hash); then every file is read once
and hashed as it is read (files side by side) and compared with ``meta.json``; then every
header goes through the one strict parser. Nothing is returned before every file passed.

The hashed bytes are the used bytes (:func:`.verified_read.read_verified`): the files whose
tensors are used are read into memory of this process and hashed there. A resume passes
the model it built (``into=``), whose parameters receive the weights directly, so it reads
the checkpoint's ``meta.json`` first (:func:`checkpoint_meta`: sealed, schema, listing; no
file hashed), builds the run it describes, then loads into it; a refusal then leaves a
model of this process overwritten, never a value that training uses.

A distributed (torchrun) checkpoint goes through the same checks, every file through
the same parser, plus every shard's coverage (:mod:`.shards`); its ``model_tensors`` are
the consolidated weights a single process would have saved.

For ``"latest"``, a refusal names an older checkpoint that verifies, if there is one:
silently resuming from older state would repeat work the user believes was saved. For
``"best"``, the mark (``BEST.json``) is checked against the evaluations the checkpoint it
names recorded, read from its verified training state (:func:`.best.check_best`; only those
tensors are read into memory, the rest of the file is hashed where it lies).

:func:`pinned_checkpoint` is the same load for readers that run beside a trainer (scripts
04 and 05): it pins the folder (see :func:`pipeline.checkpoint.store.pin`) until the block
ends, and for "latest" takes the newest checkpoint again if a prune won the race.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch

from ..errors import CheckpointError, ChecksumMismatch, NoCheckpoint, SchemaMismatch, first_line
from ..layout import CHECKPOINT_DIR, DIST_MODEL_DIR, DIST_OPTIM_DIR, MODEL_FILE, STATE_FILE
from .best import best_path, check_best
from .evaluations import PREFIX as EVALUATION_PREFIX
from .evaluations import evaluations_from
from .meta import check_listing, is_distributed, read_meta
from .shards import consolidate, shard_tensors
from .store import CheckpointStore, best_folder, parse_step_dir, pin, resolve, step_dir_name
from .tensorfile import map_file, tensors_from_map
from .verified_read import read_verified, sha256_mapped
from .weights import dedupe_shared_tensors

__all__ = ["LoadMode", "LoadedCheckpoint", "checkpoint_meta", "load_checkpoint", "pinned_checkpoint"]


class LoadMode(enum.Enum):
    """Which tensors :func:`load_checkpoint` hands out; every byte is verified in each mode."""

    FULL = "full"
    """The weights and the training state (resume, the proof)."""
    WEIGHTS = "weights"
    """The weights only (evaluate, stage)."""
    VERIFY = "verify"
    """No tensors: verification and ``meta.json`` only (diagnostics)."""


# The files whose tensors each mode hands out.
_USED = {LoadMode.FULL: (MODEL_FILE, STATE_FILE), LoadMode.WEIGHTS: (MODEL_FILE,), LoadMode.VERIFY: ()}

_T = TypeVar("_T")
# A trainer that saves and prunes every step can win the race between listing and pinning
# a few times in a row; it cannot win forever.
_PIN_ATTEMPTS = 50


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    """A verified checkpoint. The tensors of a file not asked for (``mode``) are empty."""

    folder: Path
    meta: dict[str, Any]
    model_tensors: dict[str, torch.Tensor]
    state_tensors: dict[str, torch.Tensor]
    best: dict[str, Any] | None = None
    """Loaded as ``"best"``: the mark, checked against this checkpoint's own evaluations
    (:func:`.best.check_best`), its value the one the checkpoint recorded."""

    @property
    def derived_buffers(self) -> Any:
        """Names of the stored buffers that were still their freshly built value when saved
        (checked by :func:`~pipeline.checkpoint.weights.check_derived_buffers`)."""
        model = self.meta["model"]
        return model.get("derived_buffers") if isinstance(model, dict) else None


def load_checkpoint(
    spec: str | Path = "latest",
    root: str | Path = CHECKPOINT_DIR,
    *,
    mode: LoadMode = LoadMode.FULL,
    committed: bool = False,
    into: torch.nn.Module | None = None,
) -> LoadedCheckpoint:
    """Verify ``spec`` (``"latest"`` or ``"best"`` in ``root``, or a checkpoint folder) and load it.

    ``mode`` says which tensors are built (:class:`LoadMode`); every byte is verified.
    ``into`` (resume, with ``LoadMode.FULL``): the model the weights are for; each stored
    parameter is copied straight into this model's parameter of that name (same dtype and
    shape, on the CPU), which ``model_tensors`` then holds (so loading it is no copy); its
    buffers and anything that does not fit come as fresh tensors, checked as usual by
    :func:`~pipeline.checkpoint.weights.load_model_weights`. On a refusal those parameters
    hold unverified bytes: discard the model.
    ``committed``: see :func:`pipeline.checkpoint.store.resolve`. Raises
    :class:`~pipeline.errors.CheckpointError` subclasses naming the file; reads only.
    """
    folder, older, mark = _resolve(spec, root, committed)
    return _or_name_older(
        folder,
        older,
        lambda candidate: _load(candidate, mode=mode, into=into, mark=mark, root=root),
        committed=committed,
    )


def _resolve(
    spec: str | Path, root: str | Path, committed: bool
) -> tuple[Path, list[Path], dict[str, Any] | None]:
    """:func:`.store.resolve`, and for ``"best"`` the mark read with it (checked by the load)."""
    if str(spec) == "best":
        folder, mark = best_folder(root)
        return folder, [], mark
    return (*resolve(spec, root, committed=committed), None)


def checkpoint_meta(
    spec: str | Path = "latest", root: str | Path = CHECKPOINT_DIR
) -> tuple[Path, dict[str, Any]]:
    """(folder, meta.json) of ``spec``, as :func:`load_checkpoint` checks them (folder name,
    seal, schema, listing and sizes; for "latest", naming an older checkpoint that verifies
    if this one is refused), but no file hashed yet: what a resume reads to build the run
    that it then loads into (``load_checkpoint(..., into=run.model)``)."""
    folder, older = resolve(spec, root)
    return folder, _or_name_older(folder, older, _meta)


@contextlib.contextmanager
def pinned_checkpoint(
    spec: str | Path = "latest",
    root: str | Path = CHECKPOINT_DIR,
    *,
    mode: LoadMode = LoadMode.FULL,
    committed: bool = False,
) -> Iterator[LoadedCheckpoint]:
    """:func:`load_checkpoint`, with the folder pinned against pruning until the block ends,
    so every later read of its files (a copy, a hash) sees the verified bytes."""
    with contextlib.ExitStack() as held:
        for attempt in range(_PIN_ATTEMPTS):
            folder, older, mark = _resolve(spec, root, committed)
            try:
                held.enter_context(pin(folder))
                break
            except NoCheckpoint:
                # A trainer beside us may prune the folder just resolved: resolve again.
                if str(spec) not in ("latest", "best") or attempt == _PIN_ATTEMPTS - 1:
                    raise
        yield _or_name_older(
            folder,
            older,
            lambda candidate: _load(candidate, mode=mode, mark=mark, root=root),
            committed=committed,
        )


def _or_name_older(
    folder: Path, older: list[Path], load: Callable[[Path], _T], *, committed: bool = False
) -> _T:
    """``load(folder)``, or its refusal naming the newest older checkpoint that verifies, with
    the flag that names it: ``--checkpoint`` where a finished checkpoint is consumed
    (``committed``: 04, 05), ``--resume`` where a run continues."""
    use = "evaluate or stage it with --checkpoint" if committed else "resume from it with --resume"
    try:
        return load(folder)
    except CheckpointError as damage:
        for candidate in older:
            try:
                _load(candidate, mode=LoadMode.VERIFY)
            except (CheckpointError, OSError):  # damaged too, or pruned meanwhile by a trainer
                continue
            raise CheckpointError(
                f"{damage}; the older checkpoint {candidate} verifies: {use} {candidate} (nothing was deleted)"
            ) from None
        raise


def _meta(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise NoCheckpoint(f"{folder} is not a checkpoint folder")
    if parse_step_dir(folder.name) is None:
        # Temporary (.tmp-…) and half-deleted (.deleting-…) folders never count.
        raise NoCheckpoint(
            f"{folder} is not a committed checkpoint (expected a folder named like {step_dir_name(10)})"
        )
    meta = read_meta(folder)
    check_listing(folder, meta)
    return meta


def _load(
    folder: Path,
    *,
    mode: LoadMode,
    into: torch.nn.Module | None = None,
    mark: dict[str, Any] | None = None,
    root: str | Path = CHECKPOINT_DIR,
) -> LoadedCheckpoint:
    """Verify and load ``folder``; with ``mark`` (loaded as ``"best"`` in ``root``), check the
    mark against the evaluations its training state recorded."""
    meta = _meta(folder)
    loaded, evaluations = (
        _load_distributed(folder, meta, mode, evaluated=mark is not None)
        if is_distributed(meta)
        else _load_single(folder, meta, mode, into, evaluated=mark is not None)
    )
    if mark is None:
        return loaded
    try:
        recorded = evaluations_from(evaluations, meta["step"])
    except CheckpointError as exc:
        raise CheckpointError(f"{folder / STATE_FILE}: {exc}") from None
    committed = CheckpointStore(root).committed_steps()
    newest = max(committed, default=meta["step"])
    try:
        later = _evaluations_of(CheckpointStore(root).path_for(newest)) if newest > meta["step"] else None
    except (CheckpointError, OSError) as exc:
        raise CheckpointError(
            f"{best_path(root)} is not checked: the newest checkpoint, whose evaluations it is checked "
            f"against, does not verify ({first_line(exc, limit=None)}): pass --checkpoint PATH"
        ) from None
    return replace(loaded, best=check_best(mark, recorded, committed, best_path(root), newest=later))


def _evaluations_of(folder: Path) -> dict[str, list]:
    """The evaluations ``folder`` recorded: its training state alone read and hashed against
    its meta.json (only the evaluation tensors kept; the other files are not read)."""
    meta = _meta(folder)
    entry = meta["files"][STATE_FILE]
    read = read_verified(
        {STATE_FILE: folder / STATE_FILE},
        {STATE_FILE: {}},
        {STATE_FILE: entry.get("chunk_size")},
        wanted={STATE_FILE: _evaluation_tensor},
    )
    digests, tensors = read[STATE_FILE]
    _check_digests(folder / STATE_FILE, entry, digests)
    if isinstance(tensors, ValueError):
        raise SchemaMismatch(
            f"{folder / STATE_FILE} is not a valid safetensors file: {first_line(tensors, limit=None)}"
        )
    try:
        return evaluations_from(tensors, meta["step"])
    except CheckpointError as exc:
        raise CheckpointError(f"{folder / STATE_FILE}: {exc}") from None


def _evaluation_tensor(name: str) -> bool:
    return name.startswith(EVALUATION_PREFIX)


def _load_single(
    folder: Path, meta: dict[str, Any], mode: LoadMode, into: torch.nn.Module | None, *, evaluated: bool
) -> tuple[LoadedCheckpoint, dict[str, torch.Tensor]]:
    used = _USED[mode]
    # Straight into the model's parameters (resume): not its buffers, which are compared
    # with the stored values before loading (check_derived_buffers).
    parameters = (
        {
            name: tensor
            for name, tensor in dedupe_shared_tensors(into.state_dict(keep_vars=True)).items()
            if isinstance(tensor, torch.nn.Parameter)
        }
        if into is not None and mode is LoadMode.FULL
        else {}
    )
    # Reading a file costs a copy of it (benchmarks/README.md): only what is used is read; of a
    # training state read only for its evaluations, only they are.
    partly = evaluated and STATE_FILE not in used
    read = read_verified(
        {name: folder / name for name in meta["files"]},
        {
            name: (parameters if name == MODEL_FILE else {})
            if name in used or (partly and name == STATE_FILE)
            else None
            for name in meta["files"]
        },
        _chunk_sizes(meta),
        wanted={STATE_FILE: _evaluation_tensor} if partly else None,
    )
    for name, entry in sorted(meta["files"].items()):
        _check_digests(folder / name, entry, read[name][0])
    # Parsed even with LoadMode.VERIFY: a file whose hash matches may still be malformed, and
    # evaluate, stage and resume must refuse exactly the same files.
    for name in (STATE_FILE, MODEL_FILE):
        if isinstance(read[name][1], ValueError):
            raise SchemaMismatch(
                f"{folder / name} is not a valid safetensors file: {first_line(read[name][1], limit=None)}"
            )
    state = read[STATE_FILE][1]
    loaded = LoadedCheckpoint(
        folder=folder,
        meta=meta,
        model_tensors=read[MODEL_FILE][1] if MODEL_FILE in used else {},
        state_tensors=state if STATE_FILE in used else {},
    )
    return loaded, (state if evaluated else {})


def _chunk_sizes(meta: dict[str, Any]) -> dict[str, int | None]:
    """Each file's chunk size: the digests a read computes are one per chunk (None: one of
    the whole file, a schema without chunk tables)."""
    return {name: entry.get("chunk_size") for name, entry in meta["files"].items()}


def _check_digests(path: Path, entry: dict[str, Any], digests: list[str] | None) -> None:
    """The digests a read computed against the file's entry in meta.json: its chunk table
    (schema 3) or its whole SHA-256 (older schemas, one chunk)."""
    expected = entry["chunk_sha256"] if "chunk_sha256" in entry else [entry["sha256"]]
    if digests is None or len(digests) != len(expected):
        raise ChecksumMismatch(f"{path} SHA-256 differs from meta.json: the file is damaged or was modified")
    for index, (got, want) in enumerate(zip(digests, expected)):
        if got != want:
            where = (
                f" (chunk {index}: bytes {index * entry['chunk_size']}-"
                f"{min((index + 1) * entry['chunk_size'], entry['size'])})"
                if "chunk_size" in entry
                else ""
            )
            raise ChecksumMismatch(
                f"{path} SHA-256 differs from meta.json{where}: the file is damaged or was modified"
            )


def _load_distributed(
    folder: Path, meta: dict[str, Any], mode: LoadMode, *, evaluated: bool
) -> tuple[LoadedCheckpoint, dict[str, torch.Tensor]]:
    """:func:`_load` of a torchrun checkpoint: every file mapped once and its chunks hashed
    on the map by the pool (:func:`.verified_read.sha256_mapped`; the pages of the files
    whose tensors are used owned first), every header parsed, and every shard's coverage
    checked before the consolidated weights are built."""
    maps = {name: map_file(folder / name) for name in meta["files"]}
    used = _USED[mode]
    if MODEL_FILE in used:
        # The consolidated weights are built from the model shards' mapped pages.
        used = (*used, *(name for name in meta["files"] if name.startswith(f"{DIST_MODEL_DIR}/")))
    # Owning a page costs a copy of it (benchmarks/README.md): only what is used is owned (the
    # training state's, a few small tensors here, for its evaluations too).
    owned = (*used, STATE_FILE) if evaluated else used
    digests = sha256_mapped(maps, _chunk_sizes(meta), own=owned)
    for name, entry in sorted(meta["files"].items()):
        _check_digests(folder / name, entry, digests[name])
    state = tensors_from_map(folder / STATE_FILE, maps[STATE_FILE])
    # Every shard header parsed and every tensor's coverage checked before torch's
    # reader (resume) or the consolidation below (evaluate, stage) reads a value.
    model_pieces = shard_tensors(folder, DIST_MODEL_DIR, meta["tensors"][DIST_MODEL_DIR], maps)
    shard_tensors(folder, DIST_OPTIM_DIR, meta["tensors"][DIST_OPTIM_DIR], maps)
    for name in meta["files"]:
        if name.startswith(f"{DIST_OPTIM_DIR}/") or name.startswith(f"{DIST_MODEL_DIR}/"):
            continue
        tensors_from_map(folder / name, maps[name])
    model = consolidate(model_pieces, meta["tensors"][DIST_MODEL_DIR]) if MODEL_FILE in used else {}
    loaded = LoadedCheckpoint(
        folder=folder, meta=meta, model_tensors=model, state_tensors=state if STATE_FILE in used else {}
    )
    return loaded, (state if evaluated else {})

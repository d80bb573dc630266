"""A seal for a checkpoint folder another tool wrote: ``meta.json`` listing every file's SHA-256.

transformers' Trainer and accelerate's ``save_state`` write a checkpoint straight into its
final folder, file after file, and mark nothing when they are done: a folder cut short by a
crash looks like a complete one, and ``resume_from_checkpoint=True`` picks the highest
number whatever it holds. :func:`seal_checkpoint` runs once the tool is done: it hashes every
file of the folder and writes the list as the folder's ``meta.json``, last and atomically
(:func:`~pipeline.durable.write_json_atomic`: temporary file, fsync, rename, folder fsync).
So a folder without a seal is incomplete, a folder whose seal does not verify was changed or
damaged, and one whose seal verifies holds exactly the bytes the tool wrote.

:func:`check_seal` treats the seal and the folder as hostile input: a size limit, strict
JSON (no key twice, so no file listed twice), exact fields, the schema named (a checkpoint of
this pipeline has a ``meta.json`` of its own, which is not a seal), at least one file, the
step of a ``checkpoint-N`` folder equal to N, names confined to the folder, every file present
listed and every listed file present, no link, then every byte hashed; every file is read
once from a descriptor of the folder (:mod:`pipeline.safe_read`: no link followed, no FIFO
waited on). :func:`verified_checkpoint` returns the newest ``checkpoint-N`` (Trainer) or
``checkpoint_N`` (accelerate) folder whose seal verifies, naming on stderr each newer one it
skipped and why (an OS error while checking one, a file pruned underneath, skips it too).
:func:`prune_checkpoints` deletes old sealed folders once a new one is sealed and its files
are durable, never before (a tool's own retention may delete before its new save is
complete). A seal detects an incomplete or changed folder; it does not say who wrote it
(docs/other-trainers.md). Torch-free.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..durable import fsync_dir, fsync_tree, json_loads_strict, remove_tree, write_json_atomic
from ..errors import FileChanged, FolderTooDeep, PipelineError, UnsealedCheckpoint, describe_os_error, shown
from ..layout import META_FILE
from ..safe_read import HandedFolder, Seen

__all__ = [
    "SEAL_SCHEMA",
    "check_seal",
    "check_seal_in",
    "checkpoint_number",
    "prune_checkpoints",
    "seal_checkpoint",
    "verified_checkpoint",
]

SEAL_SCHEMA = "pipeline.folder-seal/1"
_SEAL_KEYS = frozenset({"schema", "step", "files"})
_ENTRY_KEYS = frozenset({"sha256", "size"})
# A seal lists names and hashes: 16 MiB is hundreds of thousands of files.
_MAX_SEAL = 16 * 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Trainer's checkpoint-N and accelerate's checkpoint_N (automatic_checkpoint_naming).
_CHECKPOINT = re.compile(r"checkpoint[-_]([0-9]{1,18})")
# A checkpoint folder being pruned (renamed, then removed): a crash may leave one behind.
_PRUNED = re.compile(r"\.pruned-checkpoint[-_][0-9]{1,18}-[0-9a-f]{8}")
# The temporaries write_json_atomic leaves when killed before its rename; it removes them
# when it next writes the seal, so sealing must not list them.
# Exactly the names write_atomic gives its temporaries (eight hex digits): a user's
# ".meta.json.abc.tmp" is a file of the checkpoint like any other, sealed with it.
_SEAL_TEMPORARY = re.compile(re.escape(f".{META_FILE}.") + r"[0-9a-f]{8}\.tmp")


def checkpoint_number(name: str) -> int | None:
    """N of a Trainer ``checkpoint-N`` or accelerate ``checkpoint_N`` folder name; else None."""
    match = _CHECKPOINT.fullmatch(name)
    return int(match.group(1)) if match else None


def _listing(handed: HandedFolder) -> dict[str, os.stat_result]:
    """Every file under the folder but its top-level meta.json: relative POSIX path -> its
    ``lstat``; a link or special file anywhere is refused (it could point outside the folder)."""
    files = {}
    try:
        for name, info in handed.walk():
            if stat.S_ISDIR(info.st_mode):
                continue
            if not stat.S_ISREG(info.st_mode):
                raise UnsealedCheckpoint(
                    f"{shown(handed.path / name)} is a link or special file: a sealed folder holds plain files "
                    "and folders only"
                )
            if name != META_FILE:
                files[name] = info
    except FolderTooDeep as exc:
        raise UnsealedCheckpoint(str(exc)) from None
    return files


def _hash_files(handed: HandedFolder, files: dict[str, os.stat_result]) -> dict[str, str]:
    """SHA-256 of each file as listed, read from what was listed (same inode and size),
    several at a time (hashlib releases the GIL on large reads)."""

    def digest(name: str) -> str:
        with handed.open(name, seen=Seen.of(files[name])) as file:
            return file.sha256()

    names = sorted(files)
    workers = max(1, min(len(names), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(digest, names)))


def _unsealed(folder: Path) -> str:
    return (
        f"{shown(folder)} has no {META_FILE}: an unsealed folder (a save cut short, or one written before "
        "SealedCheckpoints; if you trust it, seal it with pipeline.integrations.seal.seal_checkpoint)"
    )


def _read_record(handed: HandedFolder) -> Any:
    """meta.json as strict JSON, within the size limit; UnsealedCheckpoint saying why not."""
    path = handed.path / META_FILE
    try:
        info = handed.lstat(META_FILE)
    except FileNotFoundError:
        raise UnsealedCheckpoint(_unsealed(handed.path)) from None
    if not stat.S_ISREG(info.st_mode):
        raise UnsealedCheckpoint(f"{shown(path)} is a link or special file, not a seal")
    if info.st_size > _MAX_SEAL:
        raise UnsealedCheckpoint(
            f"{shown(path)} is {info.st_size:,} bytes, over the {_MAX_SEAL:,}-byte limit of a seal"
        )
    with handed.open(META_FILE, seen=Seen.of(info)) as file:
        data = file.read()
    try:
        return json_loads_strict(data)
    except ValueError as exc:
        raise UnsealedCheckpoint(f"{shown(path)} is not a valid seal: {exc}") from None


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a file of the folder (a relative path confined to it), or None."""
    parts = name.split("/")
    if not name or not name.isprintable() or "\\" in name:
        return "is not a printable relative path"
    if any(part in ("", ".", "..") for part in parts):
        return "is not a plain relative path inside the folder (empty, '.' or '..' part)"
    if name == META_FILE:
        return "is the seal itself"
    return None


def _parse_seal(handed: HandedFolder) -> dict[str, Any]:
    path = handed.path / META_FILE
    record = _read_record(handed)
    schema = record.get("schema") if isinstance(record, dict) else None
    if schema != SEAL_SCHEMA:
        what = (
            "a checkpoint of this pipeline (the scripts read it with --checkpoint), not a sealed folder"
            if isinstance(schema, str) and schema.startswith("pipeline.checkpoint")
            else f"not a {SEAL_SCHEMA} seal"
        )
        raise UnsealedCheckpoint(f"{shown(path)}: {what}")
    if set(record) != _SEAL_KEYS:
        raise UnsealedCheckpoint(f"{shown(path)} must hold exactly {', '.join(sorted(_SEAL_KEYS))}")
    step = record["step"]
    if step is not None and not (type(step) is int and step >= 0):
        raise UnsealedCheckpoint(f"{shown(path)}: step must be a non-negative integer or null")
    number = checkpoint_number(handed.path.name)
    if step is not None and number is not None and step != number:
        raise UnsealedCheckpoint(
            f"{shown(path)} seals step {step}, but its folder is {handed.path.name}: the seal of another "
            "checkpoint (a folder renamed, or a seal copied)"
        )
    files = record["files"]
    if not isinstance(files, dict):
        raise UnsealedCheckpoint(f"{shown(path)}: files must map each file to its sha256 and size")
    if not files:
        raise UnsealedCheckpoint(f"{shown(path)} lists no file: a seal vouches for the files it lists")
    for name, entry in files.items():
        problem = _name_problem(name)
        if problem is not None:
            raise UnsealedCheckpoint(f"{shown(path)} lists '{shown(name)}', which {problem}")
        if not (
            isinstance(entry, dict)
            and set(entry) == _ENTRY_KEYS
            and isinstance(entry["sha256"], str)
            and _SHA256.fullmatch(entry["sha256"])
            and type(entry["size"]) is int
            and entry["size"] >= 0
        ):
            raise UnsealedCheckpoint(
                f"{shown(path)}: the entry of {name} must be exactly a lowercase hex sha256 and a size in bytes"
            )
    return record


def check_seal(folder: str | Path) -> dict[str, Any]:
    """Verify ``folder`` against its seal and return the seal, or raise
    :class:`~pipeline.errors.UnsealedCheckpoint` naming the first problem: no seal, a
    malformed one, a file missing, one not listed, a link, a size or SHA-256 that differs, a
    file that changed while it was checked. Every file is hashed; nothing is written. An
    ``OSError`` (the folder pruned underneath, a disk error) is raised as it is."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise UnsealedCheckpoint(f"{shown(folder)} is not a folder")
    try:
        with HandedFolder(folder) as handed:
            return check_seal_in(handed)
    except FileChanged as exc:
        raise UnsealedCheckpoint(
            f"{shown(exc.path)} changed while its seal was checked ({exc.reason})"
        ) from None


def check_seal_in(handed: HandedFolder) -> dict[str, Any]:
    """:func:`check_seal` of a folder already open (05 ``--from-folder`` reads the files it
    stages from the same descriptor). A file that changes while read raises
    :class:`~pipeline.errors.FileChanged`."""
    folder = handed.path
    seal = _parse_seal(handed)
    present = _listing(handed)
    listed = seal["files"]
    missing = sorted(set(listed) - set(present))
    if missing:
        raise UnsealedCheckpoint(f"{shown(folder / missing[0])} is listed in its seal but missing")
    extra = sorted(set(present) - set(listed))
    if extra:
        raise UnsealedCheckpoint(
            f"{shown(folder / extra[0])} is not listed in its seal: written after the seal, or left by an "
            "earlier save"
        )
    for name, info in sorted(present.items()):
        if info.st_size != listed[name]["size"]:
            raise UnsealedCheckpoint(
                f"{shown(folder / name)} is {info.st_size:,} bytes, its seal records {listed[name]['size']:,}: "
                "truncated or changed"
            )
    hashes = _hash_files(handed, present)
    for name in sorted(present):
        if hashes[name] != listed[name]["sha256"]:
            raise UnsealedCheckpoint(
                f"{shown(folder / name)}: SHA-256 differs from its seal: the file changed"
            )
    return seal


def _is_seal(path: Path) -> bool:
    try:
        with HandedFolder(path.parent) as handed:
            record = _read_record(handed)
    except (UnsealedCheckpoint, FileChanged, OSError):
        return False
    return isinstance(record, dict) and record.get("schema") == SEAL_SCHEMA


def seal_checkpoint(folder: str | Path, *, step: int | None = None) -> dict[str, Any]:
    """Seal ``folder`` once the tool that wrote it is done: hash every file, then write
    ``meta.json`` listing each one's SHA-256 and size (and ``step``, the training step it
    holds, if known) atomically, last. A previous seal is replaced; any other ``meta.json``
    is refused, never replaced. A link or special file anywhere in it is refused, and so is
    a folder holding no file. Returns the seal. The files themselves are not fsynced here (a
    seal that a power cut outlives its files simply no longer verifies); :func:`prune_checkpoints`
    fsyncs them before it deletes an older checkpoint."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise UnsealedCheckpoint(f"{shown(folder)} is not a folder: nothing to seal")
    if step is not None and not (type(step) is int and step >= 0):
        raise ValueError(f"step must be a non-negative integer or None, got {step!r}")
    number = checkpoint_number(folder.name)
    if step is not None and number is not None and step != number:
        raise ValueError(f"{shown(folder)} is the folder of step {number}, not of step {step}")
    path = folder / META_FILE
    if os.path.lexists(path) and not _is_seal(path):
        raise UnsealedCheckpoint(
            f"{shown(path)} exists and is not a {SEAL_SCHEMA} seal: refusing to replace it"
        )
    with HandedFolder(folder) as handed:
        files = {name: info for name, info in _listing(handed).items() if not _SEAL_TEMPORARY.fullmatch(name)}
        if not files:
            raise UnsealedCheckpoint(f"{shown(folder)} holds no file: nothing to seal")
        hashes = _hash_files(handed, files)
    record = {
        "schema": SEAL_SCHEMA,
        "step": step,
        "files": {name: {"sha256": hashes[name], "size": files[name].st_size} for name in sorted(files)},
    }
    write_json_atomic(path, record)
    return record


def _newest_first(parent: Path) -> list[tuple[int, str]]:
    """(number, name) of the checkpoint folders of ``parent``, highest number first."""
    numbered = [
        (int(m.group(1)), entry.name)
        for entry in parent.iterdir()
        if (m := _CHECKPOINT.fullmatch(entry.name))
    ]
    return sorted(numbered, reverse=True)


def prune_checkpoints(newest: str | Path, keep_last: int, *, protect: str | Path | None = None) -> list[str]:
    """Once ``newest`` (a ``checkpoint-N`` folder) is sealed, delete the sealed checkpoint
    folders beside it beyond the ``keep_last`` newest sealed ones up to ``newest`` (folders
    numbered above it, left by a run that was rolled back, are not counted nor touched; nor is
    ``protect``, e.g. the Trainer's best model). So an old checkpoint goes only after a new one
    is complete, verified and durable: before anything is deleted, ``newest`` must verify against
    its seal (else :class:`~pipeline.errors.UnsealedCheckpoint`, nothing deleted) and every file
    and folder of it is fsynced (:func:`~pipeline.durable.fsync_tree`), so a power cut that keeps
    the deletion keeps a checkpoint that verifies, even with ``keep_last=1``. Each is renamed to a hidden
    name (the rename made durable), then removed: a crash midway never leaves a half-deleted
    ``checkpoint-N``, and what a crash left hidden is removed first. A folder without a seal
    (not sealed here) is never touched. Returns the names removed."""
    newest = Path(os.path.abspath(newest))
    match = _CHECKPOINT.fullmatch(newest.name)
    if match is None or type(keep_last) is not int or keep_last < 1:
        raise ValueError(
            f"prune_checkpoints needs a checkpoint folder and keep_last >= 1, got {newest}, {keep_last!r}"
        )
    parent = newest.parent
    for entry in sorted(parent.iterdir()):
        if _PRUNED.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
    kept = {Path(os.path.abspath(protect)).name} if protect is not None else set()
    sealed = [
        name
        for number, name in _newest_first(parent)
        if number <= int(match.group(1)) and _is_seal(parent / name / META_FILE)
    ]
    victims = [name for name in sealed[keep_last:] if name not in kept]
    if victims:
        # Counted as sealed by its seal's schema alone: a file changed after the seal (a late
        # writer, another rank) would leave no checkpoint that verifies. So the new one is checked
        # in full first; and made durable, as the tool did not fsync its files, nor did the seal
        # (with keep_last=1, a power cut after a durable prune could leave none at all).
        try:
            check_seal(newest)
        except UnsealedCheckpoint as exc:
            raise UnsealedCheckpoint(f"{exc}; nothing was pruned: the older checkpoints stay") from None
        fsync_tree(newest)
    removed = []
    for name in victims:
        hidden = parent / f".pruned-{name}-{secrets.token_hex(4)}"
        os.rename(parent / name, hidden)
        fsync_dir(parent)
        remove_tree(hidden)
        removed.append(name)
    return removed


def verified_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest ``checkpoint-N`` / ``checkpoint_N`` folder of ``output_dir`` whose seal
    verifies (every file hashed), to pass as ``trainer.train(resume_from_checkpoint=...)``.

    Each newer folder that does not verify is named on stderr with the reason, and skipped:
    a seal that fails, and any ``OSError`` while checking it (a file pruned underneath by a
    rotation, a disk error). ``None`` when ``output_dir`` holds no checkpoint folder at all (a
    first run). When there are some but none verifies,
    :class:`~pipeline.errors.UnsealedCheckpoint` is raised rather than starting over
    silently; when none has a seal at all (a run from before ``SealedCheckpoints``), its
    message says how to seal one the user trusts (:func:`seal_checkpoint`)."""
    parent = Path(output_dir)
    if not parent.is_dir():
        return None
    skipped: list[tuple[str, str, bool]] = []
    for _, name in _newest_first(parent):
        try:
            check_seal(parent / name)
        except (PipelineError, OSError) as exc:
            # A refusal's message shows each name already; an OS error's path is shown here, once.
            reason = shown(describe_os_error(exc)) if isinstance(exc, OSError) else str(exc)
            print(f"verified_checkpoint: skipping {name}: {reason}", file=sys.stderr, flush=True)
            skipped.append((name, reason, not os.path.lexists(parent / name / META_FILE)))
            continue
        return parent / name
    if not skipped:
        return None
    newest, reason, _ = skipped[0]
    if all(unsealed for _, _, unsealed in skipped):
        raise UnsealedCheckpoint(
            f"no checkpoint in {shown(parent)} is sealed (the newest is {newest}): written before "
            "SealedCheckpoints, or every save was cut short; nothing was resumed. If you trust one, seal it "
            f"and resume from it: pipeline.integrations.seal.seal_checkpoint({str(parent / newest)!r}) "
            "(docs/other-trainers.md); otherwise move the folders away to start from scratch"
        )
    raise UnsealedCheckpoint(
        f"no checkpoint in {shown(parent)} has a seal that verifies (newest {newest}: {reason}); nothing was "
        "resumed: move those folders away to start from scratch"
    )

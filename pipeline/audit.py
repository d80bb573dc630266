"""Audit a built stage against its ``MANIFEST.sha256``, with no training stack imported.

Script 05 audits the stage it just built; the publish step audits it again right before
uploading and hands the hashes it returns to the upload, so no file is hashed twice. The
publish step's audit reads each byte once: the same chunks are hashed and scanned for leaks
(:mod:`pipeline.leaks`), and fed to any other digest the caller needs (the Xet hash, through
``pipeline.publishing.xet.XetDigest``), which is how a Xet upload is verified without
downloading it. Only hashing and JSON here: importing this module does not import torch or matplotlib.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

from .commands import step_command
from .durable import FolderLock
from .errors import StageAuditError, StageError
from .hashing import CHUNK, sha256_bytes, sha256_file
from .layout import CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, META_FILE, README_FILE, SIGNATURE_FILE
from .leaks import FileScan, LeakRules, allowance_problem, refuse_findings

__all__ = [
    "STAGE_SCHEMA",
    "AuditedFile",
    "audit_stage",
    "weight_files",
    "parse_manifest",
    "stage_lock",
    "stage_marker_problem",
    "format_audit_table",
]

STAGE_SCHEMA = "pipeline.stage/1"
# Files every stage must hold besides the manifest and the weights the index names.
REQUIRED_FILES = (META_FILE, README_FILE, CONFIG_FILE, INDEX_FILE)
_MAX_SMALL_FILE = 16 * 1024 * 1024
_MANIFEST_LINE = re.compile(r"^([0-9a-f]{64})  ([^\n]+)$")


@dataclass(frozen=True, slots=True)
class AuditedFile:
    """One file and its verified hash.

    ``name`` is the path relative to the stage (a plain file name), ``size`` in bytes,
    ``sha256`` lowercase hex of the bytes on disk when audited, ``verified_against`` says
    what that hash was checked against (for the audit table).
    """

    name: str
    size: int
    sha256: str
    verified_against: str
    xet_hash: str | None = None
    """The file's Xet hash (what the Hub lists as ``xetHash``), when the audit was asked for it."""
    allowed_leaks: tuple[str, ...] = ()
    """Leak-scan findings that ``card.allow_leaks`` allows in this file (their words, never a value)."""


# -- audit --------------------------------------------------------------------------------


def _plain_path(name: str) -> bool:
    """A relative POSIX path that stays inside the stage: no empty, '.' or '..' segment."""
    parts = name.split("/")
    return (
        name != MANIFEST_FILE
        and "\\" not in name
        and "\0" not in name
        and all(part not in ("", ".", "..") for part in parts)
    )


def _listed_files(stage: Path) -> list[str]:
    """Every file under ``stage`` as a relative POSIX path; links refused anywhere, and
    folders that hold no file (the Hub stores files, so such a folder would not be published)."""
    names = []
    for folder, dirs, files in os.walk(stage):
        for entry in sorted(dirs + files):
            path = Path(folder) / entry
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise StageAuditError(
                    f"{path} is a link or special file: a stage holds plain files and folders only"
                )
        if not dirs and not files and Path(folder) != stage:
            raise StageAuditError(
                f"{folder} is an empty folder that {MANIFEST_FILE} does not account for: the "
                "stage was modified after it was built"
            )
        names += [(Path(folder) / name).relative_to(stage).as_posix() for name in files]
    return sorted(names)


def parse_manifest(text: bytes, *, where: str = MANIFEST_FILE) -> dict[str, str]:
    """Strict ``sha256sum`` text format: one ``<64 lowercase hex>  <name>`` per line, each
    line ending in a newline, relative paths inside the stage (``code/…``), no duplicates."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError:
        raise StageAuditError(f"{where} is not UTF-8 text") from None
    if not decoded.endswith("\n"):
        raise StageAuditError(f"{where} is empty or its last line has no newline: the file is damaged")
    entries: dict[str, str] = {}
    for number, line in enumerate(decoded[:-1].split("\n"), start=1):
        match = _MANIFEST_LINE.match(line)
        if match is None:
            raise StageAuditError(f"{where} line {number} is not '<sha256>  <name>'")
        digest, name = match.groups()
        if not _plain_path(name):
            raise StageAuditError(
                f"{where} line {number} names {name!r}: a stage lists relative file paths only"
            )
        if name in entries:
            raise StageAuditError(f"{where} lists {name} twice")
        entries[name] = digest
    return entries


def _read_small(path: Path) -> bytes:
    if path.is_symlink() or not path.is_file():
        raise StageAuditError(f"{path} is missing or not a plain file")
    size = path.stat().st_size
    if size > _MAX_SMALL_FILE:
        raise StageAuditError(f"{path} is {size} bytes, over the {_MAX_SMALL_FILE}-byte limit for this file")
    return path.read_bytes()


def _read_json(path: Path) -> Any:
    raw = _read_small(path)  # its own error for a missing or oversize file, outside the JSON check
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise StageAuditError(f"{path} is not valid JSON") from None


def weight_files(stage_dir: str | Path) -> list[str]:
    """The weights files ``model.safetensors.index.json`` names, in order (one or shards)."""
    path = Path(stage_dir) / INDEX_FILE
    index = _read_json(path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise StageAuditError(f"{path} has no weight_map of tensor names to files")
    return sorted(set(weight_map.values()))


def _check_staged_meta(stage: Path, audited: Mapping[str, AuditedFile]) -> None:
    """The record's own files table must agree with what the manifest verified, and hold
    every weights file the index names."""
    path = stage / META_FILE
    meta = _read_json(path)
    if (
        not isinstance(meta, dict)
        or meta.get("schema") != STAGE_SCHEMA
        or not isinstance(meta.get("files"), dict)
    ):
        raise StageAuditError(f"{path} is not a {STAGE_SCHEMA} record")
    for name in weight_files(stage):
        if name not in meta["files"]:
            raise StageAuditError(f"{stage / INDEX_FILE} names {name}, which {path} does not record")
    for name, entry in sorted(meta["files"].items()):
        held = audited.get(name)
        if held is None:
            raise StageAuditError(f"{path} records {name}, which the stage does not hold")
        if (
            not isinstance(entry, dict)
            or entry.get("sha256") != held.sha256
            or entry.get("size") != held.size
        ):
            raise StageAuditError(
                f"{path} records a different SHA-256 or size for {name} than the stage holds"
            )


class SideDigest(Protocol):
    """Another digest of the audited bytes, fed the same chunks as the SHA-256."""

    def update(self, data: bytes | memoryview) -> None: ...

    def hexdigest(self) -> str | None: ...


def _read_once(path: Path, scan: FileScan | None, side: SideDigest | None) -> tuple[str, str | None]:
    """SHA-256 of ``path`` and the ``side`` digest of the same bytes (ended even on a failure)."""
    try:
        digest = _read_and_feed(path, scan, side)
    finally:
        other = side.hexdigest() if side is not None else None
    return digest, other


def _read_and_feed(path: Path, scan: FileScan | None, side: SideDigest | None) -> str:
    """SHA-256 of ``path``, each chunk also fed to ``scan`` and ``side``: hashlib releases the
    GIL, so a helper thread hashes one chunk while this one scans it and reads the next."""
    if scan is None and side is None:
        return sha256_file(path)
    digest = hashlib.sha256()
    size = path.stat().st_size
    if size < CHUNK:  # one read: nothing to overlap
        data = path.read_bytes()
        digest.update(data)
        if scan is not None:
            scan.feed(data, len(data))
        if side is not None:
            side.update(data)
        return digest.hexdigest()
    buffers = (bytearray(min(CHUNK, size + 1)), bytearray(min(CHUNK, size + 1)))
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(1) as hasher:
        hashing: Future | None = None
        for turn in itertools.count():
            buffer = buffers[turn % 2]  # the other one may still be hashed
            n = handle.readinto(buffer)
            if hashing is not None:
                hashing.result()
            if not n:
                break
            hashing = hasher.submit(digest.update, memoryview(buffer)[:n])
            if scan is not None:
                scan.feed(buffer, n)
            if side is not None:
                side.update(memoryview(buffer)[:n])
    return digest.hexdigest()


def _side_digest(side: SideDigest | None, data: bytes) -> str | None:
    if side is None:
        return None
    side.update(data)
    return side.hexdigest()


def _allowance(stage: Path) -> Mapping[str, Any]:
    """``card.allow_leaks`` as 05 recorded it in the staged meta.json (already verified by the audit)."""
    meta = _read_json(stage / META_FILE)
    config = meta.get("config") if isinstance(meta, dict) else None
    card = config.get("card") if isinstance(config, dict) else None
    allow = card.get("allow_leaks", {}) if isinstance(card, dict) else {}
    problem = allowance_problem(allow)
    if problem is not None:
        raise StageAuditError(f"{stage / META_FILE} records a card.allow_leaks that {problem}")
    return allow


def audit_stage(
    stage_dir: str | Path,
    *,
    leaks: LeakRules | None = None,
    xet_digest: Callable[[], SideDigest | None] | None = None,
    consequence: str = "nothing was staged",
) -> dict[str, AuditedFile]:
    """Verify a stage against its ``MANIFEST.sha256`` and return every file to upload.

    Checks: the folder holds exactly the files the manifest lists plus the manifest itself
    (no extras, none missing, no links; subfolders only for listed files such as ``code/…``;
    ``model.sig`` may be there unlisted, as the signature covers the manifest); each file's
    SHA-256 equals the manifest's; ``meta.json``, ``README.md``, ``config.json`` and
    ``model.safetensors.index.json`` are present; and the ``files`` table inside
    ``meta.json`` agrees with the manifest and holds every weights file the index names.

    With ``leaks``, every file is also scanned (:mod:`pipeline.leaks`) in the same read, and
    a leak that the staged ``card.allow_leaks`` does not allow raises
    :class:`~pipeline.errors.SecretInStage` ending with ``consequence``. ``xet_digest`` makes a
    digest per file (or None) that the same read feeds: ``AuditedFile.xet_hash``, None where unknown.

    Returns ``{name: AuditedFile}`` sorted by name, *including* ``MANIFEST.sha256`` (hashed
    from the bytes the audit parsed). The keys are exactly the files to upload, and each
    ``sha256`` was computed from the file on disk during this call, so an uploader can pass
    them on instead of hashing again. Hold :func:`stage_lock` from the audit to the end of
    the upload so the stage cannot be rebuilt in between. Raises :class:`StageAuditError`
    naming the offending file; reads only.
    """
    stage = Path(stage_dir)
    if stage.is_symlink() or not stage.is_dir():
        raise StageAuditError(f"{stage} is not a stage folder: run {step_command('05_stage.py')}")
    manifest_path = stage / MANIFEST_FILE
    if not manifest_path.exists():
        raise StageAuditError(
            f"{manifest_path} is missing: {stage}/ is not a stage built by {step_command('05_stage.py')}"
        )
    raw = _read_small(manifest_path)
    expected = parse_manifest(raw, where=str(manifest_path))
    for name in _listed_files(stage):
        if name not in (MANIFEST_FILE, SIGNATURE_FILE) and name not in expected:
            raise StageAuditError(
                f"{stage / name} is not listed in {MANIFEST_FILE}: the stage was modified after it was built"
            )
    for name in sorted(expected):
        if not (stage / name).is_file():
            raise StageAuditError(f"{stage / name} is listed in {MANIFEST_FILE} but missing")
    for name in REQUIRED_FILES:
        if name not in expected:
            raise StageAuditError(f"{manifest_path} does not list {name}: not a complete stage")
    names = sorted(expected)
    sizes = {name: (stage / name).stat().st_size for name in names}
    scans = {name: FileScan(leaks, size=sizes[name]) for name in names} if leaks is not None else {}
    signature = stage / SIGNATURE_FILE

    def side() -> SideDigest | None:
        return xet_digest() if xet_digest is not None else None

    # hashlib releases the GIL on large buffers, so threads hash several files on several cores.
    # Largest first: the longest hash (the weights') starts at once, the small files beside it.
    largest_first = sorted(names, key=lambda name: -sizes[name])
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        read = dict(
            zip(
                largest_first,
                pool.map(lambda name: _read_once(stage / name, scans.get(name), side()), largest_first),
            )
        )
    hashes = {name: sha for name, (sha, _) in read.items()}
    xet_hash = {name: other for name, (_, other) in read.items()}
    audited: dict[str, AuditedFile] = {}
    for name in names:
        digest, path = expected[name], stage / name
        size = path.stat().st_size
        actual = hashes[name]
        if actual != digest:
            raise StageAuditError(
                f"{path} SHA-256 differs from {MANIFEST_FILE}: the file was modified after staging"
            )
        audited[name] = AuditedFile(name, size, actual, MANIFEST_FILE, xet_hash.get(name))
    _check_staged_meta(stage, audited)
    audited[MANIFEST_FILE] = AuditedFile(
        MANIFEST_FILE, len(raw), sha256_bytes(raw), "parsed by the audit", _side_digest(side(), raw)
    )
    extra = {MANIFEST_FILE: raw}
    if signature.is_file():
        # The signature covers the manifest, so the manifest cannot list it (pipeline/signing.py).
        data = extra[SIGNATURE_FILE] = _read_small(signature)
        audited[SIGNATURE_FILE] = AuditedFile(
            SIGNATURE_FILE,
            len(data),
            sha256_bytes(data),
            "model-signing (checked by 06)",
            _side_digest(side(), data),
        )
    if leaks is not None:
        for name, data in extra.items():
            scans[name] = FileScan(leaks, size=len(data))
            scans[name].feed(data, len(data))
        allowed = refuse_findings(
            {name: scan.found for name, scan in scans.items() if scan.found},
            _allowance(stage),
            consequence=consequence,
        )
        for name, words in allowed:
            audited[name] = replace(audited[name], allowed_leaks=audited[name].allowed_leaks + (words,))
    return dict(sorted(audited.items()))


def stage_marker_problem(stage_dir: str | Path) -> str | None:
    """``None`` if ``stage_dir`` carries the marker of a stage built by script 05, else why not.

    The marker is the staged ``meta.json`` itself: a ``pipeline.stage/1`` record naming its
    source checkpoint, listed with its SHA-256 in a ``MANIFEST.sha256`` that parses. A
    folder that merely holds a file called ``MANIFEST.sha256`` (a user's own ``sha256sum``
    release folder) has no such record, so 05 never replaces it. Only the marker is checked:
    a stage whose card was edited afterwards is still ours to replace. Reads only.
    """
    stage = Path(stage_dir)
    manifest_path, meta_path = stage / MANIFEST_FILE, stage / META_FILE
    try:
        if stage.is_symlink() or not stage.is_dir():
            return "it is not a folder"
        if not manifest_path.exists():
            return f"it holds no {MANIFEST_FILE}"
        expected = parse_manifest(_read_small(manifest_path), where=str(manifest_path))
        if META_FILE not in expected:
            return f"its {MANIFEST_FILE} does not list {META_FILE}"
        if sha256_file(meta_path) != expected[META_FILE]:
            return f"its {META_FILE} differs from the SHA-256 in {MANIFEST_FILE}"
        meta = _read_json(meta_path)
    except (StageAuditError, OSError) as exc:
        return str(exc)
    source = meta.get("source_checkpoint") if isinstance(meta, dict) else None
    if (
        meta.get("schema") != STAGE_SCHEMA
        or not isinstance(source, dict)
        or not isinstance(source.get("folder"), str)
    ):
        return f"its {META_FILE} is not a {STAGE_SCHEMA} record naming a source checkpoint"
    return None


@contextlib.contextmanager
def stage_lock(stage_dir: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<stage>.lock`` beside the stage. 05 holds it while
    building; the publish step holds it from :func:`audit_stage` to the end of its upload.

    Not the stage folder itself (05 replaces it by rename, so a second process would lock
    the new folder) and not the parent folder (the repository root by default, which other
    tools may lock). The small lock file stays: deleting it would let two processes lock two
    different files of the same name."""
    stage = Path(os.path.abspath(stage_dir))
    stage.parent.mkdir(parents=True, exist_ok=True)

    def busy(holder: str) -> StageError:
        return StageError(
            f"{stage_dir} is being staged or published by another process (pid {holder}); "
            "wait for it to finish"
        )

    with FolderLock(stage.parent / f".{stage.name}.lock", busy):
        yield


def format_audit_table(rows: Iterable[AuditedFile]) -> str:
    """Aligned text table: file, bytes, SHA-256, verified against."""
    rows = list(rows)
    width = max([len("file"), *(len(row.name) for row in rows)])
    size_width = max([len("bytes"), *(len(str(row.size)) for row in rows)])
    lines = [f"{'file':<{width}}  {'bytes':>{size_width}}  {'SHA-256':<64}  verified against"]
    lines += [
        f"{row.name:<{width}}  {row.size:>{size_width}}  {row.sha256:<64}  {row.verified_against}"
        for row in rows
    ]
    return "\n".join(lines)

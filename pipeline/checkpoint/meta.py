"""THE ``meta.json`` of a checkpoint: its fields, built, sealed, written, read and checked here.

Every writer of a checkpoint (the single-process store, the torchrun commit) hands its
parts to :func:`build_meta` and writes the result with :func:`write_meta`; every reader
goes through :func:`read_meta`, then :func:`check_listing` (the folder against the
``files`` table, short of hashing). :data:`FIELDS` and :data:`FILE_FIELDS` describe each
key; docs/format.md shows the same tables (a test holds them equal).

The ``files`` table gives each file's whole SHA-256 (what ``sha256sum`` prints) and, from
schema 3 on, the SHA-256 of each ``chunk_size`` piece of it (the writer picks the size per
file, :func:`~pipeline.hashing.chunk_size_for`), which a load verifies on every core
(docs/format.md, "Why chunk digests").
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Mapping

from ..durable import json_bytes, json_loads_strict
from ..errors import SEALED_BUT_UNFIT, ChecksumMismatch, InternalError, SchemaMismatch
from ..hashing import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, ChunkDigests, HashingWriter, chunk_size_for
from ..layout import META_FILE, MODEL_FILE, STATE_FILE, parse_step_dir
from ..safe_read import read_own
from .shards import check_launch_record

__all__ = [
    "SCHEMA_VERSION",
    "DIST_SCHEMA",
    "DIST_SCHEMAS",
    "FIELDS",
    "FILE_FIELDS",
    "META_KEYS",
    "DIST_META_KEYS",
    "SEAL_KEY",
    "LINEAGE_KEYS",
    "build_meta",
    "file_entry",
    "entry_of",
    "meta_sha256",
    "write_meta",
    "read_meta",
    "is_distributed",
    "check_listing",
]

SCHEMA_VERSION = "pipeline.checkpoint/3"
# Schema 2: the same record, each file with its whole SHA-256 only (no chunk table); still
# read, and verified as written (one digest per file).
_WHOLE_FILE_SCHEMAS = ("pipeline.checkpoint/2",)
# A torchrun checkpoint (pipeline.distributed): the same sealed meta.json, files table and
# readers, plus the launch that wrote it and every tensor's full shape (see ``shards``).
DIST_SCHEMA = "pipeline.checkpoint.distributed/3"
# Distributed schema 2: the same, each file with its whole SHA-256 only; still read, and
# verified as written (one digest per file).
_WHOLE_FILE_DIST_SCHEMAS = ("pipeline.checkpoint.distributed/2",)
DIST_SCHEMAS = (DIST_SCHEMA, *_WHOLE_FILE_DIST_SCHEMAS)
# Schema 1 had no meta_sha256: its meta.json (optimizer groups, sampler cursor, RNG
# states) was covered by no hash, so a bit flip that kept it valid JSON went unnoticed.
_UNSEALED_SCHEMAS = ("pipeline.checkpoint/1",)
SEAL_KEY = "meta_sha256"
CHECKPOINT_FILES = (MODEL_FILE, STATE_FILE)

FIELDS: dict[str, str] = {
    "schema": "`pipeline.checkpoint/3` (`pipeline.checkpoint.distributed/3` under torchrun); "
    "`pipeline.checkpoint/2` and `pipeline.checkpoint.distributed/2`, the same without chunk "
    "digests, are still read",
    "step": "the global step; equals the folder's number",
    "created": "UTC time of the save, ISO 8601, seconds",
    "config": "the full config the run trains with",
    "fingerprints": "`data` (the prepared data's manifest), `code`, `factories`, `sources` "
    "(`{file: sha256}` of every source file that counts)",
    "versions": "Python, torch, NumPy, safetensors, …",
    "device": "the device the run trained on",
    "environment": "thread counts, determinism switches, device type, torch/NumPy, and any accepted `changes`",
    "model": "stored tensor names, dtypes and shapes, tied aliases, parameter count, `derived_buffers`",
    "training_state": "the JSON part of the training state: optimizer param groups, scheduler, sampler "
    "position, RNG states, scaler, progress; tensors are referenced by name "
    '(`{"__tensor__": "optimizer/state/0/exp_avg"}`)',
    "lineage": "one entry per `--extend-to`, oldest first: `from_max_steps`, `at_step`, `to_max_steps` "
    "(`[]` if never extended; read as `[]` from a checkpoint written before the key existed)",
    "files": "`{name: entry}` of every other file of the folder (entry: the table below)",
    SEAL_KEY: "the seal: SHA-256 of everything above",
}
FILE_FIELDS: dict[str, str] = {
    "sha256": "SHA-256 of the whole file, as `sha256sum` prints it",
    "size": "its size in bytes",
    "chunk_size": f"bytes per chunk, chosen per file by the writer: the smallest power of two from "
    f"{MIN_CHUNK_SIZE} (4 MiB) to {MAX_CHUNK_SIZE} (64 MiB) that cuts the file into at most 64 chunks; "
    "a reader takes any positive size; schema 3 only (both kinds)",
    "chunk_sha256": "SHA-256 of each `chunk_size` piece of the file in order, the last one shorter: "
    "exactly ceil(size / chunk_size) digests; schema 3 only (both kinds)",
}
META_KEYS = frozenset(FIELDS)
# One entry of meta.json "lineage" per --extend-to, oldest first: the run's max_steps before
# and after, and the step it was extended at.
LINEAGE_KEYS = frozenset({"from_max_steps", "at_step", "to_max_steps"})
DIST_META_KEYS = META_KEYS | {"parallel", "tensors", "resharded_from"}
# Made by build_meta from its arguments; the caller's part is everything else.
_BUILT_KEYS = frozenset({"schema", "step", "files", SEAL_KEY})
_WHOLE_ENTRY = frozenset({"sha256", "size"})
_CHUNKED_ENTRY = frozenset(FILE_FIELDS)
_SHA256 = re.compile(r"[0-9a-f]{64}")
# meta.json is parsed before anything is trusted; a bound keeps a hostile file from
# exhausting memory.
MAX_META_BYTES = 64 * 1024 * 1024
# meta.json bytes that passed _sealed_meta (a resume reads its meta.json twice: to build the
# run, then to load into it). Keyed by the bytes themselves, so no edit can hit it; the
# byte-level checks are most of a small checkpoint's load time (the Python JSON encoder).
_SEALED_BYTES: dict[bytes, None] = {}
_SEALED_BYTES_MAX = 1024 * 1024
_SEALED_BYTES_KEPT = 8


# -- building and writing ------------------------------------------------------------------


def file_entry(
    sha256: str, size: int, chunks: list[str] | None = None, chunk_size: int | None = None
) -> dict:
    """One ``files`` entry: whole digest and size, and the chunk table (``chunks`` of
    ``chunk_size`` bytes each) when given."""
    entry: dict[str, Any] = {"sha256": sha256, "size": size}
    if chunks is not None:
        if chunk_size is None:
            raise InternalError("a chunk table needs its chunk size")
        entry.update(chunk_size=chunk_size, chunk_sha256=list(chunks))
    return entry


def entry_of(data: bytes | memoryview, chunk_size: int | None = None) -> dict:
    """The ``files`` entry a save records for a file of these bytes (for a tool that writes
    a checkpoint's file by other means, then seals it); ``chunk_size``: the save's own
    choice (:func:`~pipeline.hashing.chunk_size_for`) unless given."""
    chunk_size = chunk_size_for(len(data)) if chunk_size is None else chunk_size
    table = ChunkDigests(chunk_size)
    table.update(data)
    return file_entry(hashlib.sha256(data).hexdigest(), len(data), table.hexdigests(), chunk_size)


def build_meta(
    parts: Mapping[str, Any], *, step: int, files: Mapping[str, Mapping[str, Any]], distributed: bool = False
) -> dict[str, Any]:
    """The sealed record of a checkpoint: ``parts`` (everything the writer knows: config,
    fingerprints, state, …) with the schema, the step, the files table and the seal. An
    internal error if the keys are not exactly the schema's."""
    if set(parts) & _BUILT_KEYS:
        raise InternalError(f"meta.json parts set keys build_meta owns: {sorted(set(parts) & _BUILT_KEYS)}")
    record = {
        **parts,
        "schema": DIST_SCHEMA if distributed else SCHEMA_VERSION,
        "step": step,
        "files": {name: dict(entry) for name, entry in files.items()},
    }
    keys = DIST_META_KEYS if distributed else META_KEYS
    if set(record) | {SEAL_KEY} != keys:
        raise InternalError(f"checkpoint meta keys differ: {sorted((set(record) | {SEAL_KEY}) ^ keys)}")
    if not _files_ok(record["files"], record["schema"]) or any(
        _chunk_table_fault(entry) for entry in record["files"].values()
    ):
        raise InternalError(f"checkpoint files table is malformed: {record['files']}")
    return {**record, SEAL_KEY: meta_sha256(record)}


def write_meta(temporary: Path, record: Mapping[str, Any]) -> None:
    """Write a record from :func:`build_meta` as ``meta.json``, last: its presence marks a
    complete folder (fsynced by the writer; the folder's commit makes the name durable)."""
    if record.get(SEAL_KEY) != meta_sha256(record):
        raise InternalError("meta.json record is not sealed: build it with build_meta")
    with HashingWriter(temporary / META_FILE) as out:
        out.write(json_bytes(record))


def meta_sha256(record: Mapping[str, Any]) -> str:
    """The seal of a checkpoint's ``meta.json``: SHA-256 of its canonical JSON without the
    ``meta_sha256`` key (sorted keys, no spaces, UTF-8, no NaN). The README shows the same
    three lines; ``ValueError`` if the record holds a non-finite float."""
    body = {key: value for key, value in record.items() if key != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- reading and checking ------------------------------------------------------------------


def is_distributed(meta: Mapping[str, Any]) -> bool:
    """Whether a meta.json returned by :func:`read_meta` is a torchrun checkpoint's."""
    return meta["schema"] in DIST_SCHEMAS


def _chunk_table_fault(entry: Mapping[str, Any]) -> str | None:
    """Why a schema-3 entry's chunk table does not tile the file exactly, or None. The table
    is a chunk size and one digest per chunk, so chunk k is bytes [k*size, (k+1)*size) of
    the file: no overlap or gap can be written; what can be wrong is checked here."""
    chunk_size, digests, size = entry["chunk_size"], entry["chunk_sha256"], entry["size"]
    if type(chunk_size) is not int or chunk_size < 1:
        return f"chunk_size {chunk_size!r} is not a positive integer"
    if not isinstance(digests, list) or not all(isinstance(d, str) and _SHA256.fullmatch(d) for d in digests):
        return "chunk_sha256 is not a list of SHA-256 digests"
    if len(digests) != -(-size // chunk_size):
        return (
            f"{len(digests)} chunk digests do not cover {size} bytes in chunks of {chunk_size} "
            f"(that takes {-(-size // chunk_size)})"
        )
    if len(digests) == 1 and digests[0] != entry["sha256"]:
        # One chunk is the whole file: its two digests are of the same bytes.
        return "its one chunk's digest differs from the file's"
    return None


def _files_ok(files: Any, schema: str) -> bool:
    entry_keys = (
        _WHOLE_ENTRY if schema in (*_WHOLE_FILE_SCHEMAS, *_WHOLE_FILE_DIST_SCHEMAS) else _CHUNKED_ENTRY
    )
    if not isinstance(files, dict) or not all(
        isinstance(e, dict)
        and set(e) == entry_keys
        and isinstance(e["sha256"], str)
        and _SHA256.fullmatch(e["sha256"]) is not None
        and type(e["size"]) is int
        and e["size"] >= 0
        for e in files.values()
    ):
        return False
    if schema not in DIST_SCHEMAS:
        return set(files) == set(CHECKPOINT_FILES)
    # Relative safetensors paths inside the folder, nothing else (no "..", no absolute path).
    return STATE_FILE in files and all(
        isinstance(name, str)
        and name.endswith(".safetensors")
        and name.count("/") <= 1
        and all(part not in ("", ".", "..") for part in name.split("/"))
        for name in files
    )


def read_meta(folder: Path) -> dict[str, Any]:
    """THE reader of a checkpoint's ``meta.json``: parse, check the schema and the seal,
    and the fields every later step relies on, before anything in it is used.

    The seal covers every value; the file must also be byte for byte what the pipeline
    writes, so that no change to the bytes (even one that decodes to the same values,
    such as another spelling of a float) passes.
    """
    path = folder / META_FILE
    # Opened once, not following a link, and read from what was opened: a FIFO or a link
    # swapped in after a look at the name would hang the reader or be read in its place.
    try:
        raw = read_own(path, MAX_META_BYTES)
    except FileNotFoundError:
        raise SchemaMismatch(f"{path} is missing: not a committed checkpoint") from None
    except ValueError as what:
        raise SchemaMismatch(f"{path} {what}: not a meta.json the pipeline wrote") from None
    if raw in _SEALED_BYTES:
        meta = json.loads(raw)  # these very bytes passed the byte-level checks before
    else:
        meta = _sealed_meta(path, folder, raw)
        if len(raw) <= _SEALED_BYTES_MAX:
            _SEALED_BYTES[raw] = None
            while len(_SEALED_BYTES) > _SEALED_BYTES_KEPT:
                del _SEALED_BYTES[next(iter(_SEALED_BYTES))]
    distributed = meta["schema"] in DIST_SCHEMAS
    keys = DIST_META_KEYS if distributed else META_KEYS
    if set(meta) == keys - {"lineage"}:
        meta["lineage"] = []  # written before runs could be extended (same schema): never extended
    if set(meta) != keys:
        odd = sorted(set(meta) ^ keys)
        raise SchemaMismatch(
            f"{path} has unexpected or missing fields ({', '.join(odd)}): {SEALED_BUT_UNFIT}"
        )
    if not _files_ok(meta["files"], meta["schema"]):
        raise SchemaMismatch(f"{path} has a malformed files table: {SEALED_BUT_UNFIT}")
    if meta["schema"] in (SCHEMA_VERSION, DIST_SCHEMA):
        for name, entry in sorted(meta["files"].items()):
            fault = _chunk_table_fault(entry)
            if fault is not None:
                raise SchemaMismatch(
                    f"{path}: the chunk table of {name} is malformed ({fault}): {SEALED_BUT_UNFIT}"
                )
    if type(meta["step"]) is not int or parse_step_dir(folder.name) != meta["step"]:
        raise SchemaMismatch(f"{path} records step {meta['step']!r} but the folder is {folder.name}")
    _check_lineage(path, meta["lineage"], meta["step"])
    if distributed:
        check_launch_record(path, meta)
    return meta


def _sealed_meta(path: Path, folder: Path, raw: bytes) -> dict[str, Any]:
    """``meta.json``'s bytes parsed strictly, of a schema this version reads, sealed, and
    exactly what the pipeline writes: the checks of :func:`read_meta` on the bytes alone."""
    try:
        meta = json_loads_strict(raw)
    except ValueError as exc:
        raise SchemaMismatch(
            f"{path} is not valid JSON ({str(exc).splitlines()[0]}): the file is damaged"
        ) from None
    if not isinstance(meta, dict):
        raise SchemaMismatch(f"{path} is not a JSON object: the file is damaged")
    schema = meta.get("schema")
    if schema in _UNSEALED_SCHEMAS:
        raise SchemaMismatch(
            f"{path} has schema {schema!r}, which predates the meta.json checksum "
            f"({SEAL_KEY}), so its training state cannot be verified and is not loaded; "
            f"start a new run from its weights with --init-from {folder / MODEL_FILE}"
        )
    if schema not in (SCHEMA_VERSION, *_WHOLE_FILE_SCHEMAS, *DIST_SCHEMAS):
        raise SchemaMismatch(
            f"{path} has schema {schema!r}, this version reads {SCHEMA_VERSION!r}: "
            "the checkpoint comes from another tool or version and is not loaded"
        )
    try:
        sealed, exact = meta.get(SEAL_KEY) == meta_sha256(meta), raw == json_bytes(meta)
    except RecursionError:  # parsed, but too deep to encode again: no writer of ours made it
        raise SchemaMismatch(f"{path} is nested too deeply: the file is damaged") from None
    if not sealed:
        raise ChecksumMismatch(
            f"{path}: {SEAL_KEY} does not match its content: the file is damaged or was edited"
        )
    if not exact:
        raise ChecksumMismatch(f"{path} is not byte for byte what the pipeline wrote: the file was modified")
    return meta


def _check_lineage(path: Path, lineage: Any, step: int) -> None:
    """Each extension starts where the previous one ended, raises max_steps, and happened
    at or before this checkpoint's step."""
    previous = None
    for entry in lineage if isinstance(lineage, list) else [None]:
        if not (
            isinstance(entry, dict)
            and set(entry) == LINEAGE_KEYS
            and all(type(v) is int for v in entry.values())
            and 0 <= entry["at_step"] <= step
            and entry["at_step"] < entry["to_max_steps"]
            and 1 <= entry["from_max_steps"] < entry["to_max_steps"]
            and (
                previous is None
                or (
                    entry["from_max_steps"] == previous["to_max_steps"]
                    and entry["at_step"] >= previous["at_step"]
                )
            )
        ):
            raise SchemaMismatch(
                f"{path} has a malformed lineage entry ({str(entry)[:120]}): {SEALED_BUT_UNFIT}"
            )
        previous = entry


def check_listing(folder: Path, meta: dict[str, Any]) -> None:
    """The checks short of hashing: no stray file, none missing, every size right (cheap,
    and catches truncation before a long hash)."""
    listed = set(meta["files"]) | {META_FILE}
    # A distributed checkpoint nests its shards one level down (model/, optim/, rng/).
    folders = {name.rsplit("/", 1)[0] for name in listed if "/" in name}
    present = {p.relative_to(folder).as_posix() for p in folder.iterdir()}
    present |= {
        p.relative_to(folder).as_posix()
        for sub in sorted(folders)
        if (folder / sub).is_dir() and not (folder / sub).is_symlink()
        for p in (folder / sub).iterdir()
    }
    unexpected = sorted(present - listed - folders)
    if unexpected:
        raise ChecksumMismatch(
            f"{folder / unexpected[0]} is not listed in meta.json: the folder was modified"
        )
    for name, entry in sorted(meta["files"].items()):
        path = folder / name
        if not path.is_file():
            raise ChecksumMismatch(f"{path} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ChecksumMismatch(
                f"{path} is {size} bytes, meta.json records {entry['size']}: "
                "the file is truncated or was modified"
            )

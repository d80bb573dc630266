"""Read a model folder that another tool wrote, strictly, for 05 ``--from-folder``.

:func:`survey_folder` sorts out what the folder holds before any file is read, refusing what
cannot be staged: an empty folder, a link anywhere in it, weights that exist only as a pickle
(never opened: loading one runs code), no weights or several without an index, no
``config.json``. It notes what it saw of each file (device, inode, size). :func:`read_folder`
then reads what is staged, each file once, from a descriptor of the folder
(:mod:`pipeline.safe_read`): opened without following a link or waiting on a FIFO, checked to
be the very file surveyed, read within its size; a file swapped in between is refused
("changed while it was staged"). Each is hashed as read:

- a ``meta.json`` must be a seal (:mod:`pipeline.integrations.seal`) that verifies in full, and
  every file read must still be the sealed bytes;
- the weights (``model.safetensors``, the shards a ``model.safetensors.index.json`` names, or
  the folder's one ``*.safetensors``) are copied into a private scratch folder, hashed while
  copied, re-hashed from disk and parsed by the strict safetensors parser; a sharded index must
  name files present, each tensor held by exactly the shard it names. Every later read is of
  the copies, one tensor at a time;
- ``config.json`` (strict JSON, its ``architectures`` plain class names) and the tokenizer and
  generation files are kept as bytes, staged byte for byte.

The training state (``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``training_args.bin``,
``trainer_state.json``) and anything else is left where it is, never opened. Warnings, for the
script's ``warning:`` lines: a checkpoint-like folder that carries no seal, and a staged file
with other hard links (its bytes may also be reachable from outside the folder).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointWeights, MappedTensors
from ..durable import json_loads_strict
from ..errors import FileChanged, FolderTooDeep, SchemaMismatch, StageError, UnsealedCheckpoint, shown
from ..hashing import HashingWriter, sha256_bytes, sha256_file
from ..integrations.seal import check_seal_in, checkpoint_number
from ..layout import CONFIG_FILE, GENERATION_CONFIG_FILE, HUB_MODEL_FILE, INDEX_FILE, META_FILE
from ..safe_read import HandedFile, HandedFolder, Seen
from ..safetensors_header import MAX_HEADER, parse_header

__all__ = ["CARRIED_FILES", "FolderInventory", "FolderSource", "json_object", "read_folder", "survey_folder"]

# Files that come along with the weights: generation settings and the tokenizer's files.
CARRIED_FILES = (
    GENERATION_CONFIG_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
# The training state Trainer and accelerate write beside the weights: never opened, never staged.
_TRAINING_STATE = re.compile(
    r"(optimizer|scheduler|scaler|sampler)(_\d+)?\.(pt|bin)|rng_state.*\.pth|random_states_\d+\.pkl"
    r"|training_args\.bin|trainer_state\.json"
)
_PICKLE = re.compile(r".+\.(bin|pt|pth|ckpt|pkl|pickle)")
_WEIGHTS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# config.json, an index, a tokenizer: read whole. A tokenizer.json of a large vocabulary is tens of MB.
_MAX_SMALL_FILE = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FolderInventory:
    """What the folder holds, sorted out before any file is read."""

    folder: Path
    weights: tuple[str, ...]
    """The safetensors files to read (one, or the shards the index names)."""
    index: str | None
    """The folder's ``model.safetensors.index.json`` when the weights are sharded."""
    carried: tuple[str, ...]
    """``config.json`` and the tokenizer and generation files present, staged byte for byte."""
    left_out: tuple[str, ...]
    """Everything else at the top of the folder (a folder's name ends in ``/``), the shards
    included until the index naming them is read: see :attr:`FolderSource.left_out`."""
    seen: dict[str, Seen]
    """What the survey saw of the folder (under ``"."``) and of each regular file at its top."""
    checkpoint_like: str | None
    """Why the folder looks like a trainer's checkpoint (its name, its training state), if it does."""


# -- what the folder holds -------------------------------------------------------------------


def _refuse_links(folder: Path, listing: dict[str, os.stat_result]) -> None:
    """No link anywhere in the folder: every file is read from the folder's own descriptor,
    never through a link (one out of it could stage any file)."""
    for name, info in listing.items():
        if stat.S_ISLNK(info.st_mode):
            path = folder / name
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise StageError(
                f"{shown(path)} is a link to {shown(target)}: 05 reads the folder's plain files only, never through "
                "a link; copy the files into a folder (cp -rL) and stage the copy; nothing was staged"
            )


def _pickle_refusal(folder: Path, name: str) -> StageError:
    return StageError(
        f"{shown(folder / name)} is a pickle, and pickles are never loaded here (loading one runs code): convert "
        "the model where you trust it, e.g. AutoModel.from_pretrained(DIR).save_pretrained(NEW_DIR) writes "
        "model.safetensors, then stage NEW_DIR; nothing was staged"
    )


def _checkpoint_like(folder: Path, files: set[str]) -> str | None:
    if checkpoint_number(folder.name) is not None:
        return f"its name, {shown(folder.name)}"
    state = sorted(name for name in files if _TRAINING_STATE.fullmatch(name))
    return f"it holds {state[0]}" if state else None


def survey_folder(folder: Path) -> FolderInventory:
    """What ``folder`` (a real path, links resolved) holds, from the names alone: what will be
    read and what is left out; or the refusal of a folder that cannot be staged."""
    if not folder.is_dir():
        raise StageError(f"--from-folder {shown(folder)} is not a folder")
    try:
        with HandedFolder(folder) as handed:
            itself = Seen.of(handed.info)
            listing = dict(handed.walk())
    except (FileChanged, FolderTooDeep) as exc:
        raise StageError(f"{exc}; nothing was staged") from None
    top = {name: info for name, info in listing.items() if "/" not in name}
    if not top:
        raise StageError(f"{shown(folder)} is empty: there is nothing to stage")
    _refuse_links(folder, listing)
    files = {name for name, info in top.items() if stat.S_ISREG(info.st_mode)}
    special = sorted(
        n for n, info in top.items() if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode)
    )
    if special:
        raise StageError(f"{shown(folder / special[0])} is not a plain file or folder; nothing was staged")
    safetensors = sorted(name for name in files if name.endswith(".safetensors"))
    index = None
    if INDEX_FILE in files:
        if HUB_MODEL_FILE in files:
            raise StageError(
                f"{shown(folder)} holds both {HUB_MODEL_FILE} and {INDEX_FILE}: which are the weights? Remove the "
                "one that is stale; nothing was staged"
            )
        index, weights = INDEX_FILE, ()  # the shards are read from the index, once it is hashed
    elif len(safetensors) == 1:
        weights = (safetensors[0],)
    elif safetensors:
        listed = ", ".join(shown(name) for name in safetensors[:3]) + (", …" if len(safetensors) > 3 else "")
        raise StageError(
            f"{shown(folder)} holds {len(safetensors)} .safetensors files ({listed}) and no {INDEX_FILE} naming "
            "them: which are the weights? Keep one, or the shards and their index; nothing was staged"
        )
    else:
        pickles = [
            name for name in sorted(files) if _PICKLE.fullmatch(name) and not _TRAINING_STATE.fullmatch(name)
        ]
        if pickles:
            raise _pickle_refusal(folder, pickles[0])
        raise StageError(
            f"{shown(folder)} holds no weights ({HUB_MODEL_FILE}, or shards and {INDEX_FILE}); nothing was staged"
        )
    if CONFIG_FILE not in files:
        raise StageError(
            f"{shown(folder)} has no {CONFIG_FILE}: the Hub's tools need one beside the weights (save_pretrained "
            "writes it); nothing was staged"
        )
    carried = (CONFIG_FILE, *(name for name in CARRIED_FILES if name in files))
    read = {*weights, *carried, *((index,) if index else ())}
    left_out = tuple(
        f"{name}/" if stat.S_ISDIR(top[name].st_mode) else name
        for name in sorted(top)
        if name not in read and name != META_FILE
    )
    return FolderInventory(
        folder=folder,
        weights=weights,
        index=index,
        carried=carried,
        left_out=left_out,
        seen={".": itself, **{name: Seen.of(top[name]) for name in sorted(files)}},
        checkpoint_like=_checkpoint_like(folder, files),
    )


def _seal_of(handed: HandedFolder) -> dict[str, Any] | None:
    """The folder's seal, verified in full, or None without a meta.json. A meta.json that is
    not a seal that verifies is refused: it may be a damaged seal, never trusted or ignored."""
    try:
        handed.lstat(META_FILE)
    except FileNotFoundError:
        return None
    try:
        return check_seal_in(handed)
    except UnsealedCheckpoint as exc:
        raise StageError(f"{exc}; nothing was staged") from None


def _checked_entry(path: Path, entry: dict[str, Any], seal: dict[str, Any] | None) -> dict[str, Any]:
    """``entry`` (the SHA-256 and size of the bytes read) if it is what the seal recorded."""
    if seal is not None and seal["files"].get(path.name) != entry:
        raise StageError(
            f"{shown(path)} changed after it was sealed (its SHA-256 differs from meta.json); nothing was staged"
        )
    return entry


class _Reader:
    """The folder, opened once and checked against the survey, and what was read from it."""

    def __init__(self, handed: HandedFolder, inventory: FolderInventory) -> None:
        self.handed, self.inventory = handed, inventory
        self.seal: dict[str, Any] | None = None
        self.sources: dict[str, dict[str, Any]] = {}
        self.modes: dict[str, int] = {}
        self.warnings: list[str] = []

    def open(self, name: str) -> HandedFile:
        seen = self.inventory.seen[name]
        if seen.links > 1:
            self.warnings.append(
                f"{shown(self.handed.path / name)} has {seen.links} hard links: the same bytes have another name, "
                "maybe outside the folder; it was staged as read (check it is the file you meant)"
            )
        file = self.handed.open(name, seen=seen)
        self.modes[name] = stat.S_IMODE(file.info.st_mode)
        return file

    def small(self, name: str) -> bytes:
        path = self.handed.path / name
        with self.open(name) as file:
            if file.size > _MAX_SMALL_FILE:
                raise StageError(
                    f"{shown(path)} is {file.size:,} bytes, over the {_MAX_SMALL_FILE:,}-byte limit of such a file"
                )
            data = file.read()
        self.sources[name] = _checked_entry(
            path, {"sha256": sha256_bytes(data), "size": len(data)}, self.seal
        )
        return data

    def copy_weights(self, name: str, target: Path) -> MappedTensors:
        """Copy one weights file privately, hashing while copying; re-hash the copy from disk;
        parse it with the strict parser. Every later read is of this copy. Its header is parsed
        first, from the open descriptor: a file that is not safetensors, or whose tensors do not
        end where the file does (a sparse tail of garbage), is refused before a byte is copied."""
        source = self.handed.path / name
        with self.open(name) as src:
            _check_header(src, source)
            with HashingWriter(target) as out:
                for chunk in src.chunks():
                    out.write(chunk)
        self.sources[name] = _checked_entry(source, {"sha256": out.sha256, "size": out.size}, self.seal)
        if sha256_file(target) != out.sha256:
            raise StageError(f"the copy of {shown(source)} reads back with another SHA-256: check the disk")
        try:
            return MappedTensors(target)
        except SchemaMismatch as exc:
            rule = str(exc).partition("is not a valid safetensors file: ")[2] or str(exc)
            raise StageError(
                f"{shown(source)} is not a valid safetensors file ({rule}); nothing was staged"
            ) from None


def _check_header(src: HandedFile, source: Path) -> None:
    """The strict parser's refusal of ``src``'s header, read with ``pread`` (the copy still reads
    from the start): its length, then the header itself, within the parser's bound."""
    length = int.from_bytes(os.pread(src.fd, 8, 0), "little") if src.size >= 8 else 0
    head = os.pread(src.fd, 8 + min(length, MAX_HEADER, max(0, src.size - 8)), 0)
    try:
        parse_header(head, size=src.size)
    except ValueError as exc:
        raise StageError(
            f"{shown(source)} is not a valid safetensors file ({str(exc).splitlines()[0]}); nothing was staged"
        ) from None


def json_object(data: bytes, path: Path) -> dict[str, Any]:
    try:
        value = json_loads_strict(data)
    except ValueError as exc:
        raise StageError(f"{shown(path)} is not valid JSON ({exc}); nothing was staged") from None
    if not isinstance(value, dict):
        raise StageError(f"{shown(path)} must hold a JSON object; nothing was staged")
    return value


def _shard_names(
    index: dict[str, Any], path: Path, inventory: FolderInventory
) -> tuple[dict[str, str], tuple[str, ...]]:
    """The index's ``weight_map`` and the shard files it names, each a regular file the survey saw."""
    weight_map = index.get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise StageError(f"{shown(path)} has no weight_map of tensor names to files; nothing was staged")
    shards = tuple(sorted(set(weight_map.values())))
    for shard in shards:
        if not _WEIGHTS_NAME.fullmatch(shard):
            raise StageError(
                f"{shown(path)} names '{shown(shard)}', not a .safetensors file of the folder; nothing was staged"
            )
        if shard not in inventory.seen:
            raise StageError(
                f"{shown(path)} names {shard}, which is missing from {shown(inventory.folder)}; nothing was staged"
            )
    return weight_map, shards


class _Shards:
    """The tensors of several mapped shards, read as one: each name from the shard holding it."""

    def __init__(self, files: dict[str, MappedTensors], owner: dict[str, str]) -> None:
        self._files, self._owner = files, owner
        self.specs = {name: files[owner[name]].specs[name] for name in sorted(owner)}

    def tensor(self, name: str) -> torch.Tensor:
        return self._files[self._owner[name]].tensor(name)

    def release(self, name: str) -> None:
        self._files[self._owner[name]].release(name)


def _open_weights(reader: _Reader, scratch: Path) -> CheckpointWeights:
    """The folder's weights from verified private copies, one tensor at a time; the reader's
    ``sources`` get the SHA-256 and size of every file read."""
    inventory = reader.inventory
    folder = inventory.folder
    weight_map: dict[str, str] | None = None
    names = inventory.weights
    if inventory.index is not None:
        index_path = folder / inventory.index
        weight_map, names = _shard_names(
            json_object(reader.small(inventory.index), index_path), index_path, inventory
        )
    mapped: dict[str, MappedTensors] = {}
    for name in names:
        mapped[name] = reader.copy_weights(name, scratch / name)
    if weight_map is None:
        (only,) = names
        if not mapped[only].specs:
            raise StageError(
                f"{shown(folder / only)} holds no tensors: there are no weights to stage; nothing was staged"
            )
        return CheckpointWeights(
            mapped[only],
            scratch / only,
            reader.sources[only],
            [mapped[only]],
            origin=shown(folder / only),
            record=None,
        )
    owner: dict[str, str] = {}
    for shard, tensors in mapped.items():
        for tensor in tensors.specs:
            if tensor in owner:
                raise StageError(
                    f"tensor {shown(tensor)} is listed twice, in {shown(folder / owner[tensor])} and "
                    f"{shown(folder / shard)}; nothing was staged"
                )
            owner[tensor] = shard
    for tensor, shard in sorted(owner.items()):
        if weight_map.get(tensor) != shard:
            raise StageError(
                f"{shown(folder / inventory.index)} does not map tensor {shown(tensor)} to {shard}, which holds it; "
                "nothing was staged"
            )
    unheld = sorted(set(weight_map) - set(owner))
    if unheld:
        raise StageError(
            f"{shown(folder / inventory.index)} maps tensor {shown(unheld[0])} to {weight_map[unheld[0]]}, which "
            "does not hold it; nothing was staged"
        )
    return CheckpointWeights(
        _Shards(mapped, owner),
        None,
        None,
        list(mapped.values()),
        origin=shown(folder / INDEX_FILE),
        record=None,
    )


def _model_facts(config: dict[str, Any], path: Path) -> tuple[bool, str | None]:
    """(a transformers model?, its architecture class) from config.json: ``model_type`` and
    ``architectures`` say transformers; the class name goes into the card's code, so it must
    be a plain identifier."""
    architectures = config.get("architectures")
    if architectures is None:
        return False, None
    if not (
        isinstance(architectures, list)
        and architectures
        and all(isinstance(a, str) and _CLASS_NAME.fullmatch(a) for a in architectures)
    ):
        raise StageError(
            f"{shown(path)}: architectures must be a list of Python class names; nothing was staged"
        )
    return isinstance(config.get("model_type"), str), architectures[0]


@dataclass(frozen=True, slots=True)
class FolderSource:
    """What a stage of the folder is built from, each piece read once and hashed."""

    inventory: FolderInventory
    seal: dict[str, Any] | None
    """The folder's verified seal, if it has one."""
    weights: CheckpointWeights
    """The weights, from verified private copies, one tensor at a time (close when done)."""
    small: dict[str, bytes]
    """``config.json``, tokenizer and generation files: name -> bytes, staged as they are."""
    sources: dict[str, dict[str, Any]]
    """Every file read: name -> its ``sha256`` and ``size`` as read."""
    modes: dict[str, int]
    """Every file read: name -> its permission bits (a staged file grants no more)."""
    transformers: bool
    """``config.json`` names a transformers model (``model_type`` and ``architectures``)."""
    architecture: str | None
    """Its first ``architectures`` class name, if any."""
    warnings: tuple[str, ...]
    """What the user should know, staged anyway: no seal on a checkpoint-like folder, hard links."""

    @property
    def left_out(self) -> tuple[str, ...]:
        """What the folder holds and the stage was not built from: never opened. The survey
        cannot tell a shard from a stray file before the index is read; this can."""
        return tuple(name for name in self.inventory.left_out if name not in self.sources)


def read_folder(inventory: FolderInventory, scratch: Path) -> FolderSource:
    """Read what ``inventory`` stages: the seal checked, the weights copied into ``scratch``
    (close ``weights`` when done), the small files as bytes, all hashed as read, each from
    the file the survey saw (else "changed while it was staged")."""
    folder = inventory.folder
    try:
        with HandedFolder(folder, seen=inventory.seen["."]) as handed:
            reader = _Reader(handed, inventory)
            reader.seal = _seal_of(handed)
            weights = _open_weights(reader, scratch)
            try:
                small = {}
                for name in inventory.carried:
                    small[name] = reader.small(name)
                    if name.endswith(".json"):
                        json_object(small[name], folder / name)
                transformers, architecture = _model_facts(
                    json_object(small[CONFIG_FILE], folder / CONFIG_FILE), folder / CONFIG_FILE
                )
            except BaseException:
                weights.close()
                raise
    except FileChanged as exc:
        raise StageError(
            f"{shown(exc.path)} changed while it was staged ({exc.reason}): is another program writing the "
            "folder? Nothing was staged"
        ) from None
    warnings = list(dict.fromkeys(reader.warnings))
    if reader.seal is None and inventory.checkpoint_like is not None:
        warnings.insert(
            0,
            f"{shown(folder)} looks like a trainer's checkpoint ({inventory.checkpoint_like}) but carries no seal: "
            "nothing shows its save finished; staged as read. If you trust it, seal it first with "
            "pipeline.integrations.seal.seal_checkpoint (docs/other-trainers.md)",
        )
    return FolderSource(
        inventory=inventory,
        seal=reader.seal,
        weights=weights,
        small=small,
        sources=reader.sources,
        modes=reader.modes,
        transformers=transformers,
        architecture=architecture,
        warnings=tuple(warnings),
    )

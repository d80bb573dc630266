"""Read a model folder that another tool wrote, strictly, for 05 ``--from-folder``.

:func:`survey_folder` sorts out what the folder holds before any file is read, refusing what
cannot be staged: an empty folder, a link out of it, weights that exist only as a pickle (never
opened: loading one runs code), no weights, no ``config.json``. :func:`read_folder` then reads
what is staged, each file once, hashed as read:

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
``trainer_state.json``) and anything else is left where it is, never opened.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointWeights, MappedTensors
from ..durable import json_loads_strict
from ..errors import SchemaMismatch, StageError, UnsealedCheckpoint
from ..hashing import CHUNK, HashingWriter, sha256_bytes, sha256_file
from ..integrations.seal import check_seal
from ..layout import CONFIG_FILE, GENERATION_CONFIG_FILE, HUB_MODEL_FILE, INDEX_FILE, META_FILE

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
    """Everything else at the top of the folder (a folder's name ends in ``/``): never opened."""


# -- what the folder holds -------------------------------------------------------------------


def _refuse_outside_links(folder: Path) -> None:
    """A link anywhere in the folder must stay inside it (a link out could stage any file)."""
    root = os.path.realpath(folder)
    for parent, dirs, files in os.walk(folder):
        for entry in dirs + files:
            path = Path(parent) / entry
            if path.is_symlink():
                target = os.path.realpath(path)
                if os.path.commonpath([root, target]) != root or target == root:
                    raise StageError(
                        f"{path} is a link to {target}, outside {folder}: copy the files into the folder "
                        "(cp -rL) and stage the copy; nothing was staged"
                    )


def _pickle_refusal(folder: Path, name: str) -> StageError:
    return StageError(
        f"{folder / name} is a pickle, and pickles are never loaded here (loading one runs code): convert "
        "the model where you trust it, e.g. AutoModel.from_pretrained(DIR).save_pretrained(NEW_DIR) writes "
        "model.safetensors, then stage NEW_DIR; nothing was staged"
    )


def survey_folder(folder: Path) -> FolderInventory:
    """What ``folder`` (a real path, links resolved) holds, from the names alone: what will be
    read and what is left out; or the refusal of a folder that cannot be staged."""
    if not folder.is_dir():
        raise StageError(f"--from-folder {folder} is not a folder")
    entries = sorted(os.listdir(folder))
    if not entries:
        raise StageError(f"{folder} is empty: there is nothing to stage")
    _refuse_outside_links(folder)
    files = {name for name in entries if (folder / name).is_file()}
    special = sorted(n for n in entries if not (folder / n).is_file() and not (folder / n).is_dir())
    if special:
        raise StageError(f"{folder / special[0]} is not a plain file or folder; nothing was staged")
    safetensors = sorted(name for name in files if name.endswith(".safetensors"))
    index = None
    if INDEX_FILE in files:
        if HUB_MODEL_FILE in files:
            raise StageError(
                f"{folder} holds both {HUB_MODEL_FILE} and {INDEX_FILE}: which are the weights? Remove the "
                "one that is stale; nothing was staged"
            )
        index, weights = INDEX_FILE, ()  # the shards are read from the index, once it is hashed
    elif HUB_MODEL_FILE in files or len(safetensors) == 1:
        weights = (HUB_MODEL_FILE if HUB_MODEL_FILE in files else safetensors[0],)
    elif safetensors:
        raise StageError(
            f"{folder} holds {len(safetensors)} .safetensors files and no {INDEX_FILE} naming them; "
            "nothing was staged"
        )
    else:
        pickles = [
            name for name in sorted(files) if _PICKLE.fullmatch(name) and not _TRAINING_STATE.fullmatch(name)
        ]
        if pickles:
            raise _pickle_refusal(folder, pickles[0])
        raise StageError(
            f"{folder} holds no weights ({HUB_MODEL_FILE}, or shards and {INDEX_FILE}); nothing was staged"
        )
    if CONFIG_FILE not in files:
        raise StageError(
            f"{folder} has no {CONFIG_FILE}: the Hub's tools need one beside the weights (save_pretrained "
            "writes it); nothing was staged"
        )
    carried = (CONFIG_FILE, *(name for name in CARRIED_FILES if name in files))
    read = {*weights, *carried, *((index,) if index else ())}
    left_out = tuple(
        f"{name}/" if (folder / name).is_dir() else name
        for name in entries
        if name not in read and name != META_FILE
    )
    return FolderInventory(folder=folder, weights=weights, index=index, carried=carried, left_out=left_out)


def _seal_of(folder: Path) -> dict[str, Any] | None:
    """The folder's seal, verified in full, or None without a meta.json. A meta.json that is
    not a seal that verifies is refused: it may be a damaged seal, never trusted or ignored."""
    if not os.path.lexists(folder / META_FILE):
        return None
    try:
        return check_seal(folder)
    except UnsealedCheckpoint as exc:
        raise StageError(f"{exc}; nothing was staged") from None


def _checked_entry(path: Path, entry: dict[str, Any], seal: dict[str, Any] | None) -> dict[str, Any]:
    """``entry`` (the SHA-256 and size of the bytes read) if it is what the seal recorded."""
    if seal is not None and seal["files"].get(path.name) != entry:
        raise StageError(
            f"{path} changed after it was sealed (its SHA-256 differs from meta.json); nothing was staged"
        )
    return entry


def _read_small(path: Path, seal: dict[str, Any] | None) -> tuple[bytes, dict[str, Any]]:
    size = path.stat().st_size
    if size > _MAX_SMALL_FILE:
        raise StageError(f"{path} is {size:,} bytes, over the {_MAX_SMALL_FILE:,}-byte limit of such a file")
    data = path.read_bytes()
    return data, _checked_entry(path, {"sha256": sha256_bytes(data), "size": len(data)}, seal)


def json_object(data: bytes, path: Path) -> dict[str, Any]:
    try:
        value = json_loads_strict(data)
    except ValueError as exc:
        raise StageError(f"{path} is not valid JSON ({exc}); nothing was staged") from None
    if not isinstance(value, dict):
        raise StageError(f"{path} must hold a JSON object; nothing was staged")
    return value


def _shard_names(index: dict[str, Any], path: Path, folder: Path) -> tuple[dict[str, str], tuple[str, ...]]:
    """The index's ``weight_map`` and the shard files it names, each present in the folder."""
    weight_map = index.get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise StageError(f"{path} has no weight_map of tensor names to files; nothing was staged")
    shards = tuple(sorted(set(weight_map.values())))
    for shard in shards:
        if not _WEIGHTS_NAME.fullmatch(shard):
            raise StageError(
                f"{path} names {shard!r}, not a .safetensors file of the folder; nothing was staged"
            )
        if not (folder / shard).is_file():
            raise StageError(f"{path} names {shard}, which is missing from {folder}; nothing was staged")
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


def _copy_weights(
    source: Path, target: Path, seal: dict[str, Any] | None
) -> tuple[MappedTensors, dict[str, Any]]:
    """Copy one weights file privately, hashing while copying; re-hash the copy from disk;
    parse it with the strict parser. Every later read is of this copy."""
    with open(source, "rb") as src, HashingWriter(target) as out:
        while chunk := src.read(CHUNK):
            out.write(chunk)
    entry = _checked_entry(source, {"sha256": out.sha256, "size": out.size}, seal)
    if sha256_file(target) != out.sha256:
        raise StageError(f"the copy of {source} reads back with another SHA-256: check the disk")
    try:
        return MappedTensors(target), entry
    except SchemaMismatch as exc:
        rule = str(exc).partition("is not a valid safetensors file: ")[2] or str(exc)
        raise StageError(f"{source} is not a valid safetensors file ({rule}); nothing was staged") from None


def _open_weights(
    inventory: FolderInventory, scratch: Path, seal: dict[str, Any] | None, sources: dict[str, dict[str, Any]]
) -> CheckpointWeights:
    """The folder's weights from verified private copies, one tensor at a time; ``sources``
    gets the SHA-256 and size of every file read."""
    folder = inventory.folder
    weight_map: dict[str, str] | None = None
    names = inventory.weights
    if inventory.index is not None:
        data, sources[inventory.index] = _read_small(folder / inventory.index, seal)
        weight_map, names = _shard_names(
            json_object(data, folder / inventory.index), folder / inventory.index, folder
        )
    mapped: dict[str, MappedTensors] = {}
    for name in names:
        mapped[name], sources[name] = _copy_weights(folder / name, scratch / name, seal)
    if weight_map is None:
        (only,) = names
        return CheckpointWeights(
            mapped[only],
            scratch / only,
            sources[only],
            [mapped[only]],
            origin=str(folder / only),
            record=None,
        )
    owner: dict[str, str] = {}
    for shard, tensors in mapped.items():
        for tensor in tensors.specs:
            if tensor in owner:
                raise StageError(
                    f"tensor {tensor} is listed twice, in {folder / owner[tensor]} and {folder / shard}; "
                    "nothing was staged"
                )
            owner[tensor] = shard
    for tensor, shard in sorted(owner.items()):
        if weight_map.get(tensor) != shard:
            raise StageError(
                f"{folder / inventory.index} does not map tensor {tensor} to {shard}, which holds it; "
                "nothing was staged"
            )
    unheld = sorted(set(weight_map) - set(owner))
    if unheld:
        raise StageError(
            f"{folder / inventory.index} maps tensor {unheld[0]} to {weight_map[unheld[0]]}, which does not "
            "hold it; nothing was staged"
        )
    return CheckpointWeights(
        _Shards(mapped, owner),
        None,
        None,
        list(mapped.values()),
        origin=str(folder / INDEX_FILE),
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
        raise StageError(f"{path}: architectures must be a list of Python class names; nothing was staged")
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
    transformers: bool
    """``config.json`` names a transformers model (``model_type`` and ``architectures``)."""
    architecture: str | None
    """Its first ``architectures`` class name, if any."""


def read_folder(inventory: FolderInventory, scratch: Path) -> FolderSource:
    """Read what ``inventory`` stages: the seal checked, the weights copied into ``scratch``
    (close ``weights`` when done), the small files as bytes, all hashed as read."""
    folder = inventory.folder
    seal = _seal_of(folder)
    sources: dict[str, dict[str, Any]] = {}
    weights = _open_weights(inventory, scratch, seal, sources)
    try:
        small = {}
        for name in inventory.carried:
            small[name], sources[name] = _read_small(folder / name, seal)
            if name.endswith(".json"):
                json_object(small[name], folder / name)
        transformers, architecture = _model_facts(
            json_object(small[CONFIG_FILE], folder / CONFIG_FILE), folder / CONFIG_FILE
        )
    except BaseException:
        weights.close()
        raise
    return FolderSource(
        inventory=inventory,
        seal=seal,
        weights=weights,
        small=small,
        sources=sources,
        transformers=transformers,
        architecture=architecture,
    )

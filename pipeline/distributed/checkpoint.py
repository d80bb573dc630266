"""Save and restore a distributed run: pickle-free, atomic across ranks, read back through
the same verification as a single-process checkpoint.

Format (``meta.json`` schema ``pipeline.checkpoint.distributed/2``)::

    step-00000010/
        model/shard-0000R-model-00001-of-00001.safetensors   DCP, HuggingFaceStorageWriter
        optim/shard-….safetensors                            (plain safetensors; the chunk's
                                                              place in the header)
        rng/rank-00000.safetensors    rank 0's RNG states (tensors; the rest as JSON in the header)
        estado_treino.safetensors     rank-independent tensors: scheduler, sampler, history (once)
        meta.json                     written last and sealed (meta_sha256) like a single-process
                                      one: JSON state, every file's SHA-256 and size, every
                                      tensor's full shape, the launch (mode, world size, DDP
                                      bucket setting)

Commit protocol: rank 0 opens :func:`pipeline.durable.atomic_folder` and broadcasts the
temporary folder's name; every rank writes its files (each fsynced by its writer); all
agree; rank 0 hashes every file, writes ``meta.json`` (:func:`~pipeline.checkpoint.store.write_meta`)
and leaves ``atomic_folder`` (fsync the folders, rename, fsync the parent); all agree;
rank 0 prunes through the store (pinned readers respected). A rank killed at any instant
leaves only a ``.tmp-…`` folder, which the next run's lock holder removes.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..checkpoint import CheckpointStore, SavedCheckpoint, check_derived_buffers
from ..checkpoint.codec import split_state
from ..checkpoint.shards import tensor_specs
from ..checkpoint.store import DIST_SCHEMA, write_meta
from ..checkpoint.tensorfile import map_file, parse_header, read_tensors, sha256_mapped, write_safetensors
from ..checkpoint.validate import HISTORY, validated_state
from ..checkpoint.weights import derived_buffer_names
from ..durable import atomic_folder, json_loads_strict
from ..errors import CheckpointError, StateMismatch, WorldSizeMismatch
from ..layout import DIST_MODEL_DIR, DIST_OPTIM_DIR, DIST_RNG_DIR, STATE_FILE, rank_rng_file
from ..rng import capture_rng, restore_rng
from ..run import TrainingRun
from .world import World, derive_rank_rng

__all__ = ["DistributedCheckpointer", "restore_distributed"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_RNG_KEY = "rng"


def _model_state(run: TrainingRun, stored: Iterable[str]) -> dict[str, torch.Tensor]:
    """The model's tensors under their plain names, tied aliases left out (as single-process)."""
    stored = set(stored)
    return {name: tensor for name, tensor in get_model_state_dict(run.model).items() if name in stored}


def _optimizer_state(run: TrainingRun) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """(JSON tree, tensors under ``optim/…``, the flattened live state) of this rank's optimizer."""
    live = get_optimizer_state_dict(run.model, run.optimizer, options=_FLAT)
    tensors: dict[str, torch.Tensor] = {}
    return split_state(live, DIST_OPTIM_DIR, tensors), tensors, live


def _dcp_save(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    # HuggingFaceStorageWriter stores tensors only; anything else would silently become a
    # torch.save (zip, pickle) entry, so it is refused here first.
    odd = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
    if odd:
        raise CheckpointError(f"{odd[0]} is not a tensor: a distributed checkpoint holds tensors only")
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def _write_rng(path: Path, generator: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    tree = split_state(capture_rng(generator), _RNG_KEY, tensors)
    write_safetensors(path, tensors, metadata={"format": "pt", _RNG_KEY: json.dumps(tree, allow_nan=False)})


def _read_rng(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON tree, tensors) of one rank's RNG file, through the strict parser."""
    tensors = read_tensors(path)
    header, _ = parse_header(map_file(path))
    try:
        return json_loads_strict(header["__metadata__"][_RNG_KEY].encode("utf-8")), tensors
    except (KeyError, TypeError, ValueError):
        raise StateMismatch(f"{path} holds no readable RNG record: the checkpoint is damaged") from None


class DistributedCheckpointer:
    """The distributed counterpart of :class:`pipeline.checkpoint.Checkpointer` (same
    ``save`` / ``wait`` / ``close`` / ``store``). Saves are synchronous."""

    def __init__(self, store: CheckpointStore, world: World, provenance: dict[str, Any], model_summary: dict,
                 *, resharded_from: int | None = None) -> None:
        self.store = store
        self.world = world
        self.provenance = provenance
        self.model_summary = model_summary
        self.resharded_from = resharded_from
        self.last_saved_step: int | None = None

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None

    def save(self, run: TrainingRun) -> SavedCheckpoint:
        world, step = self.world, run.step
        final = self.store.path_for(step)
        model = _model_state(run, self.model_summary["tensors"])
        optimizer_tree, optimizer, _ = _optimizer_state(run)
        shared: dict[str, torch.Tensor] = {}
        task_state = getattr(run.data, "state_dict", None)
        training_state = {
            "optimizer": optimizer_tree,
            "scheduler": split_state(run.scheduler.state_dict(), "scheduler", shared),
            "data": {"sampler": split_state(run.sampler.state_dict(), "data/sampler", shared),
                     "task": split_state(task_state(), "data/task", shared) if task_state else None},
            "rng": None,  # per rank, in rng/rank-NNNNN.safetensors
            "scaler": None,  # fp16 AMP is refused under torchrun
            "progress": {"step": step},
        }
        for key in HISTORY:
            shared[f"history/{key}"] = torch.tensor(run.history[key],
                                                    dtype=torch.int64 if key == "step" else torch.float64)
        with contextlib.ExitStack() as commit:
            temporary = None
            with world.together(f"saving step {step}"):
                if world.rank == 0:
                    if final.exists():
                        raise CheckpointError(f"{final} already exists; refusing to overwrite a committed checkpoint")
                    temporary = commit.enter_context(atomic_folder(final, files_synced=True))
            temporary = self.store.root / world.broadcast_text(temporary.name if temporary else None)
            with world.together(f"writing step {step}"):
                _dcp_save(model, temporary / DIST_MODEL_DIR)
                _dcp_save(optimizer, temporary / DIST_OPTIM_DIR)
                (temporary / DIST_RNG_DIR).mkdir(exist_ok=True)
                _write_rng(temporary / rank_rng_file(world.rank), run.generator)
                if world.rank == 0:
                    write_safetensors(temporary / STATE_FILE, shared, metadata={"format": "pt", "step": str(step)})
            files: dict[str, dict[str, Any]] = {}
            with world.together(f"committing step {step}"):
                if world.rank == 0:
                    summary = {**self.model_summary, "derived_buffers": derived_buffer_names(model, run.fresh_buffers)}
                    files = self._seal(temporary, step, summary, model, optimizer, training_state)
                    commit.close()  # atomic_folder: fsync the folders, rename into place, fsync the parent
        with world.together(f"pruning after step {step}"):
            if world.rank == 0:
                self.store.prune_after_commit(step)
        self.last_saved_step = step
        return SavedCheckpoint(step=step, path=final, files=files)

    def _seal(self, temporary: Path, step: int, summary: dict, model: dict, optimizer: dict,
              training_state: dict) -> dict[str, dict[str, Any]]:
        """Hash every file the ranks wrote and write the sealed meta.json last (rank 0)."""
        names = sorted(p.relative_to(temporary).as_posix() for p in temporary.rglob("*") if not p.is_dir())
        for name in names:
            # What torch writes besides safetensors (.metadata, .distcp) is pickle.
            if not name.endswith(".safetensors"):
                raise CheckpointError(f"{temporary / name}: a distributed checkpoint holds safetensors files only")
        maps = {name: map_file(temporary / name) for name in names}
        digests, _ = sha256_mapped(maps)
        files = {name: {"sha256": digests[name], "size": len(maps[name])} for name in names}
        del maps
        write_meta(temporary, {
            **self.provenance,
            "schema": DIST_SCHEMA,
            "step": step,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": summary,
            "training_state": training_state,
            "files": files,
            "parallel": self.world.describe(),
            "tensors": {DIST_MODEL_DIR: tensor_specs(model), DIST_OPTIM_DIR: tensor_specs(optimizer)},
            "resharded_from": self.resharded_from,
        })
        return files


def _dcp_load(template: dict[str, torch.Tensor], folder: Path, expected: dict[str, Any], what: str) -> None:
    if tensor_specs(template) != expected:
        odd = sorted(set(template) ^ set(expected)) or sorted(
            n for n in template if tensor_specs({n: template[n]})[n] != expected[n])
        raise StateMismatch(f"{folder}: the checkpoint's {what} tensors differ from this run's at {odd[0]}: "
                            "it does not fit the model or optimizer built from the config")
    dcp.load(template, storage_reader=HuggingFaceStorageReader(str(folder)))


def restore_distributed(run: TrainingRun, world: World, folder: Path, meta: dict[str, Any], *,
                        reshard: bool) -> None:
    """Load a verified checkpoint (rank 0 ran :func:`pipeline.checkpoint.load_checkpoint`
    on it: hashes, strict headers, shard coverage; every rank read its sealed meta.json)
    into a built, wrapped run: model and optimizer through DCP (resharding if the world
    size changed; DCP loads into the run's own tensors, so a refusal after it ends the run,
    and nothing on disk changes), then the JSON state, validated with the single-process
    rules (:func:`~pipeline.checkpoint.validate.validated_state`) and derived buffers
    checked before any of it is set, and this rank's RNGs last (re-derived when resharded)."""
    saved_world = meta["parallel"]["world_size"]
    if saved_world != world.world_size and not reshard:
        raise WorldSizeMismatch(f"{folder} was written by {saved_world} processes, this launch has "
                                f"{world.world_size}: relaunch with --nproc-per-node {saved_world}, or pass "
                                "--reshard to redistribute it (RNG streams are then re-derived)")
    # DCP loads in place, so templates: the optimizer's first (torch builds its state with a
    # zero-gradient, zero-lr step, which must not touch weights loaded after it).
    _, optimizer, _ = _optimizer_state(run)
    _dcp_load(optimizer, folder / DIST_OPTIM_DIR, meta["tensors"][DIST_OPTIM_DIR], "optimizer")
    model = _model_state(run, meta["tensors"][DIST_MODEL_DIR])
    _dcp_load(model, folder / DIST_MODEL_DIR, meta["tensors"][DIST_MODEL_DIR], "model")
    resharded = saved_world != world.world_size
    # The data order is global (one Generator on every rank), so a reshard carries rank 0's
    # over; the per-rank streams have no counterpart at another world size.
    rng_tree, rng_tensors = _read_rng(folder / rank_rng_file(0 if resharded else world.rank))
    shared = read_tensors(folder / STATE_FILE)
    state = {**meta["training_state"], "rng": rng_tree}
    _, _, live = _optimizer_state(run)
    joined = validated_state(run, state, {**shared, **optimizer, **rng_tensors}, step=meta["step"], optimizer=live)
    check_derived_buffers(getattr(run.model, "module", run.model), model, meta["model"]["derived_buffers"],
                          source=str(folder / DIST_MODEL_DIR))
    try:
        set_model_state_dict(run.model, model, options=StateDictOptions(strict=False))
        set_optimizer_state_dict(run.model, run.optimizer, joined["optimizer"], options=_FLAT)
        run.scheduler.load_state_dict(joined["scheduler"])
        run.sampler.load_state_dict(joined["sampler"])
        if joined["task"] is not None:
            run.data.load_state_dict(joined["task"])
        run.step = joined["step"]
        run.history = {key: shared[f"history/{key}"].tolist() for key in HISTORY}
        if not resharded:
            restore_rng(joined["rng"], run.generator, need_cuda=run.device.type == "cuda")
        else:
            run.generator.bit_generator.state = joined["rng"]["numpy_generator"]
            derive_rank_rng(run.config.training.seed, run.step, world.rank)
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateMismatch(f"{folder}: saved training state does not fit this run: {first}") from None



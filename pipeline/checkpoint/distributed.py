"""Save a distributed run: pickle-free, atomic across ranks, read back through the same
verification as a single-process checkpoint (the restore: :mod:`.dist_restore`).

Format (``meta.json`` schema ``pipeline.checkpoint.distributed/3``)::

    step-00000010/
        model/shard-0000R-model-00001-of-00001.safetensors   rank R-1's chunks, in the layout of
        optim/shard-….safetensors                            DCP's HuggingFaceStorageWriter (plain
                                                              safetensors; each chunk's place in
                                                              the header)
        rng/rank-00000.safetensors    rank 0's RNG states (tensors; the rest as JSON in the header)
        estado_treino.safetensors     rank-independent tensors: scheduler, sampler, history (once)
        meta.json                     written last and sealed (meta_sha256) like a single-process
                                      one: JSON state, every file's SHA-256, size and 64 MiB
                                      chunk digests (meta.py's files entry), every
                                      tensor's full shape, the launch (mode, world size, DDP
                                      bucket setting)

Commit protocol: rank 0 opens :func:`pipeline.durable.atomic_folder` and broadcasts the
temporary folder's name; every rank writes its files through ``dcp.save`` (model, then
optimizer) and :func:`~pipeline.checkpoint.tensorfile.write_safetensors` (its RNG states;
rank 0 the shared state), each hashed whole and by chunks from memory as it is written and
fsynced by its writer; all agree; the ranks' ``{file: files entry}`` records go to rank
0 as JSON (:meth:`World.gather_text`, no pickle); rank 0 checks they list exactly the
folder's files, writes ``meta.json`` (:func:`~pipeline.checkpoint.meta.write_meta`) and
leaves ``atomic_folder`` (fsync the folders, rename, fsync the parent); all agree; rank 0
prunes through the store (pinned readers respected). A rank killed at any instant
leaves only a ``.tmp-…`` folder, which the next run's lock holder removes. With
``checkpoint.async`` the same protocol runs in a thread, from a snapshot, on a process
group of its own (:class:`DistributedCheckpointer`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import threading
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..durable import atomic_folder, json_loads_strict
from ..errors import CheckpointError, PipelineError
from ..hashing import chunk_size_for
from ..layout import DIST_MODEL_DIR, DIST_OPTIM_DIR, DIST_RNG_DIR, STATE_FILE, dcp_shard_name, rank_rng_file
from ..rng import capture_rng
from ..run import TrainingRun
from ..world import World
from .best import BestRule
from .checkpointer import OneSaveInFlight, PendingSave
from .codec import split_state
from .components import components
from .meta import build_meta, file_entry, write_meta
from .shards import tensor_specs
from .snapshot import SnapshotBuffers
from .state import capture_history
from .store import CheckpointStore, SavedCheckpoint
from .tensorfile import write_safetensors_files
from .weights import derived_buffer_names

__all__ = ["DistributedCheckpointer"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_RNG_KEY = "rng"
# The header keys of torch's HuggingFaceStorageWriter, which its reader (and shards.py) read.
_SHARDING_INFO, _SAVED_OFFSETS, _DCP_VERSION = "DCP_SHARDING_INFO", "saved_offsets", "DCP_VERSION"


def _model_state(run: TrainingRun, stored: Iterable[str]) -> dict[str, torch.Tensor]:
    """The model's tensors under their plain names, tied aliases left out (as single-process)."""
    stored = set(stored)
    return {name: tensor for name, tensor in get_model_state_dict(run.model).items() if name in stored}


def _optimizer_state(run: TrainingRun) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """(JSON tree, tensors under ``optim/…``, the flattened live state) of this rank's optimizer."""
    live = get_optimizer_state_dict(run.model, run.optimizer, options=_FLAT)
    tensors: dict[str, torch.Tensor] = {}
    return split_state(live, DIST_OPTIM_DIR, tensors), tensors, live


class _StreamedShardWriter(HuggingFaceStorageWriter):
    """DCP's safetensors layout (what :class:`HuggingFaceStorageReader` reads: one file per
    rank, each chunk's place in the header's ``DCP_SHARDING_INFO``), each rank's file
    written by :func:`~pipeline.checkpoint.tensorfile.write_safetensors`: streamed from the
    tensors' memory (torch's writer builds the whole file in memory first), hashed as it
    is written (no second read), fsynced, and with its header in one canonical order (torch's
    follows a hash map's, so two identical runs wrote different bytes). ``written``: this
    rank's ``{file name: files entry}`` (:func:`~pipeline.checkpoint.meta.file_entry`)."""

    def __init__(self, folder: Path, part: str) -> None:
        super().__init__(str(folder), save_distributed=True)
        self.folder, self.part = folder, part
        self.written: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        done: Future[list[WriteResult]] = Future()
        if not plan.items:
            done.set_result([])
            return done
        name = dcp_shard_name(plan.storage_data["shard_index"])
        tensors, sharding, results = {}, {}, []
        for item in plan.items:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor) or item.tensor_data is None:
                # Anything else would become a torch.save (zip, pickle) entry in torch's writer.
                raise CheckpointError(
                    f"{item.index.fqn} is not a tensor: a distributed checkpoint holds tensors only"
                )
            fqn = item.index.fqn
            tensors[fqn] = tensor.detach().cpu()
            sharding[fqn] = {_SAVED_OFFSETS: list(item.tensor_data.chunk.offsets)}
            results.append(
                WriteResult(
                    index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(), storage_data=name
                )
            )
        self.written[f"{self.part}/{name}"] = _write_sealed(
            self.folder / name,
            tensors,
            {_SHARDING_INFO: json.dumps(sharding, sort_keys=True), _DCP_VERSION: "1.0", "format": "pt"},
        )
        done.set_result(results)
        return done


def _write_sealed(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write one file of the checkpoint; its ``files`` entry (whole and chunk digests, from
    the tensors' memory as it is written, as the single-process store does)."""
    sha256, size, chunk_size, chunks = write_safetensors_files(
        [(path, tensors, metadata)], chunk_size=chunk_size_for
    )[0]
    return file_entry(sha256, size, chunks, chunk_size)


def _dcp_save(
    tensors: dict[str, torch.Tensor], temporary: Path, part: str, world: World
) -> dict[str, dict[str, Any]]:
    """Save ``tensors`` with DCP into ``temporary / part``; this rank's file's files entry."""
    odd = [name for name, value in tensors.items() if not isinstance(value, torch.Tensor)]
    if odd:
        raise CheckpointError(f"{odd[0]} is not a tensor: a distributed checkpoint holds tensors only")
    writer = _StreamedShardWriter(temporary / part, part)
    dcp.save(tensors, storage_writer=writer, process_group=world.group)
    return writer.written


class DistributedCheckpointer(OneSaveInFlight):
    """The distributed counterpart of :class:`pipeline.checkpoint.Checkpointer` (same
    ``save`` / ``wait`` / ``close`` / ``store``).

    With ``background=True`` (``checkpoint.async``), :meth:`save` copies this rank's model
    and optimizer shards, RNG states and the shared state into reused CPU buffers
    (:class:`~pipeline.checkpoint.snapshot.SnapshotBuffers`), returns a
    :class:`~pipeline.checkpoint.checkpointer.PendingSave`, and a thread commits with the
    same protocol. The thread's collectives (DCP's plan exchange, the agreements, the hash
    records) run on a gloo group of their own, created here on every rank at the same point
    of the run, so they can never pair up with a training step's all-reduce on another
    rank: the deadlock of a shared group. One save in flight: the next :meth:`save` and
    :meth:`close` wait for it and raise its error in the training thread.
    """

    def __init__(
        self,
        store: CheckpointStore,
        world: World,
        provenance: dict[str, Any],
        model_summary: dict,
        *,
        resharded_from: int | None = None,
        background: bool = False,
    ) -> None:
        self.store = store
        self.world = world
        self.provenance = provenance
        self.model_summary = model_summary
        self.resharded_from = resharded_from
        self.background = background
        self.last_saved_step: int | None = None
        self.snapshot = SnapshotBuffers()
        self._in_flight: PendingSave | None = None
        self._committer = world.own_group() if background else world
        self._wrappers: dict[str, tuple[Any, DTensor]] = {}  # see _like

    def _release(self) -> None:
        self._wrappers.clear()
        if self._committer is not self.world:
            self._committer.leave_group()
            self._committer = self.world

    def save(self, run: TrainingRun) -> SavedCheckpoint | PendingSave:
        self.wait()  # the buffers are reused, and a failed save must stop training now
        checkpoint = run.config.checkpoint
        self.store.best = BestRule.of(run.evaluations, checkpoint.best_metric, checkpoint.best_mode)
        step = run.step
        model = _model_state(run, self.model_summary["tensors"])
        optimizer_tree, optimizer, _ = _optimizer_state(run)
        shared: dict[str, torch.Tensor] = {}
        # Once for every rank, by rank 0: each component the ranks share (the scaler too: DDP's
        # gradients are all-reduced and FSDP2's found-inf flag is too, so every rank skips the
        # same steps; the data's gathers a stream's per-rank positions, every rank together).
        training_state = {c.name: c.captured(run, shared) for c in components() if not c.per_rank}
        training_state["optimizer"] = optimizer_tree  # its tensors: each rank's shard, through DCP
        training_state["rng"] = None  # per rank, in rng/rank-NNNNN.safetensors
        training_state["progress"] = {"step": step}
        capture_history(run, shared)
        rng: dict[str, torch.Tensor] = {}
        rng_tree = split_state(capture_rng(run.generator), _RNG_KEY, rng)
        record = {
            "step": step,
            "training_state": training_state,
            "rng_tree": rng_tree,
            "tensors": {DIST_MODEL_DIR: tensor_specs(model), DIST_OPTIM_DIR: tensor_specs(optimizer)},
            "model": {**self.model_summary, "derived_buffers": derived_buffer_names(model, run.fresh_buffers)}
            if self.world.rank == 0
            else None,
        }
        if not self.background:
            saved = self._commit(self.world, record, model, optimizer, rng, shared)
            self.last_saved_step = step
            return saved
        copies = self.snapshot.copy(
            {"model": _local(model), "optim": _local(optimizer), "rng": rng, "shared": shared}
        )
        pending = PendingSave(step, self.store.path_for(step))
        # Not a daemon: an interpreter exiting without close() still waits for the commit.
        # The record is not copied: split_state and tensor_specs built it for this save.
        pending._thread = threading.Thread(
            target=self._write,
            name=f"checkpoint-step-{step}",
            daemon=False,
            args=(
                pending,
                record,
                self._like(copies["model"], model),
                self._like(copies["optim"], optimizer),
                copies["rng"],
                copies["shared"],
            ),
        )
        pending._thread.start()  # in flight only once it runs (see Checkpointer._start)
        self._in_flight = pending
        return pending

    def _like(
        self, copies: dict[str, torch.Tensor], live: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The snapshot's local copies as the live tensors were: sharded ones rewrapped with
        the same mesh, placements and global shape (no communication), so DCP writes the same
        chunks at the same offsets. A wrapper is kept while its buffer and layout are the
        same: building a DTensor costs about a millisecond of Python, per tensor, per save."""
        wrapped = {}
        for name, tensor in live.items():
            if not isinstance(tensor, DTensor):
                wrapped[name] = copies[name]
                continue
            key = (
                copies[name].data_ptr(),
                copies[name].dtype,
                tensor.device_mesh,
                tensor.placements,
                tensor.shape,
                tensor.stride(),
            )
            kept = self._wrappers.get(name)
            if kept is None or kept[0] != key:
                kept = self._wrappers[name] = (
                    key,
                    DTensor.from_local(
                        copies[name],
                        tensor.device_mesh,
                        tensor.placements,
                        run_check=False,
                        shape=tensor.shape,
                        stride=tensor.stride(),
                    ),
                )
            wrapped[name] = kept[1]
        return wrapped

    def _write(self, pending: PendingSave, *args: Any) -> None:
        try:
            saved = self._commit(self._committer, *args)
        except BaseException as exc:  # re-raised in the training thread by PendingSave.result
            if not isinstance(exc, (PipelineError, OSError)):
                # DCP's own failure type is not an Exception; the run ends with one line.
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                exc = CheckpointError(f"the background save of step {pending.step} failed: {first[:300]}")
            pending._future.set_exception(exc)
            return
        self.last_saved_step = saved.step
        pending._future.set_result(saved)

    def _commit(
        self,
        world: World,
        record: dict[str, Any],
        model: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        rng: dict[str, torch.Tensor],
        shared: dict[str, torch.Tensor],
    ) -> SavedCheckpoint:
        """The commit protocol (module docstring) on ``world``'s process group."""
        step = record["step"]
        final = self.store.path_for(step)
        lead = world.rank == 0  # rank 0 holds the folder, seals and prunes
        with contextlib.ExitStack() as commit:
            temporary = None
            with world.together(f"saving step {step}"):
                if lead:
                    if final.exists():
                        raise CheckpointError(
                            f"{final} already exists; refusing to overwrite a committed checkpoint"
                        )
                    temporary = commit.enter_context(atomic_folder(final, files_synced=True))
            temporary = self.store.root / world.broadcast_text(temporary.name if temporary else None)
            with world.together(f"writing step {step}"):
                # Each rank hashes what it writes, as it writes it (no file is read back).
                hashed = {
                    **_dcp_save(model, temporary, DIST_MODEL_DIR, world),
                    **_dcp_save(optimizer, temporary, DIST_OPTIM_DIR, world),
                }
                (temporary / DIST_RNG_DIR).mkdir(exist_ok=True)
                hashed[rank_rng_file(world.rank)] = _write_sealed(
                    temporary / rank_rng_file(world.rank),
                    rng,
                    {"format": "pt", _RNG_KEY: json.dumps(record["rng_tree"], allow_nan=False)},
                )
                if lead:
                    hashed[STATE_FILE] = _write_sealed(
                        temporary / STATE_FILE, shared, {"format": "pt", "step": str(step)}
                    )
            records = world.gather_text(json.dumps(hashed))
            files: dict[str, dict[str, Any]] = {}
            with world.together(f"committing step {step}"):
                if lead:
                    files = self._seal(temporary, record, _listed(temporary, records))
                    commit.close()  # atomic_folder: fsync the folders, rename into place, fsync the parent
        with world.together(f"pruning after step {step}"):
            if lead:
                self.store.prune_after_commit(step)
        return SavedCheckpoint(step=step, path=final, files=files)

    def _seal(
        self, temporary: Path, record: dict[str, Any], files: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """Write the sealed meta.json last (rank 0)."""
        parts = {
            **self.provenance,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": record["model"],
            "training_state": record["training_state"],
            "parallel": self.world.describe(),
            "tensors": record["tensors"],
            "resharded_from": self.resharded_from,
        }
        write_meta(temporary, build_meta(parts, step=record["step"], files=files, distributed=True))
        return files


def _local(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of each tensor (an FSDP2 shard's local tensor)."""
    return {name: t.to_local() if isinstance(t, DTensor) else t for name, t in tensors.items()}


def _listed(temporary: Path, records: list[str]) -> dict[str, dict[str, Any]]:
    """The ranks' hash records joined (rank 0): every file in the folder exactly once."""
    files: dict[str, dict[str, Any]] = {}
    for record in records:
        for name, entry in json_loads_strict(record.encode("utf-8")).items():
            if name in files:
                raise CheckpointError(
                    f"{temporary / name} was hashed by two ranks: their listings of the folder differ"
                )
            files[name] = entry  # checked by build_meta
    present = sorted(p.relative_to(temporary).as_posix() for p in temporary.rglob("*") if not p.is_dir())
    for name in present:
        # What torch writes besides safetensors (.metadata, .distcp) is pickle.
        if not name.endswith(".safetensors"):
            raise CheckpointError(
                f"{temporary / name}: a distributed checkpoint holds safetensors files only"
            )
    if sorted(files) != present:
        odd = sorted(set(files) ^ set(present))[0]
        raise CheckpointError(f"{temporary / odd}: the ranks' hashes and the folder's files differ")
    return dict(sorted(files.items()))

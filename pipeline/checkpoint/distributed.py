"""Save and restore a distributed run: pickle-free, atomic across ranks, read back through
the same verification as a single-process checkpoint.

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
import copy
import datetime as _dt
import json
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..durable import atomic_folder, json_loads_strict
from ..errors import SEALED_BUT_UNFIT, CheckpointError, PipelineError, SchemaMismatch, StateMismatch
from ..hashing import CHUNK_SIZE
from ..layout import DIST_MODEL_DIR, DIST_OPTIM_DIR, DIST_RNG_DIR, STATE_FILE, rank_rng_file
from ..rng import capture_rng, derive_rank_rng, restore_rng
from ..run import TrainingRun
from ..world import World
from .best import best_record
from .checkpointer import OneSaveInFlight, PendingSave
from .codec import join_state, split_state
from .components import components
from .load import LoadedCheckpoint, load_checkpoint
from .meta import build_meta, file_entry, write_meta
from .shards import consolidate, shard_tensors, tensor_specs
from .snapshot import SnapshotBuffers
from .state import capture_history, checked_omit, restore_components
from .store import CheckpointStore, SavedCheckpoint
from .tensorfile import map_file, parse_header, read_tensors, tensors_from_map, write_safetensors_files
from .validate import HISTORY, validated_state
from .verified_dcp import SealedReads
from .weights import check_derived_buffers, derived_buffer_names

__all__ = [
    "DistributedCheckpointer",
    "restore_distributed",
    "restore_from_single",
    "live_components",
    "read_full_state",
    "read_rank_rng",
]

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
        name = f"shard-{plan.storage_data['shard_index']:05d}-model-00001-of-00001.safetensors"
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
    sha256, size, chunks = write_safetensors_files([(path, tensors, metadata)], chunk_size=CHUNK_SIZE)[0]
    return file_entry(sha256, size, chunks, CHUNK_SIZE)


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


def live_components(run: TrainingRun) -> dict[str, Any]:
    """This rank's live state of each saved component besides the model (copies): what
    the resume proof compares to see whether a control changed what was restored. The
    optimizer's as this rank holds it (its shard, flattened as DCP saves it)."""
    _, optimizer, _ = _optimizer_state(run)
    live = {c.name: copy.deepcopy(c.live(run)) for c in components() if c.name != "optimizer"}
    live["optimizer"] = {
        name: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
        for name, t in optimizer.items()
    }
    return live


def read_rank_rng(path: Path, data: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON tree, tensors) of one rank's RNG file, through the strict parser; ``data``: its
    bytes, read and verified already (:class:`~.verified_dcp.SealedReads`)."""
    tensors = read_tensors(path) if data is None else tensors_from_map(path, data)
    header, _ = parse_header(map_file(path) if data is None else data)
    try:
        return json_loads_strict(header["__metadata__"][_RNG_KEY].encode("utf-8")), tensors
    except (KeyError, TypeError, ValueError):
        raise StateMismatch(f"{path} holds no readable RNG record: {SEALED_BUT_UNFIT}") from None


def read_full_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """A distributed checkpoint, verified (hashes, headers, coverage), as one whole:
    ``(model tensors, JSON training state, its tensor table)`` with the optimizer state
    consolidated and every rank's RNG states under ``rng/rank-R`` (what the resume proof
    compares)."""
    loaded = load_checkpoint(folder)
    meta = loaded.meta
    maps = {name: map_file(folder / name) for name in meta["files"] if name.startswith(f"{DIST_OPTIM_DIR}/")}
    expected = meta["tensors"][DIST_OPTIM_DIR]
    tensors = {
        **loaded.state_tensors,
        **consolidate(shard_tensors(folder, DIST_OPTIM_DIR, expected, maps), expected),
    }
    rng = {}
    for rank in range(meta["parallel"]["world_size"]):
        tree, rank_tensors = read_rank_rng(folder / rank_rng_file(rank))
        rng[f"rank-{rank}"] = split_state(join_state(tree, rank_tensors), f"rng/rank-{rank}", tensors)
    return loaded.model_tensors, {**meta["training_state"], "rng": rng}, tensors


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
        self.store.best = best_record(run.evaluations, checkpoint.best_metric, checkpoint.best_mode)
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
        self._in_flight = pending
        pending._thread.start()
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


def _dcp_load(
    template: dict[str, torch.Tensor], reads: SealedReads, part: str, what: str, world: World
) -> None:
    folder, expected = reads.folder / part, reads.meta["tensors"][part]
    if tensor_specs(template) != expected:
        odd = sorted(set(template) ^ set(expected)) or sorted(
            n for n in template if tensor_specs({n: template[n]})[n] != expected[n]
        )
        raise StateMismatch(
            f"{folder}: the checkpoint's {what} tensors differ from this run's at {odd[0]}: "
            "it does not fit the model or optimizer built from the config"
        )
    try:
        with warnings.catch_warnings():
            # One process reading every shard (a run moved to one process) is what no_dist means.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(template, storage_reader=reads.reader(part), no_dist=not world.launched)
    except CheckpointException as failed:
        # DCP gathered every rank's failure, so every rank raises the same (lowest) rank's.
        error = failed.failures[min(failed.failures)][0]
        if isinstance(error, (PipelineError, OSError)):
            raise error from None
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise StateMismatch(f"{folder}: saved training state does not fit this run: {first}") from None


def restore_distributed(
    run: TrainingRun,
    world: World,
    folder: Path,
    meta: dict[str, Any],
    *,
    omit: Iterable[str] = (),
    swap_rng: bool = False,
) -> None:
    """Load a distributed checkpoint, verified as it is read (every rank read its sealed
    meta.json), into a built run: wrapped, one rank of a launch (``world``), or a plain one
    process (a run moved to one process with ``--reshard``). Each rank
    reads the files it uses into its own memory and hashes them there
    (:class:`~.verified_dcp.SealedReads`); the ranks agree that every one matched its seal
    before any state is set. Model and optimizer come through DCP, which redistributes
    them for another world size or ``training.parallel`` (DCP loads into the run's own
    tensors, so a refusal after it ends the run, and nothing on disk changes); then the
    JSON state, validated with the single-process rules
    (:func:`~pipeline.checkpoint.validate.validated_state`) and derived buffers checked
    before any of it is set, and this rank's RNGs last: re-derived from ``(seed, step,
    rank)`` when the world size changed, as the per-rank streams have no counterpart then.
    Whether the launch may differ is decided before (:mod:`pipeline.start`).

    ``omit`` and ``swap_rng``: the resume proof's negative controls
    (:class:`pipeline.train.TrainingHooks`). An omitted component keeps what the fresh
    build gave it (the RNGs: the streams a fresh run derives at step 0)."""
    omit = checked_omit(omit)
    rank, world_size = world.rank, world.world_size
    # DCP loads in place, so templates: the optimizer's first (torch builds its state with a
    # zero-gradient, zero-lr step, which must not touch weights loaded after it).
    reads = SealedReads(folder, meta)
    _, optimizer, _ = _optimizer_state(run)
    if "optimizer" not in omit:
        _dcp_load(optimizer, reads, DIST_OPTIM_DIR, "optimizer", world)
    model = _model_state(run, meta["tensors"][DIST_MODEL_DIR])
    _dcp_load(model, reads, DIST_MODEL_DIR, "model", world)
    resharded = meta["parallel"]["world_size"] != world_size
    # The data order is global (one Generator on every rank), so a reshard carries rank 0's
    # over; the per-rank streams have no counterpart at another world size.
    source = 0 if resharded else (1 - rank if swap_rng and rank < 2 else rank)
    rng_data, shared_data = reads.read(rank_rng_file(source)), reads.read(STATE_FILE)
    rng_tree, rng_tensors, shared = None, {}, {}
    try:
        if rng_data is not None and shared_data is not None:
            rng_tree, rng_tensors = read_rank_rng(folder / rank_rng_file(source), rng_data)
            shared = tensors_from_map(folder / STATE_FILE, shared_data)
    except (SchemaMismatch, StateMismatch) as unfit:
        reads.refuse(unfit)
    reads.agree(world)  # one collective: every file any rank used matched its seal
    state = {**meta["training_state"], "rng": rng_tree}
    _, _, live = _optimizer_state(run)
    joined = validated_state(
        run, state, {**shared, **optimizer, **rng_tensors}, step=meta["step"], optimizer=live
    )
    check_derived_buffers(
        getattr(run.model, "module", run.model),
        model,
        meta["model"]["derived_buffers"],
        source=str(folder / DIST_MODEL_DIR),
    )
    with _fits(folder):
        set_model_state_dict(run.model, model, options=StateDictOptions(strict=False))
        if "optimizer" not in omit:
            _set_optimizer(run, joined["optimizer"], _FLAT)
        _restore_rest(run, joined, omit, rank, resharded, history=shared)


def restore_from_single(
    run: TrainingRun, world: World, loaded: LoadedCheckpoint, *, omit: Iterable[str] = ()
) -> None:
    """Continue a single-process checkpoint on this rank of a launch (``--reshard``).

    ``loaded``: the checkpoint, verified and read whole on this rank; its weights are
    already in the model (:func:`pipeline.start` loads them into the plain model before
    DDP or FSDP2 wraps it). The optimizer state, in torch's form, is validated like a
    single-process resume, named by parameter and set through torch's full-state loader
    (which shards it for FSDP2); sampler, scheduler, scaler, step and history carry over;
    each rank's RNG streams are derived from ``(seed, step, rank)``, the data order's
    Generator continues."""
    omit = checked_omit(omit)
    tensors = loaded.state_tensors
    joined = validated_state(run, loaded.meta["training_state"], tensors, step=loaded.meta["step"])
    with _fits(loaded.folder):
        if "optimizer" not in omit:
            plain = getattr(run.model, "module", run.model)
            names = {id(p): name for name, p in plain.named_parameters()}
            order = [names[id(p)] for group in run.optimizer.param_groups for p in group["params"]]
            saved = joined["optimizer"]
            by_name = {
                "state": {order[index]: value for index, value in saved["state"].items()},
                "param_groups": [
                    {**group, "params": [order[i] for i in group["params"]]}
                    for group in saved["param_groups"]
                ],
            }
            _set_optimizer(run, by_name, StateDictOptions(full_state_dict=True))
        _restore_rest(run, joined, omit, world.rank, True, history=tensors)


def _set_optimizer(run: TrainingRun, state: dict[str, Any], options: StateDictOptions) -> None:
    """Load a validated optimizer state through torch's loader, then give every group's
    hyperparameters the types the freshly built optimizer has: torch's full-state path
    flattens and rebuilds the state, handing back lists where the optimizer holds tuples
    (AdamW's ``betas``). Left as lists, the next checkpoint would record lists, which no
    resume of this code accepts (:mod:`~pipeline.checkpoint.validate`)."""
    built = [
        {key: value for key, value in group.items() if key != "params"}
        for group in run.optimizer.param_groups
    ]
    set_optimizer_state_dict(run.model, run.optimizer, state, options=options)
    for group, fresh in zip(run.optimizer.param_groups, built, strict=True):
        for key, value in fresh.items():
            if key in group:
                group[key] = _typed_like(group[key], value)


def _typed_like(loaded: Any, built: Any) -> Any:
    """``loaded`` with the tuples of ``built`` (the same values, nested alike)."""
    if isinstance(built, tuple) and isinstance(loaded, (list, tuple)) and len(loaded) == len(built):
        return tuple(_typed_like(item, like) for item, like in zip(loaded, built))
    return loaded


def _restore_rest(
    run: TrainingRun,
    joined: dict[str, Any],
    omit: frozenset[str],
    rank: int,
    resharded: bool,
    *,
    history: dict[str, torch.Tensor],
) -> None:
    """The components the ranks share, step, history, and this rank's RNGs last (see
    :func:`restore_distributed`)."""
    restore_components(run, joined, omit, shared_only=True)
    run.step = joined["step"]
    run.history = {key: history[f"history/{key}"].tolist() for key in HISTORY}
    run.evaluations = joined["evaluations"]
    if "rng" in omit:
        derive_rank_rng(run.config.training.seed, 0, rank)
    elif not resharded:
        restore_rng(joined["rng"], run.generator, need_cuda=run.device.type == "cuda")
    else:
        run.generator.bit_generator.state = joined["rng"]["numpy_generator"]
        derive_rank_rng(run.config.training.seed, run.step, rank)


@contextlib.contextmanager
def _fits(folder: Path) -> Iterator[None]:
    """torch's loaders' own refusals as one line naming the checkpoint."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateMismatch(f"{folder}: saved training state does not fit this run: {first}") from None

"""``train`` under torchrun: the same loop (:func:`pipeline.train._loop`), one process per
rank, DDP or FSDP2 around the model, distributed checkpoints (``pipeline.checkpoint.distributed``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import (
    CheckpointStore,
    DistributedCheckpointer,
    LoadedCheckpoint,
    LoadMode,
    check_resume_compatible,
    is_distributed,
    load_checkpoint,
    model_summary,
    read_meta,
    restore_distributed,
)
from ..config import Config
from ..data import load_manifest
from ..environment import pin_threads, reproduce_environment
from ..errors import CheckpointError, PipelineError, SchemaMismatch
from ..progress import Progress
from ..provenance import check_code_unchanged
from ..run import build_run, configure_determinism, fresh_buffers
from ..train import TrainingHooks, TrainResult, _loop, final_checkpoint, run_provenance
from .world import World, derive_rank_rng

__all__ = ["train_distributed"]


def train_distributed(config: Config, *, resume: str | None = None, stop_at: int | None = None,
                      progress: bool = True, reshard: bool = False, allow_environment_change: bool = False,
                      world: World | None = None, hooks: TrainingHooks | None = None) -> TrainResult:
    """Train as one rank of a torchrun launch (``training.parallel``: ddp | fsdp2).

    ``resume`` and ``allow_environment_change`` as in :func:`pipeline.train.train`;
    ``reshard``: accept a checkpoint written by another number of processes. ``world``: a
    process group the caller started (and will close) to run several trainings in one
    launch; by default one is joined and left here. ``hooks``: as for :func:`pipeline.train.train`
    (the distributed resume proof, ``pipeline.proof.distributed``). Every rank returns the same result.
    """
    hooks = hooks or TrainingHooks()
    if world is not None:
        if world.mode != config.training.parallel:
            raise PipelineError(f"the launch runs {world.mode}, the config asks for {config.training.parallel}")
        return _train(world, config, resume=resume, stop_at=stop_at, progress=progress, reshard=reshard,
                      allow_environment_change=allow_environment_change, hooks=hooks)
    world = World.start(config)
    try:
        return _train(world, config, resume=resume, stop_at=stop_at, progress=progress, reshard=reshard,
                      allow_environment_change=allow_environment_change, hooks=hooks)
    finally:
        world.close()


def _starting_point(store: CheckpointStore, resume: str | None, config: Config,
                    fingerprint: str, allow_code_change: bool) -> LoadedCheckpoint | None:
    """Rank 0: the verified checkpoint to resume from (the single-process verification:
    sealed meta.json, every file hashed and parsed, plus every shard's coverage), or
    ``None`` for a fresh run. Same refusals as single-process."""
    resume = store.resume_target(resume)
    if resume is None:
        return None
    loaded = load_checkpoint(resume, store.root, mode=LoadMode.VERIFY)
    if not is_distributed(loaded.meta):
        raise SchemaMismatch(f"{loaded.folder} is a single-process checkpoint: resume it with python "
                             "scripts/02_train.py (training.parallel: none)")
    check_resume_compatible(loaded.meta, config, fingerprint)
    if not allow_code_change:
        check_code_unchanged(loaded.meta, config, use="resume")
    newer = [s for s in store.committed_steps() if s > loaded.meta["step"]]
    if newer and loaded.folder.resolve().parent == store.root.resolve():
        raise CheckpointError(f"{store.root}/ holds step {newer[-1]}, newer than the resume point "
                              f"{loaded.meta['step']}: resume from latest, or use another --checkpoint-dir")
    return loaded


def _train(world: World, config: Config, *, resume: str | None, stop_at: int | None, progress: bool,
           reshard: bool, allow_environment_change: bool, hooks: TrainingHooks) -> TrainResult:
    if stop_at is not None and stop_at < 1:
        raise PipelineError(f"--stop-at must be >= 1 (got {stop_at})")
    configure_determinism(config)
    store = CheckpointStore(config.checkpoint.dir, keep_last=config.checkpoint.keep_last)
    start = None
    try:
        with world.together("starting"):
            manifest = load_manifest(config)
            if world.rank == 0:
                store.acquire()  # one lock for the launch, held by rank 0
                store.clean_stale()
                start = _starting_point(store, resume, config, manifest["fingerprint"], allow_environment_change)
        folder_name = world.broadcast_text(str(start.folder) if start else None)
        with world.together("resuming"):
            # Rank 0 verified every byte; the others read the same sealed meta.json.
            meta = start.meta if start else (read_meta(Path(folder_name)) if folder_name else None)
            resumed = meta["step"] if meta else None
            if stop_at is not None and resumed is not None and stop_at <= resumed:
                raise PipelineError(f"--stop-at {stop_at} is not after the resume step {resumed}")
            pin_threads(config)
            changes: list[dict[str, Any]] = []
            if meta is not None:
                new = reproduce_environment(meta["environment"], world.device, allow_change=allow_environment_change,
                                            step=resumed)
                changes = meta["environment"]["changes"] + new
            summary: dict[str, Any] = {}

            def wrap(model):
                summary.update(model_summary(model, fresh_buffers(model)))  # names as one process stores them
                return world.wrap(model, config)

            run = build_run(config, world.device, wrap=wrap)
            if meta is not None:
                restore_distributed(run, world, Path(folder_name), meta, reshard=reshard, omit=hooks.skip_restore,
                                    swap_rng=hooks.swap_rng)
            else:
                derive_rank_rng(config.training.seed, 0, world.rank)
            if hooks.on_start is not None:
                hooks.on_start(run)
        report = Progress(total=config.training.max_steps, initial=resumed or 0,
                          log_every=config.training.log_every, enabled=progress and world.rank == 0)
        if meta is not None:
            report.message(f"resumed from {folder_name} at step {run.step} ({world.world_size} processes, "
                           f"{world.mode})")
        saved_world = meta["parallel"]["world_size"] if meta else None
        resharded_from = saved_world if saved_world not in (None, world.world_size) else (
            meta["resharded_from"] if meta else None)
        checkpointer = DistributedCheckpointer(store, world, run_provenance(config, manifest, world.device, changes),
                                               summary, resharded_from=resharded_from,
                                               background=config.checkpoint.async_)
        try:
            saved = _loop(run, checkpointer, report, stop_at=stop_at, resumed=resumed is not None, on_step=hooks.on_step,
                          resume_hint=world.resume_command(), world=world)
        finally:
            report.close()
            checkpointer.close()  # waits for a save in flight; may raise its error
        return TrainResult(step=run.step, max_steps=config.training.max_steps,
                           checkpoint=final_checkpoint(saved, store, run.step), history=run.history,
                           resumed_from=resumed, rank=world.rank)
    finally:
        store.release()

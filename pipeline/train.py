"""The training loop: resume or start, step, checkpoint locally, stop cleanly on signals.

No code path here talks to the network; publishing is a separate, explicit step.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .checkpoint import (
    OMITTABLE,
    Checkpointer,
    CheckpointStore,
    LoadedCheckpoint,
    LoadMode,
    SavedCheckpoint,
    check_capturable,
    check_derived_buffers,
    checkpoint_meta,
    continued_config,
    is_distributed,
    load_checkpoint,
    read_tensors,
    restore_state,
    warm_start,
)
from .cli import script_command
from .config import Config
from .data import load_manifest
from .distributed.world import World
from .environment import current_environment, pin_threads, reproduce_environment
from .errors import CheckpointError, ConfigError, PeerFailed, PipelineError, Preempted, SchemaMismatch, TrainingDiverged
from .layout import MODEL_FILE
from .progress import Progress
from .provenance import check_code_unchanged, code_fingerprint, counted_sources, factories_fingerprint, library_versions
from .run import TrainingRun, build_run, configure_determinism, resolve_device

__all__ = ["train", "train_step", "TrainResult", "TrainingHooks"]


@dataclass(kw_only=True, slots=True)
class TrainingHooks:
    """The documented seam for tools that study a run without changing the loop (the resume
    proof, ``pipeline.proof.leg``, is the one user). Plain training passes none."""

    skip_restore: tuple[str, ...] = ()
    """Components of the checkpoint left unrestored on resume (a subset of
    ``pipeline.checkpoint.OMITTABLE``): the proof's negative controls."""
    on_start: Callable[[TrainingRun], None] | None = None
    """Called once the run is built and restored, before the first step."""
    on_step: Callable[[TrainingRun], None] | None = None
    """Called after every optimizer step, before that step's checkpoint is saved."""
    swap_rng: bool = False
    """Under torchrun: ranks 0 and 1 restore each other's RNG streams (the proof's control
    for per-rank RNG state)."""

    def __post_init__(self) -> None:
        unknown = set(self.skip_restore) - set(OMITTABLE)
        if unknown:
            raise ValueError(f"skip_restore names unknown components {sorted(unknown)}; choose from {OMITTABLE}")


@dataclass(slots=True)
class TrainResult:
    step: int
    max_steps: int
    """The run's length (``--extend-to`` raises it above the config's)."""
    checkpoint: Path | None
    history: dict[str, list]
    resumed_from: int | None
    rank: int = 0
    """Under torchrun, the rank that returned this (every rank returns the same result)."""


class _StopSignals:
    """Record SIGTERM/SIGINT instead of dying mid-step; restore the old handlers after."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def train_step(run: TrainingRun, world: World | None = None) -> tuple[float, float]:
    """One optimizer step; returns (loss, learning rate used). Under torchrun (``world``)
    every rank draws the same global batch and trains on its slice of it; the loss
    returned is the global batch's."""
    run.model.train()
    batch, scale = run.feed.next_batch()  # this rank's slice under torchrun
    with torch.autocast(run.device.type, dtype=run.autocast_dtype, enabled=run.autocast_dtype is not None):
        loss = run.data.loss(run.model, batch)
    if world is not None:
        loss = loss * scale
    run.optimizer.zero_grad(set_to_none=True)
    clip = run.config.training.grad_clip
    if run.scaler is not None:
        run.scaler.scale(loss).backward()
        if clip:
            run.scaler.unscale_(run.optimizer)
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
        run.optimizer.step()
    lr = float(run.optimizer.param_groups[0]["lr"])
    run.scheduler.step()
    run.step += 1
    value = float(loss.detach()) if world is None else world.global_loss(loss)
    run.history["step"].append(run.step)
    run.history["loss"].append(value)
    run.history["lr"].append(lr)
    return value, lr


def _starting_point(store: CheckpointStore, resume: str | None, config: Config, data_fingerprint: str,
                    extend_to: int | None, allow_code_change: bool) -> tuple[tuple[str, Path, dict[str, Any]] | None, Config,
                                                    list[dict[str, int]]]:
    """The checkpoint to resume from (``None`` for a fresh run) as (what ``--resume`` names
    in the store, its folder, its checked meta.json: its files are verified when loaded into
    the run built from it), the config the run continues with and its lineage (see
    :func:`pipeline.checkpoint.continued_config`).

    Refuses to start fresh over committed checkpoints, or to resume behind newer ones:
    either would interleave two runs' steps in one folder.
    """
    resume = store.resume_target(resume)
    if resume is None:
        if extend_to is not None:
            raise PipelineError(f"--extend-to continues a run, but {store.root}/ holds no checkpoint to continue: "
                                "train it first (--max-steps sets the length of a new run)")
        return None, config, []
    folder, meta = checkpoint_meta(resume, store.root)
    with _damage_first(resume, store.root):
        if is_distributed(meta):
            raise SchemaMismatch(f"{folder} is a distributed checkpoint: resume it under torchrun (README, "
                                 "'Distributed training'; --nproc-per-node 1 --reshard for one process)")
        config, lineage = continued_config(meta, config, data_fingerprint, extend_to=extend_to)
        if not allow_code_change:
            check_code_unchanged(meta, config, use="resume")
        step = meta["step"]
        newer = [s for s in store.committed_steps() if s > step]
        if newer and Path(folder).resolve().parent == store.root.resolve():
            raise CheckpointError(f"{store.root}/ holds step {newer[-1]}, newer than the resume point {step}: "
                                  "resume from latest, or use another --checkpoint-dir")
    return (resume, folder, meta), config, lineage


@contextlib.contextmanager
def _damage_first(resume: str | None, root: Path) -> Iterator[None]:
    """A refusal met before the resume checkpoint's files are verified (they are verified
    as they load into the run, which is built from its meta.json first) names the damage
    instead when they are damaged: as every reader does, damage is reported first."""
    try:
        yield
    except PipelineError:
        if resume is not None:
            load_checkpoint(resume, root, mode=LoadMode.VERIFY)
        raise


def _load_into(run: TrainingRun, store: CheckpointStore, start: tuple[str, Path, dict[str, Any]]) -> LoadedCheckpoint:
    """Verify the resume checkpoint while its weights go into ``run``'s model (see
    :func:`pipeline.checkpoint.load_checkpoint`); the run was built from its meta.json."""
    resume, folder, meta = start
    loaded = load_checkpoint(resume, store.root, into=run.model)
    if loaded.folder != folder or loaded.meta != meta:  # we hold the store's lock: only an outside writer
        raise CheckpointError(f"{folder} changed while it was being loaded: resume again")
    return loaded


def final_checkpoint(saved: SavedCheckpoint | None, store: CheckpointStore, step: int) -> Path | None:
    """The checkpoint a run ends on: its last save, or, when it saved nothing (a finished run
    resumed again), the committed checkpoint of its step, if any."""
    if saved is not None:
        return saved.path
    return store.path_for(step) if step in store.committed_steps() else None


def run_provenance(config: Config, manifest: dict, device: torch.device, changes: list[dict[str, Any]],
                   lineage: list[dict[str, int]] | None = None) -> dict:
    """What every checkpoint of a run records about where it came from, and the
    environment it computes in (``changes``: accepted environment changes so far;
    ``lineage``: its --extend-to history)."""
    return {
        "config": config.to_dict(),
        "fingerprints": {"data": manifest["fingerprint"], "code": code_fingerprint(),
                         "factories": factories_fingerprint(config), "sources": counted_sources(config)},
        "versions": library_versions(),
        "device": str(device),
        "environment": {**current_environment(device), "changes": changes},
        "lineage": list(lineage or []),
    }


def train(
    config: Config,
    *,
    resume: str | None = None,
    init_from: str | None = None,
    stop_at: int | None = None,
    extend_to: int | None = None,
    progress: bool = True,
    hooks: TrainingHooks | None = None,
    allow_environment_change: bool = False,
    resume_hint: str | None = None,
) -> TrainResult:
    """Train ``config`` to ``training.max_steps`` (or ``stop_at``), checkpointing locally.

    ``resume``: ``None`` (fresh run), ``"latest"``, ``"auto"`` (latest if any, else fresh)
    or a checkpoint folder. ``init_from``: a checkpoint folder or safetensors file whose
    weights start a new run. ``extend_to``: with ``resume``, continue the run to this larger
    ``max_steps`` (recorded in ``meta.json`` ``lineage``); the schedule keeps the run's first
    length, so schedules defined over ``max_steps`` hold their final value past it (no jump
    of the learning rate), and per-step ones go on as defined. ``hooks``: see :class:`TrainingHooks`.
    ``allow_environment_change``: resume even where the recorded environment (thread
    counts, determinism switches, device type, torch/NumPy) cannot be reproduced; the
    change is recorded in every later checkpoint, and the run is no longer bitwise. It
    also accepts changed code in a file that counts (:mod:`pipeline.provenance`), which
    the next checkpoints' fingerprints record.
    ``resume_hint``: the command a SIGTERM/SIGINT message tells the user to run
    (:func:`pipeline.cli.resume_command` of the actual invocation, in script 02; by
    default script 02 on this config with ``--resume latest``).
    """
    hooks = hooks or TrainingHooks()
    resume_hint = resume_hint or script_command(config, "02_train.py", "--resume", "latest")
    if config.training.parallel != "none":
        raise ConfigError(f"{config.source}: training.parallel is {config.training.parallel!r}: launch with "
                          "torchrun --standalone --nproc-per-node N scripts/02_train.py (README, 'Distributed')")
    if resume is not None and init_from is not None:
        raise PipelineError("--resume and --init-from exclude each other: --init-from starts a new run from weights")
    if extend_to is not None and resume is None:
        raise PipelineError("--extend-to continues a run: use it with --resume latest (or a checkpoint folder)")
    if stop_at is not None and stop_at < 1:
        raise PipelineError(f"--stop-at must be >= 1 (got {stop_at})")
    device = resolve_device(config)
    configure_determinism(config)
    manifest = load_manifest(config)
    store = CheckpointStore(config.checkpoint.dir, keep_last=config.checkpoint.keep_last)
    with store:
        store.clean_stale()
        start, config, lineage = _starting_point(store, resume, config, manifest["fingerprint"], extend_to,
                                                 allow_environment_change)
        resumed = start[2]["step"] if start is not None else None
        with _damage_first(start[0] if start is not None else None, store.root):
            if stop_at is not None and resumed is not None and stop_at <= resumed:
                raise PipelineError(f"--stop-at {stop_at} is not after the resume step {resumed}")

            pin_threads(config)
            changes: list[dict[str, Any]] = []
            if start is not None:
                environment = start[2]["environment"]
                new = reproduce_environment(environment, device, allow_change=allow_environment_change, step=resumed)
                changes = environment["changes"] + new
            # Build everything first, then load saved state into it (RNG states last).
            # An extended run keeps the schedule it was started with (see the docstring).
            run = build_run(config, device, schedule_steps=lineage[0]["from_max_steps"] if lineage else None)
        report = Progress(total=config.training.max_steps, initial=resumed or 0,
                          log_every=config.training.log_every, enabled=progress)
        if start is not None:
            loaded = _load_into(run, store, start)
            restore_state(run, loaded.model_tensors, loaded.meta["training_state"], loaded.state_tensors,
                          omit=hooks.skip_restore, step=loaded.meta["step"], derived=loaded.derived_buffers,
                          record=loaded.meta["model"])
            report.message(f"resumed from {loaded.folder} at step {run.step}")
            if extend_to is not None:
                report.message(f"extended from max_steps {lineage[-1]['from_max_steps']} to {extend_to} "
                               f"(recorded in meta.json lineage)")
            for change in new:
                report.message(f"environment changed: {change['item']} {change['recorded']!r} -> {change['now']!r}; "
                               "the result is no longer bitwise reproducible (recorded in meta.json)")
            del loaded  # unmaps what restore copied; the optimizer keeps its mapped state
        elif init_from is not None:
            _warm_start(run, Path(init_from), report)
        check_capturable(run)
        if hooks.on_start is not None:
            hooks.on_start(run)

        checkpointer = Checkpointer(store, run_provenance(config, manifest, device, changes, lineage),
                                    background=config.checkpoint.async_)
        try:
            saved = _loop(run, checkpointer, report, stop_at=stop_at, resumed=resumed is not None,
                          on_step=hooks.on_step, resume_hint=resume_hint)
        finally:
            report.close()
            checkpointer.close()  # waits for a save in flight; may raise its error
        return TrainResult(step=run.step, max_steps=config.training.max_steps,
                           checkpoint=final_checkpoint(saved, store, run.step), history=run.history,
                           resumed_from=resumed)


def _loop(run: TrainingRun, checkpointer: Checkpointer, report: Progress, *, stop_at: int | None, resumed: bool,
          on_step: Callable[[TrainingRun], None] | None, resume_hint: str, world: World | None = None):
    """Step to the end (or a stop signal), saving on the configured steps and the last one.

    Under torchrun a signal seen by any rank is agreed on at the top of each step (one
    small all-reduce), so every rank stops after the same step and saves it together.
    """
    every = run.config.checkpoint.every
    end = min(run.config.training.max_steps, stop_at) if stop_at is not None else run.config.training.max_steps
    last_saved = run.step if resumed else None
    saved = None
    # Closing the feed stops its DataLoader workers, whatever ends the loop.
    with _StopSignals() as signals, contextlib.closing(run.feed):
        def stop_requested() -> int | None:
            return signals.signum if world is None else world.agree_signal(signals.signum)

        stop = None
        while run.step < end and (stop := stop_requested()) is None:
            loss, lr = train_step(run, world)
            # With fp16 AMP too: the GradScaler skips steps whose gradients overflow, but a
            # non-finite loss is a diverged model, not an overflow to wait out.
            if not math.isfinite(loss):
                raise TrainingDiverged(f"loss is {loss} at step {run.step}; nothing was saved for this step and "
                                       f"the last checkpoint ({last_saved}) is kept: lower optimizer.lr or check "
                                       "the data")
            report.update(run.step, loss, lr)
            if on_step is not None:
                on_step(run)
            if run.step % every == 0 or run.step == end:
                saved = checkpointer.save(run)
                last_saved = run.step
        stop = stop_requested()
        if stop is not None and last_saved != run.step:
            saved = checkpointer.save(run)
        # A background save commits here, while SIGTERM/SIGINT are still only recorded,
        # exactly as a synchronous save would have.
        checkpointer.wait()
        if stop is not None:
            name = signal.Signals(stop).name
            where = saved.path if saved is not None else checkpointer.store.path_for(run.step)
            message = (f"stopped by {name} after step {run.step}; checkpoint {where} is committed. "
                       f"Resume with: {resume_hint}")
            if world is not None and world.rank != 0:
                raise PeerFailed(message, 128 + stop)  # rank 0 says it once
            raise Preempted(message, stop)
    return saved


def _warm_start(run: TrainingRun, source: Path, report: Progress) -> None:
    if source.is_dir():
        loaded = load_checkpoint(source)
        tensors = loaded.model_tensors
        own, derived = run.model.state_dict(), loaded.derived_buffers
        if isinstance(derived, list):  # one this model lacks or shapes otherwise is not copied below
            derived = [n for n in derived if n not in tensors or (n in own and own[n].shape == tensors[n].shape)]
        check_derived_buffers(run.model, tensors, derived)
        source = source / MODEL_FILE
    elif not source.is_file():
        raise CheckpointError(f"--init-from {source}: no such checkpoint folder or safetensors file")
    else:
        try:
            tensors = read_tensors(source)
        except SchemaMismatch as exc:
            raise CheckpointError(f"--init-from {source}: not a readable safetensors file ({exc})") from None
    result = warm_start(run.model, tensors)
    report.message(f"init-from {source}: loaded {len(result['loaded'])}, skipped {len(result['skipped'])}, "
                   f"new {len(result['new'])}")
    for kind in ("skipped", "new"):
        for name in result[kind]:
            report.message(f"  {kind}: {name}")

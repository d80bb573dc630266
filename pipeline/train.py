"""The training loop: resume or start, step, checkpoint locally, stop cleanly on signals.

No code path here talks to the network; publishing is a separate, explicit step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .accumulation import accumulate_gradients, clip_gradients, effective_batch
from .callbacks import Control
from .checkpoint import (
    Checkpointer,
    CheckpointStore,
    SavedCheckpoint,
    check_capturable,
    component_names,
    model_summary,
    open_checkpointer,
)
from .commands import with_set
from .config import Config, traces_folder
from .data import epochs_done, load_manifest
from .distributed.launch import joined
from .environment import current_environment, pin_threads
from .errors import (
    CallbackFailed,
    ConfigError,
    InputFailed,
    MetricsError,
    Preempted,
    TrainingDiverged,
    UserCodeExited,
)
from .evaluating import BestMark, evaluate_step
from .progress import Progress
from .provenance import code_fingerprint, counted_sources, factories_fingerprint, library_versions
from .run import TrainingRun, build_run, configure_determinism, fresh_buffers
from .start import Launch, StartingPoint, StartRequest, plan_start, share_start
from .traces import Traces, open_traces
from .world import World

__all__ = ["train", "train_step", "TrainResult", "TrainingHooks"]


@dataclass(kw_only=True, slots=True)
class TrainingHooks:
    """The documented seam for tools that study a run without changing the loop (the resume
    proof, ``pipeline.proof.leg``, is the one user). Plain training passes none."""

    skip_restore: tuple[str, ...] = ()
    """Components of the checkpoint left unrestored on resume (names of
    :func:`pipeline.checkpoint.component_names`): the proof's negative controls."""
    on_start: Callable[[TrainingRun], None] | None = None
    """Called once the run is built and restored, before the first step."""
    on_step: Callable[[TrainingRun], None] | None = None
    """Called after every optimizer step, before that step's evaluation and checkpoint (the last
    callback to hear ``on_step_end``)."""
    swap_rng: bool = False
    """Under torchrun: each rank restores the next rank's RNG streams (the proof's control
    for per-rank RNG state)."""

    def __post_init__(self) -> None:
        unknown = set(self.skip_restore) - set(component_names())
        if unknown:
            raise ValueError(
                f"skip_restore names unknown components {sorted(unknown)}; choose from {component_names()}"
            )


@dataclass(slots=True)
class TrainResult:
    step: int
    max_steps: int
    """The run's length (``--extend-to`` raises it above the config's)."""
    checkpoint: Path | None
    history: dict[str, list]
    resumed_from: int | None
    evaluations: dict[str, list] = dataclasses.field(default_factory=lambda: {"step": []})
    """``training.eval_every``'s values: ``{"step": [...], "<metric>": [...]}`` (``run.evaluations``)."""
    rank: int = 0
    """Under torchrun, the rank that returned this (every rank returns the same result)."""
    stopped: dict[str, Any] | None = None
    """A stop a callback asked for (early stopping, one of ``training.callbacks``): ``{"step",
    "by", "reason"}``, as meta.json records it; ``None`` for a run that was not stopped."""


class _StopSignals:
    """Record SIGTERM/SIGINT instead of dying mid-step; restore the old handlers after. A signal
    the process was started ignoring (a shell's ``&``, a wrapper) stays ignored, as in
    :func:`pipeline.stops.install`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def train_step(run: TrainingRun, world: World | None = None) -> tuple[float, float]:
    """One optimizer step of ``training.grad_accum_steps`` micro-batches
    (:mod:`pipeline.accumulation`); returns (loss, learning rate used). Under torchrun
    (``world``, by default this process alone) every rank draws the same global batches and
    trains on its slice of each; the loss returned is the step's global mean."""
    world = world or World(device=run.device)
    run.model.train()
    loss = accumulate_gradients(run, world)
    norm = clip_gradients(run, logged=(run.step + 1) % run.config.training.log_every == 0)
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    lr = float(run.optimizer.param_groups[0]["lr"])
    with warnings.catch_warnings():
        # A step the GradScaler skipped (inf gradients, alike on every rank) still moves the
        # schedule on, by design; torch warns as if optimizer.step() had been forgotten.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        run.scheduler.step()
    run.step += 1
    value = world.global_loss(loss)
    run.history["step"].append(run.step)
    run.history["loss"].append(value)
    run.history["lr"].append(lr)
    run.history["grad_norm"].append(norm)
    run.history["epoch"].append(epochs_done(run.sampler))
    return value, lr


def final_checkpoint(saved: SavedCheckpoint | None, store: CheckpointStore, step: int) -> Path | None:
    """The checkpoint a run ends on: its last save, or, when it saved nothing (a finished run
    resumed again), the committed checkpoint of its step, if any."""
    if saved is not None:
        return saved.path
    return store.path_for(step) if step in store.committed_steps() else None


def run_provenance(
    config: Config,
    manifest: dict,
    device: torch.device,
    changes: list[dict[str, Any]],
    lineage: list[dict[str, int]] | None = None,
) -> dict:
    """What every checkpoint of a run records about where it came from, and the
    environment it computes in (``changes``: accepted environment changes so far;
    ``lineage``: its --extend-to history)."""
    return {
        "config": config.to_dict(),
        "fingerprints": {
            "data": manifest["fingerprint"],
            "code": code_fingerprint(),
            "factories": factories_fingerprint(config),
            "sources": counted_sources(config),
        },
        "versions": library_versions(),
        "device": str(device),
        "environment": {**current_environment(device), "changes": changes},
        "lineage": list(lineage or []),
    }


def train(
    config: Config,
    *,
    resume: str | None = None,
    init_from: str | Path | None = None,
    stop_at: int | None = None,
    extend_to: int | None = None,
    reshard: bool = False,
    progress: bool = True,
    hooks: TrainingHooks | None = None,
    allow_environment_change: bool = False,
    resume_hint: str | None = None,
    world: World | None = None,
) -> TrainResult:
    """Train ``config`` to ``training.max_steps`` (or ``stop_at``), checkpointing locally: in
    this process, or as one rank of a torchrun launch, joined here when torchrun started this
    process (:func:`pipeline.distributed.launch.joined`; ``world``: a launch the caller joined
    and will leave, to run several trainings in it). Every rank returns the same result.

    ``resume``: ``None`` (fresh run), ``"latest"``, ``"auto"`` (latest if any, else fresh)
    or a checkpoint folder. ``init_from``: a checkpoint folder or safetensors file whose
    weights start a new run. ``extend_to``: with ``resume``, continue the run to this larger
    ``max_steps`` (recorded in ``meta.json`` ``lineage``); the schedule keeps the run's first
    length, so schedules defined over ``max_steps`` hold their final value past it (no jump
    of the learning rate), and per-step ones go on as defined. ``reshard``: with ``resume``,
    accept a checkpoint written by another launch (one process or torchrun, another number
    of processes, DDP or FSDP2), recorded in ``meta.json``. ``hooks``: see :class:`TrainingHooks`.
    ``allow_environment_change``: resume even where the recorded environment (thread
    counts, determinism switches, device type, torch/NumPy) cannot be reproduced; the
    change is recorded in every later checkpoint, and the run is no longer bitwise. It
    also accepts changed code in a file that counts (:mod:`pipeline.provenance`), which
    the next checkpoints' fingerprints record.
    ``resume_hint``: the command a SIGTERM/SIGINT message tells the user to run
    (:func:`pipeline.commands.resume_command` of the actual invocation, in script 02; by
    default the world's :meth:`~pipeline.world.World.resume_command`).
    Where the run starts, and every refusal of it, is :mod:`pipeline.start`'s.
    """
    hooks = hooks or TrainingHooks()
    request = StartRequest(
        resume=resume,
        init_from=init_from,
        extend_to=extend_to,
        stop_at=stop_at,
        reshard=reshard,
        allow_environment_change=allow_environment_change,
    )
    request.check()
    with joined(config, world) as world:
        return _train(config, world, request, hooks, progress, allow_environment_change, resume_hint)


def _train(
    config: Config,
    world: World,
    request: StartRequest,
    hooks: TrainingHooks,
    progress: bool,
    allow_environment_change: bool,
    resume_hint: str | None,
) -> TrainResult:
    """:func:`train` in the world it trains in: decide where the run starts, build and restore
    it, open what it reports to and saves with, loop, and hand back the result."""
    launch = Launch.of_run(config, world)
    config = launch.configured(config)  # training.parallel auto resolved, as checkpoints record it
    # This run's copy: its DDP bucket setting, buckets not yet settled.
    world = dataclasses.replace(
        world, find_unused_parameters=config.training.ddp_find_unused_parameters, buckets_settled=True
    )
    configure_determinism(config)
    store = CheckpointStore(config.checkpoint.dir, keep_last=config.checkpoint.keep_last)
    hint = resume_hint
    try:
        with world.together("starting"):
            manifest = load_manifest(config)
            start = _plan(store, config, manifest, request, launch, world)
        start = share_start(world, start, config, manifest["fingerprint"], request, launch)
        run, summary, changes, new = _build(start, store, world, hooks, allow_environment_change, launch)
        if world.rank == 0 and start.step is not None:
            best = run.config.checkpoint
            store.mark_best_again(run.evaluations, best.best_metric, best.best_mode)
        report = _report(run, start, world, launch, new, progress)
        hint = resume_hint or world.resume_command(run.config)
        traces = _session_callbacks(run, world, report, hooks)
        provenance = run_provenance(run.config, manifest, world.device, changes, start.lineage)
        checkpointer = open_checkpointer(
            store,
            world,
            provenance,
            summary,
            resharded_from=start.resharded_from(world.world_size),
            background=run.config.checkpoint.async_,
        )
        control = Control(
            say=report.message, agree=world.agree_flags if run.callbacks.of_user and world.launched else None
        )
        try:
            saved = _loop(
                run,
                world,
                checkpointer,
                control,
                end=_end(run, request.stop_at),
                resumed=start.step is not None,
                resume_hint=hint,
                note_stops=launch.parallel != "none",
            )
        finally:
            if traces is not None:
                traces.close(run)
            report.close()
            checkpointer.close()  # waits for a save in flight; may raise its error
        return TrainResult(
            step=run.step,
            max_steps=run.config.training.max_steps,
            checkpoint=final_checkpoint(saved, store, run.step),
            history=run.history,
            resumed_from=start.step,
            rank=world.rank,
            evaluations=run.evaluations,
            stopped=run.callbacks.stopped,
        )
    except (InputFailed, TrainingDiverged, MetricsError, CallbackFailed) as exc:
        # Said here, after the checkpointer closed: a save that was in flight is committed now.
        raise type(exc)(f"{exc}; {_where_to_go_on(store, hint)}") from exc.__cause__
    except BaseException as exc:
        if isinstance(exc, (Exception, KeyboardInterrupt)):
            raise
        # SystemExit(0) from a dataset, a loss, a factory: the run did not finish, so never exit 0.
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ is not None else None
        raise UserCodeExited(
            f"the task's code raised {exc!r}"
            f"{f' at {where.filename}:{where.lineno} ({where.name})' if where is not None else ''} before the "
            f"run reached its last step; {_where_to_go_on(store, hint)}"
        ) from exc
    finally:
        store.release()


def _plan(
    store: CheckpointStore,
    config: Config,
    manifest: dict,
    request: StartRequest,
    launch: Launch,
    world: World,
) -> StartingPoint | None:
    """Where the run starts, decided by the first rank, which holds the store's lock for the launch."""
    if world.rank != 0:
        return None
    store.acquire()
    store.clean_stale()
    return plan_start(store, config, manifest["fingerprint"], request, launch)


def _build(
    start: StartingPoint,
    store: CheckpointStore,
    world: World,
    hooks: TrainingHooks,
    allow_environment_change: bool,
    launch: Launch,
) -> tuple[TrainingRun, dict[str, Any], list[dict], list[dict]]:
    """The run built from its config, then its checkpoint loaded into it (RNG states last): the
    run, its plain model's summary, the environment's accepted changes so far and this start's."""
    summary: dict[str, Any] = {}

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        # The model as one process stores it, before a wrapper prefixes its names (a launch's
        # checkpointer records it).
        summary.update(model_summary(model, fresh_buffers(model)))
        return world.wrap(start.prepare(model, world), start.config)

    with world.together("resuming"), start.damage_first(store.root):
        pin_threads(start.config)
        changes, new = start.environment(world.device, allow_change=allow_environment_change)
        # Build everything first, then load saved state into it (RNG states last).
        # An extended run keeps the schedule it was started with (see the docstring).
        run = build_run(
            start.config, world.device, schedule_steps=start.schedule_steps, wrap=prepare, world=world
        )
        start.restore(run, world, store.root, omit=hooks.skip_restore, swap_rng=hooks.swap_rng)
        if start.extended:  # --extend-to trains a run further, whatever stopped it
            run.callbacks.stopped = None
        if launch.parallel == "none":  # a launch's state is captured together (a stream's positions)
            check_capturable(run)
        if hooks.on_start is not None:
            hooks.on_start(run)
        if world.rank == 0:  # the run continues: a stop's note would name a launch of the past
            store.note_resume(None)
    return run, summary, changes, new


def _report(
    run: TrainingRun, start: StartingPoint, world: World, launch: Launch, new: list[dict], progress: bool
) -> Progress:
    """The run's progress (the first process's), with what it says about its start."""
    report = Progress(
        total=run.config.training.max_steps,
        initial=start.step or 0,
        log_every=run.config.training.log_every,
        enabled=progress and world.rank == 0,
    )
    for line in [*start.messages(new, launch), *run.callbacks.notes]:
        report.message(line)
    if (batch := effective_batch(run, world)) is not None:
        report.message(batch)
    if run.callbacks.stopped is not None:  # N past the run's length, which a stop may be short of
        further = max(run.step, run.config.training.max_steps)
        report.message(
            _stopped_line(run.callbacks.stopped) + f"; --extend-to N (N > {further}) trains it further"
        )
    return report


def _session_callbacks(
    run: TrainingRun, world: World, report: Progress, hooks: TrainingHooks
) -> Traces | None:
    """The callbacks of this start, after those restored: the progress report, the best mark's
    save, the traces (the first process's, rebuilt from the restored history:
    :mod:`pipeline.traces`), a tool's hook."""
    config = run.config
    run.callbacks.add("progress", report, first=True)
    if config.checkpoint.best_metric:
        run.callbacks.add("best", BestMark(config.checkpoint.best_metric, config.checkpoint.best_mode))
    traces = None
    if world.rank == 0:
        traces = open_traces(
            traces_folder(config.outputs.traces, config.checkpoint.dir),
            run,
            log_every=config.training.log_every,
            say=report.message,
            data_dir=config.data.dir,
        )
    if traces is not None:
        run.callbacks.add("traces", traces)
    if hooks.on_step is not None:
        run.callbacks.add("hooks", _StepHook(hooks.on_step))
    return traces


class _StepHook:
    """:attr:`TrainingHooks.on_step` as a callback: after every step, before its checkpoint."""

    def __init__(self, on_step: Callable[[TrainingRun], None]) -> None:
        self.on_step = on_step

    def on_step_end(self, run: TrainingRun, control: Control) -> None:
        self.on_step(run)


def _end(run: TrainingRun, stop_at: int | None) -> int:
    """The step this start trains to: the run's length, ``--stop-at``'s, or, for a run a callback
    stopped, where it stopped (no further: ``--extend-to`` clears the stop)."""
    if run.callbacks.stopped is not None:
        return run.step
    length = run.config.training.max_steps
    return length if stop_at is None else min(length, stop_at)


def _stopped_line(stopped: dict[str, Any]) -> str:
    return f"stopped early at step {stopped['step']}: {stopped['reason']} (recorded in meta.json)"


def _where_to_go_on(store: CheckpointStore, resume_hint: str | None) -> str:
    """What a failed run can go on from: its last committed checkpoint, or a new start."""
    steps = store.committed_steps()
    if not steps:
        return "no checkpoint was committed yet: fix it and run the same command again"
    return (
        f"the last committed checkpoint (step {steps[-1]}) is intact: fix it and resume with "
        f"{resume_hint or '--resume latest'}"
    )


class _Saves:
    """The run's checkpoint saves, and each one's ``on_save`` once it is committed: at once for
    a synchronous save; for a background one at the end of the first step that finds it
    committed (on every rank: under torchrun the ranks agree it is), or when the next save or
    the end waits for it. Nothing is asked of the save in flight when no callback listens."""

    def __init__(
        self, run: TrainingRun, checkpointer: Checkpointer, control: Control, last: int | None
    ) -> None:
        self.run, self.checkpointer, self.control = run, checkpointer, control
        self.last_step = last
        self.saved: SavedCheckpoint | Any = None
        self._pending = False
        self._listening = run.callbacks.listen("on_save")

    def save(self) -> None:
        self._heard(self.checkpointer.wait())
        self.saved, self.last_step = self.checkpointer.save(self.run), self.run.step
        self._pending = not isinstance(self.saved, SavedCheckpoint)
        if not self._pending:
            self._heard(self.saved)

    def poll(self) -> None:
        """Hear a background save that committed meanwhile."""
        if not (self._pending and self._listening):
            return
        committed = self.saved.done()
        if self.control.agree is not None:  # every rank hears it at the same step, or none
            committed = not self.control.agree([int(not committed)])[0]
        if committed:
            self._heard(self.checkpointer.wait())

    def finish(self) -> None:
        """The save in flight committed (its error raised here), and heard."""
        self._heard(self.checkpointer.wait())

    def _heard(self, saved: SavedCheckpoint | None) -> None:
        self._pending = False
        if saved is not None:
            self.run.callbacks.on_save(self.run, saved, self.control)


def _loop(
    run: TrainingRun,
    world: World,
    checkpointer: Checkpointer,
    control: Control,
    *,
    end: int,
    resumed: bool,
    resume_hint: str,
    note_stops: bool,
):
    """Step to ``end``, a stop a callback asks for, or a stop signal, saving the steps the
    callbacks ask for and the last one.

    Under torchrun a signal seen by any rank is agreed on at the top of each step (one
    small all-reduce), so every rank stops after the same step and saves it together.
    ``note_stops``: a stop's resume command is also written to the store's note (under
    torchrun the stop's own line scrolls away under torchrun's report).
    """
    saves = _Saves(run, checkpointer, control, run.step if resumed else None)
    # Closing the feed stops its DataLoader workers, whatever ends the loop.
    with _StopSignals() as signals, contextlib.closing(run.feed):

        def stop_requested() -> int | None:
            return world.agree_signal(signals.signum)

        stopped, stop = False, None
        while run.step < end and not stopped and (stop := stop_requested()) is None:
            stopped = _step(run, world, control, saves, end, resume_hint)
        stop = stop_requested()
        if stop is not None and saves.last_step != run.step:
            saves.save()
        # A background save commits here, while SIGTERM/SIGINT are still only recorded,
        # exactly as a synchronous save would have.
        saves.finish()
        if stop is not None:
            _preempted(run, world, checkpointer.store, saves.saved, stop, resume_hint, note_stops)
    return saves.saved


def _step(
    run: TrainingRun,
    world: World,
    control: Control,
    saves: _Saves,
    end: int,
    resume_hint: str,
) -> bool:
    """One optimizer step and what the callbacks ask of it: an evaluation, a save, a stop
    (``True``: the run ends after this step)."""
    loss, _ = train_step(run, world)
    # With fp16 AMP too: the GradScaler skips steps whose gradients overflow, but a
    # non-finite loss is a diverged model, not an overflow to wait out.
    if not math.isfinite(loss):
        raise TrainingDiverged(
            f"loss is {loss} at step {run.step}, nothing was saved for it: lower optimizer.lr or check the data"
        )
    run.callbacks.on_step_end(run, control)
    evaluation = evaluate_step(run, world, run.callbacks, control) if control.should_evaluate else None
    refused = evaluation is not None and evaluation.refusal is not None
    stopping = control.should_training_stop and run.step < run.config.training.max_steps
    if stopping:
        gather = world.gather_text if control.agree is not None else None
        control.say(_stopped_line(run.callbacks.record_stop(run.step, control, gather)))
    if control.should_save or stopping or refused or run.step == end:
        saves.save()
    control.step_done()
    saves.poll()
    if refused:
        saves.finish()
        resume = resume_hint if evaluation.fix is None else with_set(resume_hint, evaluation.fix)
        raise ConfigError(f"{evaluation.refusal}; step {run.step} is committed: resume with {resume}")
    return stopping


def _preempted(
    run: TrainingRun,
    world: World,
    store: CheckpointStore,
    saved: Any,
    stop: int,
    resume_hint: str,
    note_stops: bool,
) -> None:
    """End a run stopped by a signal, its step committed, with the command that resumes it."""
    name = signal.Signals(stop).name
    where = saved.path if saved is not None else store.path_for(run.step)
    if run.step >= run.config.training.max_steps or run.callbacks.stopped is not None:
        # Nothing is left to resume: the run reached its last step, or a callback ended it.
        raise Preempted(
            f"stopped by {name} after the last step, {run.step}: the run is complete; its checkpoint "
            f"{where} is committed",
            stop,
            quiet=world.rank != 0,
        )
    message = f"stopped by {name} after step {run.step}; checkpoint {where} is committed. Resume with: {resume_hint}"
    if note_stops:
        # Rank 0 writes the note; every rank's line names it, since torchrun's report
        # quotes whichever rank ended first.
        try:
            first = world.rank == 0
            note = store.note_resume(resume_hint) if first else store.resume_note_path
            message += f" (saved in {note})"
        except OSError:
            pass  # the line says it all the same
    # Under torchrun rank 0 says it once; torchrun's own report follows it.
    raise Preempted(message, stop, quiet=world.rank != 0)

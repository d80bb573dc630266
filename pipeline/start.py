"""Where a run starts, in one process and under torchrun alike.

A run starts fresh, resumes a checkpoint, extends it (``--extend-to``), moves it to another
launch (``--reshard``: one process <-> torchrun, another number of processes, DDP <-> FSDP2)
or starts from another run's weights (``--init-from``). :func:`plan_start` decides which,
once, and runs every refusal (under torchrun on rank 0, which holds the store's lock);
:func:`share_start` gives the other ranks the same decision. The :class:`StartingPoint`
then loads into the run built from it: :meth:`~StartingPoint.prepare` the plain model
before DDP or FSDP2 wraps it, :meth:`~StartingPoint.restore` the rest. The trainer,
:func:`pipeline.train.train`, decides none of this itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .checkpoint import (
    LoadedCheckpoint,
    LoadMode,
    check_derived_buffers,
    checkpoint_meta,
    continued_config,
    is_distributed,
    load_checkpoint,
    load_model_weights,
    read_meta,
    read_tensors,
    restore_state,
    warm_start,
)
from .commands import script_command, torchrun_launcher
from .config import Config, launch_mode
from .environment import reproduce_environment
from .errors import (
    CheckpointError,
    ChecksumMismatch,
    ConfigError,
    LaunchMismatch,
    PipelineError,
    SchemaMismatch,
    WorldSizeMismatch,
)
from .layout import MODEL_FILE
from .provenance import check_code_unchanged
from .run import TrainingRun
from .world import World

__all__ = ["Launch", "StartRequest", "StartingPoint", "plan_start", "share_start"]


@dataclass(frozen=True, slots=True)
class Launch:
    """How a run's processes are laid out: what a resume must match, unless ``--reshard``."""

    parallel: str
    """``training.parallel`` as run: none, ddp or fsdp2 (never auto)."""
    world_size: int
    ddp_find_unused_parameters: bool | None = None
    """DDP only: the setting decides how gradients are bucketed, so the reduction order."""
    declared: str = field(default="auto", compare=False, repr=False)
    """``training.parallel`` as the config gave it (auto included): what a printed command
    need not repeat."""

    @classmethod
    def of_run(cls, config: Config, world: World) -> "Launch":
        """This run's launch, ``auto`` resolved to the mode ``world`` runs (a launch joined
        runs the config's: :func:`pipeline.config.launch_mode`); an explicit ddp or fsdp2 in
        one process, not torchrun's, is refused."""
        declared = config.training.parallel
        parallel = world.mode if declared == "auto" else declared
        if parallel != world.mode:
            torchrun = script_command(config, "02_train.py", launcher=torchrun_launcher("N"))
            raise ConfigError(
                f"{config.source}: training.parallel is {parallel!r}, which trains under torchrun: "
                f"launch with {torchrun}, or set training.parallel to auto for one process "
                "(docs/distributed.md)"
            )
        return cls(
            parallel,
            world.world_size,
            config.training.ddp_find_unused_parameters if parallel == "ddp" else None,
            declared,
        )

    def configured(self, config: Config) -> Config:
        """``config`` with the mode this launch runs, as its checkpoints record it."""
        return dataclasses.replace(
            config, training=dataclasses.replace(config.training, parallel=self.parallel)
        )

    @classmethod
    def of_checkpoint(cls, meta: dict[str, Any]) -> "Launch":
        if not is_distributed(meta):
            return cls("none", 1)
        record = meta["parallel"]
        return cls(
            record["mode"],
            record["world_size"],
            record["ddp_find_unused_parameters"] if record["mode"] == "ddp" else None,
        )

    def describe(self) -> str:
        processes = "one process" if self.world_size == 1 else f"{self.world_size} processes"
        bucket = (
            ""
            if self.ddp_find_unused_parameters is None
            else f", ddp_find_unused_parameters {str(self.ddp_find_unused_parameters).lower()}"
        )
        return f"{processes} (training.parallel {self.parallel}{bucket})"

    def command(self, config: Config, resume: str, declared: str) -> str:
        """The command that resumes ``config``'s run from ``resume`` in this launch (one node),
        given its ``training.parallel`` as ``declared``: a ``--set`` of the launch's keys only
        where the config does not already choose this launch (each replaces the config's own)."""
        torchrun = self.parallel != "none"
        sets = []
        if launch_mode(declared, self.world_size if torchrun else None) != self.parallel:
            sets += ["--set", f"training.parallel={self.parallel}"]
        if self.ddp_find_unused_parameters not in (None, config.training.ddp_find_unused_parameters):
            sets += [
                "--set",
                f"training.ddp_find_unused_parameters={str(self.ddp_find_unused_parameters).lower()}",
            ]
        return script_command(
            config,
            "02_train.py",
            *sets,
            "--resume",
            resume,
            launcher=torchrun_launcher(self.world_size) if torchrun else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "parallel": self.parallel,
            "world_size": self.world_size,
            "ddp_find_unused_parameters": self.ddp_find_unused_parameters,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class StartRequest:
    """What the command line asks for (see :func:`pipeline.train.train`)."""

    resume: str | None = None
    init_from: str | Path | None = None
    extend_to: int | None = None
    stop_at: int | None = None
    reshard: bool = False
    allow_environment_change: bool = False

    def check(self) -> None:
        """The refusals that need nothing but the arguments."""
        if self.resume is not None and self.init_from is not None:
            raise PipelineError(
                "--resume and --init-from exclude each other: --init-from starts a new run from weights"
            )
        if self.extend_to is not None and self.resume is None:
            raise PipelineError(
                "--extend-to continues a run: use it with --resume latest (or a checkpoint folder)"
            )
        if self.reshard and self.resume is None:
            raise PipelineError(
                "--reshard moves a run to another launch: use it with --resume latest (or a "
                "checkpoint folder)"
            )
        if self.stop_at is not None and self.stop_at < 1:
            raise PipelineError(f"--stop-at must be >= 1 (got {self.stop_at})")


@dataclass(kw_only=True, slots=True)
class StartingPoint:
    """A run's start, decided by :func:`plan_start`: fresh (``meta`` None, maybe warm-started
    from ``init_from``) or the checkpoint ``folder`` it continues."""

    config: Config
    """The config the run continues with (``max_steps`` as its lineage says)."""
    lineage: list[dict[str, int]] = field(default_factory=list)
    """``meta.json`` ``lineage``: the run's ``--extend-to`` history, this start's included."""
    spec: str | None = None
    """What ``--resume`` named, as the store resolves it (for "latest", a refusal names an older
    checkpoint that verifies)."""
    folder: Path | None = None
    meta: dict[str, Any] | None = None
    verified: bool = False
    """Every file of ``folder`` hashed already (else the load into the run verifies them)."""
    launch_change: dict[str, Any] | None = None
    """``{"recorded", "now"}`` launches of a run moved with ``--reshard``."""
    extended: bool = False
    """``--extend-to`` raised the run's length at this start (the last lineage entry)."""
    init_from: Path | None = None
    warm_report: list[str] = field(default_factory=list)
    loaded: LoadedCheckpoint | None = None
    """A single-process checkpoint read whole by this rank of a launch (``prepare``)."""

    @property
    def step(self) -> int | None:
        """The step the run resumes after (``None``: a new run)."""
        return self.meta["step"] if self.meta is not None else None

    @property
    def schedule_steps(self) -> int | None:
        """An extended run keeps the schedule it was started with (``pipeline.train.train``)."""
        return self.lineage[0]["from_max_steps"] if self.lineage else None

    def resharded_from(self, world_size: int) -> int | None:
        """A distributed checkpoint's ``resharded_from``: the world size this run last came from."""
        if self.meta is None:
            return None
        recorded = Launch.of_checkpoint(self.meta).world_size
        if recorded != world_size:
            return recorded
        return self.meta.get("resharded_from")

    @contextlib.contextmanager
    def damage_first(self, root: Path) -> Iterator[None]:
        """A refusal met before the checkpoint's files are verified (they are verified as
        they load into the run, which is built from its meta.json first) names the damage
        instead when they are damaged: as every reader does, damage is reported first."""
        try:
            yield
        except PipelineError as refusal:
            # A damaged file already named (a distributed load verifies as it reads) is the damage.
            if self.spec is not None and not self.verified and not isinstance(refusal, ChecksumMismatch):
                load_checkpoint(self.spec, root, mode=LoadMode.VERIFY)
            raise

    def environment(self, device: torch.device, *, allow_change: bool) -> tuple[list[dict], list[dict]]:
        """(every accepted change of the environment so far, this start's new ones): the
        recorded thread counts restored, the rest compared (:mod:`pipeline.environment`);
        a move to another launch is one more change, recorded like them."""
        if self.meta is None:
            return [], []
        recorded = self.meta["environment"]
        new = reproduce_environment(recorded, device, allow_change=allow_change, step=self.step)
        if self.launch_change is not None:
            new.append({"item": "launch", **self.launch_change, "step": self.step})
        return recorded["changes"] + new, new

    def prepare(self, model: torch.nn.Module, world: World) -> torch.nn.Module:
        """The freshly built model, before DDP or FSDP2 wraps it (and before the optimizer
        takes its parameters): warm-started (``--init-from``), or, for a single-process
        checkpoint continued under torchrun, loaded with its weights (each rank reads and
        verifies it whole; FSDP2 then keeps each rank's shard)."""
        if self.init_from is not None:
            self.warm_report = _warm_start(model, self.init_from)
        elif self.meta is not None and world.launched and not is_distributed(self.meta):
            self.loaded = load_checkpoint(self.folder)
            load_model_weights(
                model,
                self.loaded.model_tensors,
                derived=self.loaded.derived_buffers,
                record=self.loaded.meta["model"],
            )
        return model

    def restore(
        self,
        run: TrainingRun,
        world: World,
        root: Path,
        *,
        omit: Iterable[str] = (),
        swap_rng: bool = False,
    ) -> None:
        """Load the checkpoint into the built run: weights (unless :meth:`prepare` did),
        optimizer, scheduler, data position, scaler, step and history, RNG states last."""
        if self.meta is None:
            world.seed_rank(run.config.training.seed, 0)
            return
        # torch.distributed.checkpoint is imported only where a launch or a checkpoint needs it.
        if is_distributed(self.meta):
            from .checkpoint import restore_distributed

            restore_distributed(run, world, self.folder, self.meta, omit=omit, swap_rng=swap_rng)
        elif self.loaded is not None:  # a launch's rank read it whole in prepare
            from .checkpoint import restore_from_single

            restore_from_single(run, world, self.loaded, omit=omit)
            self.loaded = None
        else:
            loaded = load_checkpoint(self.spec, root, into=run.model)
            if (
                loaded.folder != self.folder or loaded.meta != self.meta
            ):  # we hold the lock: an outside writer
                raise CheckpointError(f"{self.folder} changed while it was being loaded: resume again")
            self.verified = True
            restore_state(
                run,
                loaded.model_tensors,
                loaded.meta["training_state"],
                loaded.state_tensors,
                omit=omit,
                step=loaded.meta["step"],
                derived=loaded.derived_buffers,
                record=loaded.meta["model"],
            )
            del loaded  # unmaps what restore copied; the optimizer keeps its mapped state

    def messages(self, new_changes: list[dict[str, Any]], launch: Launch) -> list[str]:
        """What the run says about its start in ``launch`` (rank 0 prints them)."""
        lines = []
        if self.meta is not None:
            where = (
                f" ({launch.world_size} processes, {launch.parallel})" if launch.parallel != "none" else ""
            )
            lines.append(f"resumed from {self.folder} at step {self.step}{where}")
            if self.extended:
                lines.append(
                    f"extended from max_steps {self.lineage[-1]['from_max_steps']} to "
                    f"{self.lineage[-1]['to_max_steps']} (recorded in meta.json lineage)"
                )
        for change in new_changes:
            if change["item"] == "launch":
                lines.append(
                    f"moved from {Launch(**change['recorded']).describe()} to "
                    f"{Launch(**change['now']).describe()} at step {change['step']}; the result is no "
                    "longer bitwise that of the first launch (recorded in meta.json)"
                )
            else:
                lines.append(
                    f"environment changed: {change['item']} {change['recorded']!r} -> {change['now']!r}; "
                    "the result is no longer bitwise reproducible (recorded in meta.json)"
                )
        return lines + self.warm_report


def plan_start(
    store: Any, config: Config, data_fingerprint: str, request: StartRequest, launch: Launch
) -> StartingPoint:
    """Decide where the run starts (holding ``store``'s lock; under torchrun, rank 0) and
    refuse what would not continue the run exactly: a fresh run over committed checkpoints,
    a resume behind newer ones (either would interleave two runs' steps in one folder),
    another config or data (:func:`pipeline.checkpoint.continued_config`), or another
    launch without ``--reshard``.

    A checkpoint continued in the same single process is verified as it loads into the run
    (one pass over its bytes), a distributed one as each rank reads its files into the run;
    a single-process one continued under torchrun is verified whole here, before any rank
    reads it."""
    spec = store.resume_target(request.resume)
    if spec is None:
        if request.extend_to is not None:
            raise PipelineError(
                f"--extend-to continues a run, but {store.root}/ holds no checkpoint to continue: "
                "train it first (--max-steps sets the length of a new run)"
            )
        return StartingPoint(
            config=config, init_from=None if request.init_from is None else Path(request.init_from)
        )
    folder, meta = checkpoint_meta(spec, store.root)
    start = StartingPoint(config=config, spec=spec, folder=folder, meta=meta)
    # A distributed checkpoint is verified as it loads too, each rank the files it reads.
    if not is_distributed(meta) and (launch.world_size > 1 or launch.parallel != "none"):
        loaded = load_checkpoint(spec, store.root, mode=LoadMode.VERIFY)
        start.folder, start.meta, start.verified = loaded.folder, loaded.meta, True
    with start.damage_first(store.root):
        step = start.meta["step"]
        newer = [s for s in store.committed_steps() if s > step]
        in_store = Path(start.folder).resolve().parent == store.root.resolve()
        if newer and in_store:
            raise CheckpointError(
                f"{store.root}/ holds step {newer[-1]}, newer than the resume point {step}: resume from "
                f"latest, or continue step {step} in a new folder with --resume {shlex.quote(str(start.folder))} "
                "--checkpoint-dir DIR"
            )
        _continue(start, data_fingerprint, request, launch, "latest" if in_store else str(start.folder))
        if request.stop_at is not None and request.stop_at <= step:
            raise PipelineError(f"--stop-at {request.stop_at} is not after the resume step {step}")
    return start


def _continue(
    start: StartingPoint, data_fingerprint: str, request: StartRequest, launch: Launch, resume: str
) -> None:
    """The launch and the config a resume continues with, or the refusal naming the command
    that resumes it from ``resume`` as it was launched (every rank runs this on the same
    sealed meta.json, so every rank decides alike)."""
    recorded = Launch.of_checkpoint(start.meta)
    if recorded != launch:
        if not request.reshard:
            raise _launch_mismatch(start.folder, recorded, launch, start.config, resume)
        start.launch_change = {"recorded": recorded.to_dict(), "now": launch.to_dict()}
    start.config, start.lineage = continued_config(
        start.meta, start.config, data_fingerprint, extend_to=request.extend_to
    )
    if not request.allow_environment_change:
        check_code_unchanged(start.meta, start.config, use="resume")
    start.extended = request.extend_to is not None


def _launch_mismatch(
    folder: Path, recorded: Launch, now: Launch, config: Config, resume: str
) -> LaunchMismatch:
    command = recorded.command(config, resume, now.declared)
    if (recorded.parallel, recorded.ddp_find_unused_parameters) == (
        now.parallel,
        now.ddp_find_unused_parameters,
    ):
        return WorldSizeMismatch(
            f"{folder} was written by {recorded.world_size} processes, this launch has "
            f"{now.world_size}: relaunch as it was launched ({command}), or pass --reshard to "
            "redistribute it (RNG streams are then re-derived)"
        )
    return LaunchMismatch(
        f"{folder} was written by {recorded.describe()}, this run is {now.describe()}: resume it "
        f"as it was launched ({command}), or pass --reshard to move the run to this "
        "launch (recorded in meta.json; docs/distributed.md)"
    )


def share_start(
    world: World,
    start: StartingPoint | None,
    config: Config,
    data_fingerprint: str,
    request: StartRequest,
    launch: Launch,
) -> StartingPoint:
    """Rank 0's decision on every rank: the checkpoint's folder is broadcast, the others read
    its sealed meta.json and derive the same config (the files are verified as they load)."""
    folder = world.broadcast_text(
        str(start.folder) if start is not None and start.folder is not None else None
    )
    first = world.rank == 0
    if first:
        return start
    if not folder:
        return StartingPoint(
            config=config, init_from=None if request.init_from is None else Path(request.init_from)
        )
    shared = StartingPoint(config=config, folder=Path(folder), meta=read_meta(Path(folder)), verified=True)
    _continue(shared, data_fingerprint, request, launch, str(folder))
    return shared


def _warm_start(model: torch.nn.Module, source: Path) -> list[str]:
    """``--init-from``: weights only, shape-tolerant; what was loaded, skipped and new."""
    if source.is_dir():
        loaded = load_checkpoint(source, mode=LoadMode.WEIGHTS)
        tensors = loaded.model_tensors
        own, derived = model.state_dict(), loaded.derived_buffers
        if isinstance(derived, list):  # one this model lacks or shapes otherwise is not copied below
            derived = [
                n for n in derived if n not in tensors or (n in own and own[n].shape == tensors[n].shape)
            ]
        check_derived_buffers(model, tensors, derived)
        if (
            MODEL_FILE in loaded.meta["files"]
        ):  # a distributed checkpoint's shards were consolidated by the load
            source = source / MODEL_FILE
    elif not source.is_file():
        raise CheckpointError(f"--init-from {source}: no such checkpoint folder or safetensors file")
    else:
        try:
            tensors = read_tensors(source)
        except SchemaMismatch as exc:
            raise CheckpointError(f"--init-from {source}: not a readable safetensors file ({exc})") from None
    result = warm_start(model, tensors)
    lines = [
        f"init-from {source}: loaded {len(result['loaded'])}, skipped {len(result['skipped'])}, "
        f"new {len(result['new'])}"
    ]
    return lines + [f"  {kind}: {name}" for kind in ("skipped", "new") for name in result[kind]]

"""The sections of what a run computes and how it is saved: ``data``, ``model``, ``optimizer``,
``scheduler``, ``training`` and ``checkpoint``. Each value is checked as its section is built,
the key named in the one-line refusal (the file's name is added by
:func:`~pipeline.config.sections.config_from_dict`).
"""

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from ..layout import CHECKPOINT_DIR, DATA_DIR
from .values import check_params as _check_params
from .values import require as _require
from .values import require_choice as _require_choice
from .values import require_int as _require_int

__all__ = [
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "CheckpointConfig",
    "METRIC_NAME",
    "DEFAULT_MAX_STEPS",
]


StreamSplit = Literal["examples", "shards"]


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the prepared data lives and how it is batched."""

    prepare: str = "pipeline.tasks.regression:prepare_data"
    """Import path ``module:function`` that writes the data files (script 01)."""
    factory: str = "pipeline.tasks.regression:build_data"
    """Import path of the function that loads prepared data for training and evaluation."""
    dir: str = DATA_DIR
    """Folder for prepared data and its ``manifest.json`` of SHA-256 fingerprints."""
    seed: int = 1234
    """Seed of the data generation (script 01); training randomness has its own seed."""
    batch_size: int = 4
    """Examples per micro-batch (the global one: under torchrun each rank trains on its share); an
    optimizer step takes ``training.grad_accum_steps`` of them."""
    shuffle: bool = True
    """Draw a new permutation of the training rows at the start of every epoch."""
    drop_last: bool = False
    """Drop a final short batch instead of yielding it."""
    num_workers: int = 0
    """DataLoader worker processes reading a map-style ``train_dataset`` (0: in the training
    process). Results do not depend on it: each sample is seeded by (seed, epoch, index)."""
    sample_timeout: float = 0.0
    """Seconds one step's batch may take to arrive (its samples read, transformed and
    collated, in DataLoader workers or in the training process; a stream's records too);
    past it the run ends in one line, its last checkpoint intact. 0: wait for ever."""
    stream_split: StreamSplit = "examples"
    """How a stream is split over torchrun ranks: 'examples' (rank r keeps every W-th record:
    the same global batches at any world size) or 'shards' (each rank reads only its files)."""
    params: dict = field(default_factory=dict)
    """Task-specific settings passed to the data factories, which validate them."""

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, "data.num_workers", f"must be >= 0 (got {self.num_workers})")
        _require(
            0 <= self.sample_timeout < math.inf,
            "data.sample_timeout",
            f"must be a number of seconds >= 0, 0 for no limit (got {self.sample_timeout})",
        )
        _require_choice(self.stream_split, StreamSplit, "data.stream_split")
        _require(":" in self.prepare, "data.prepare", "must look like 'package.module:function'")
        _require(":" in self.factory, "data.factory", "must look like 'package.module:function'")
        _require_int(self.batch_size, "data.batch_size", 1)
        _require(bool(self.dir), "data.dir", "must not be empty")
        _require_int(self.seed, "data.seed", 0)
        _check_params(self.params, "data.params")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The architecture. Everything here must match exactly on resume."""

    factory: str = "pipeline.tasks.regression:build_model"
    """Import path of ``f(config) -> torch.nn.Module``."""
    name: str = "regression-mlp"
    """Short model name used in the model card."""
    params: dict = field(default_factory=dict)
    """Architecture settings passed to the factory, which validates them."""

    def __post_init__(self) -> None:
        _require(":" in self.factory, "model.factory", "must look like 'package.module:function'")
        _require(bool(self.name), "model.name", "must not be empty")
        _check_params(self.params, "model.params")


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """The optimizer, built by a factory from the model's parameters."""

    factory: str = "pipeline.factories:adam"
    """Import path of ``f(model, config) -> torch.optim.Optimizer``."""
    lr: float = 1e-2
    """Base learning rate."""
    weight_decay: float = 0.0
    """Weight decay (applied to the decay group only, where the factory makes groups)."""
    params: dict = field(default_factory=dict)
    """Extra keyword arguments for the optimizer (betas, eps, ...)."""

    def __post_init__(self) -> None:
        _require(":" in self.factory, "optimizer.factory", "must look like 'package.module:function'")
        _require(
            math.isfinite(self.lr) and self.lr > 0,
            "optimizer.lr",
            f"must be a finite number > 0 (got {self.lr})",
        )
        _require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "optimizer.weight_decay",
            f"must be a finite number >= 0 (got {self.weight_decay})",
        )
        _check_params(self.params, "optimizer.params")


@dataclass(kw_only=True, slots=True)
class SchedulerConfig:
    """The learning-rate schedule, stepped once per optimizer step."""

    factory: str = "pipeline.factories:step_lr"
    """Import path of ``f(optimizer, config) -> LRScheduler``."""
    params: dict = field(default_factory=dict)
    """Schedule settings passed to the factory (step_size, gamma, warmup_steps, ...)."""

    def __post_init__(self) -> None:
        _require(":" in self.factory, "scheduler.factory", "must look like 'package.module:function'")
        _check_params(self.params, "scheduler.params")


Device = Literal["cpu", "cuda", "auto"]
DType = Literal["float32", "float64", "bfloat16", "float16"]
Amp = Literal["none", "fp16", "bf16"]
Parallel = Literal["auto", "none", "ddp", "fsdp2"]


_CHOICES = {"device": Device, "dtype": DType, "amp": Amp, "parallel": Parallel}
DEFAULT_MAX_STEPS = 10


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The training loop."""

    seed: int = 0
    """Seed of every training RNG: Python, NumPy (Generator and legacy) and torch."""
    max_steps: int | None = None
    """Total optimizer steps of the run (10 when neither it nor ``epochs`` is given); the
    schedule depends on it. ``--extend-to`` raises it for a run that exists; the schedule then
    keeps the run's first length (a schedule over max_steps holds its final value instead of
    jumping back up)."""
    epochs: int = 0
    """The run's length in passes over the training set instead of ``max_steps`` (0: off;
    giving both is refused): max_steps becomes epochs x the batches of one epoch (with
    ``data.drop_last``) / ``grad_accum_steps``, rounded up, counted when the run starts and
    recorded in its checkpoints. The number of processes does not change it: ``data.batch_size``
    is the global batch. A stream has no length to count: give max_steps."""
    device: Device = "cpu"
    """'cpu', 'cuda', or 'auto' (cuda when available)."""
    dtype: DType = "float32"
    """Parameter dtype. float32 is the fast default; the built-in regression task's config.yaml
    asks for float64, whose last bits make its resume proof's comparisons sharp."""
    amp: Amp = "none"
    """Automatic mixed precision: 'none', 'fp16' (with a GradScaler) or 'bf16'."""
    grad_clip: float = 0.0
    """Clip the gradient norm to this value; 0 disables clipping."""
    deterministic: bool = True
    """Ask torch for deterministic kernels (``torch.use_deterministic_algorithms``)."""
    threads: int = 1
    """Intra-op CPU threads, pinned at the start of a run and recorded in every checkpoint;
    a resume restores the recorded count (the count changes how sums are split)."""
    log_every: int = 1
    """Steps between log lines when stdout is not a terminal."""
    grad_accum_steps: int = 1
    """Micro-batches (each ``data.batch_size`` rows) per optimizer step, their gradients summed
    before it: the effective batch is ``data.batch_size`` x this. The loss is the mean over
    every row of the step's micro-batches, a short last batch of an epoch included."""
    eval_every: int = 0
    """Run the task's ``evaluate(model, device)`` every this many optimizer steps and at
    ``training.max_steps`` (0: never); the values go into ``run.evaluations`` and every checkpoint."""
    early_stopping_patience: int = 0
    """Stop after this many evaluations in a row without an improvement of
    ``checkpoint.best_metric`` (0: never stop early); the stop commits its step's checkpoint and
    is recorded in meta.json, and ``--resume latest`` trains no further (``--extend-to`` does)."""
    early_stopping_threshold: float = 0.0
    """What counts as an improvement: beating the best value so far by more than this."""
    callbacks: list = field(default_factory=list)
    """Import paths ``module:factory`` of your own callbacks, each ``factory(config)`` returning an
    object with any of ``on_step_end``, ``on_evaluate``, ``on_save`` (docs/training.md#callbacks)."""
    parallel: Parallel = "auto"
    """'auto': 'ddp' under ``torchrun --nproc-per-node N scripts/02_train.py`` with N > 1, 'none'
    (one process) otherwise. 'none', 'ddp' or 'fsdp2' explicitly: checked against the launch
    ('ddp' in a plain process is refused). Checkpoints record the mode the run used, never
    'auto' (gloo on CPU, nccl on CUDA)."""
    ddp_find_unused_parameters: bool = False
    """DDP only: true for a model whose forward leaves some parameters without a gradient
    (torch's ``find_unused_parameters``; it costs a walk of the graph every step). Resume
    is bitwise either way: with false, every process settles DDP's gradient buckets on its
    first batch before it steps (``World.settle_buckets``). Changed only with ``--reshard``."""

    def __post_init__(self) -> None:
        if self.max_steps is None and not self.epochs:
            self.max_steps = DEFAULT_MAX_STEPS
        if self.max_steps is not None:
            _require_int(self.max_steps, "training.max_steps", 1)
        _require_int(self.epochs, "training.epochs", 0)
        _require_int(self.early_stopping_patience, "training.early_stopping_patience", 0)
        _require(
            math.isfinite(self.early_stopping_threshold) and self.early_stopping_threshold >= 0,
            "training.early_stopping_threshold",
            f"must be a finite number >= 0 (got {self.early_stopping_threshold})",
        )
        _require(
            isinstance(self.callbacks, list)
            and all(isinstance(path, str) and ":" in path for path in self.callbacks),
            "training.callbacks",
            "must be a list of import paths such as 'my_callbacks:make'",
        )
        twice = sorted({path for path in self.callbacks if self.callbacks.count(path) > 1})
        _require(not twice, "training.callbacks", f"names {twice[0] if twice else ''} twice")
        for name in ("device", "dtype", "amp", "parallel"):
            _require_choice(getattr(self, name), _CHOICES[name], f"training.{name}")
        _require(
            math.isfinite(self.grad_clip) and self.grad_clip >= 0,
            "training.grad_clip",
            f"must be a finite number >= 0 (got {self.grad_clip})",
        )
        _require_int(self.log_every, "training.log_every", 1)
        _require_int(self.grad_accum_steps, "training.grad_accum_steps", 1)
        _require_int(self.eval_every, "training.eval_every", 0)
        # torch.set_num_threads takes a C int.
        _require_int(self.threads, "training.threads", 1, 2**31)
        _require_int(self.seed, "training.seed", 0)


BestMode = Literal["min", "max"]
# What evaluate() may name a metric kept in a run's history: it becomes a tensor name in the
# training state (pipeline.checkpoint.evaluations). A metric of one of several evaluation sets
# is named "set/metric" (evaluate returned {set: {metric: value}}), each part a plain name.
# \Z, not $: $ also matches before a final line break, which would let "mse\n" through.
METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}(/[A-Za-z_][A-Za-z0-9_.-]{0,63})?\Z")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Local checkpoints. Nothing is uploaded while training runs."""

    dir: str = CHECKPOINT_DIR
    """Folder of step folders (``step-00000010``); created on first save."""
    every: int = 5
    """Save every this many steps. A checkpoint is always written at the last step."""
    keep_last: int = 1
    """How many committed checkpoints to keep; older ones are pruned after a save commits."""
    async_: bool = field(default=True, metadata={"key": "async"})
    """Write in a background thread after a fast copy of the state to CPU memory."""
    best_metric: str = ""
    """A metric the task's ``evaluate`` returns (needs ``training.eval_every``; ``set/metric`` for
    one of several evaluation sets): the checkpoint of its best evaluated step is kept besides the
    last ``keep_last`` and is ``--checkpoint best``. A new best at a step that is not a save step is
    saved. Empty: no best is kept."""
    best_mode: BestMode = "min"
    """Whether the best ``best_metric`` is the 'min' (a loss) or the 'max' (an accuracy)."""

    def __post_init__(self) -> None:
        _require(bool(self.dir), "checkpoint.dir", "must not be empty")
        _require_int(self.every, "checkpoint.every", 1)
        _require_int(self.keep_last, "checkpoint.keep_last", 1)
        _require_choice(self.best_mode, BestMode, "checkpoint.best_mode")
        _require(
            not self.best_metric or bool(METRIC_NAME.match(self.best_metric)),
            "checkpoint.best_metric",
            f"must be a metric name such as 'mse' or 'validation/mse' (got {self.best_metric!r})",
        )

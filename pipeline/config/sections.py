"""What a configuration is: its typed sections and :class:`Config`, every value validated, and
the dict form a checkpoint records (:meth:`Config.to_dict`; :func:`config_from_dict` reads it
back, and every config file through it). Unknown keys, wrong types and out-of-range values
are refused with one message naming the key; the file's name is added by the caller.
"""

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..layout import CHECKPOINT_DIR, DATA_DIR, METRICS_FILE, STAGE_DIR, TRACES_DIR
from ..params import is_yaml11_float
from .values import INT64 as _INT64
from .values import check_params as _check_params

__all__ = [
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "CheckpointConfig",
    "CardConfig",
    "OutputsConfig",
    "Config",
    "config_from_dict",
    "launch_mode",
    "launched_as",
    "RESUME_IRRELEVANT_KEYS",
    "METRIC_NAME",
]

# Keys that may differ between a checkpoint and the run resuming it: they change where
# things live, how often state is written or how progress is shown, never what is
# computed. (Data content is compared by fingerprint, so moving data.dir is fine.)
RESUME_IRRELEVANT_KEYS = frozenset(
    {
        "data.dir",
        # Every sample is seeded by (seed, epoch, index) whichever process fetches it.
        "data.num_workers",
        "data.sample_timeout",
        "checkpoint.dir",
        "checkpoint.every",
        "checkpoint.keep_last",
        "checkpoint.async",
        "training.log_every",
        # Evaluation restores every RNG it could draw from: the weights do not depend on it.
        "training.eval_every",
        "checkpoint.best_metric",
        "checkpoint.best_mode",
        # A resume restores the thread count its checkpoint recorded (pipeline.environment).
        "training.threads",
        "card",
        "outputs",
    }
)


def _require(condition: bool, key: str, message: str) -> None:
    # __post_init__ does not know the file name; load_config adds it.
    if not condition:
        raise ValueError(f"{key} {message}")


def _require_int(value: int, key: str, low: int, high: int = _INT64) -> None:
    """``low <= value < high``; the default ceiling is what numpy and torch hold (int64)."""
    _require(value >= low, key, f"must be >= {low} (got {value})")
    ceiling = f"2**{high.bit_length() - 1}" if high & (high - 1) == 0 else str(high)
    _require(value < high, key, f"must be < {ceiling} (got {value}): numpy and torch hold 64-bit integers")


def _require_choice(value: Any, choices: Any, key: str) -> None:
    """``value`` is one of the ``Literal`` type's values (a string, not e.g. ``True`` for 'none')."""
    allowed = typing.get_args(choices)
    _require(isinstance(value, str) and value in allowed, key, f"must be one of {allowed} (got {value!r})")


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


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The training loop."""

    seed: int = 0
    """Seed of every training RNG: Python, NumPy (Generator and legacy) and torch."""
    max_steps: int = 10
    """Total optimizer steps of the run; the schedule depends on it. ``--extend-to`` raises
    it for a run that exists; the schedule then keeps the run's first length (a schedule
    over max_steps holds its final value instead of jumping back up)."""
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
        _require_int(self.max_steps, "training.max_steps", 1)
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
# training state (pipeline.checkpoint.evaluations).
METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


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
    """A metric the task's ``evaluate`` returns (needs ``training.eval_every``): the checkpoint
    of its best evaluated step is kept besides the last ``keep_last`` and is ``--checkpoint best``.
    A new best at a step that is not a save step is saved. Empty: no best is kept."""
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
            f"must be a metric name such as 'mse' (got {self.best_metric!r})",
        )


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_LANGUAGE = re.compile(r"^[a-z]{2,3}(-[A-Za-z0-9]{2,8})*$")
_PIPELINE_TAG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def _strings(values: Any, key: str, pattern: re.Pattern[str] | None = None, what: str = "") -> None:
    _require(
        isinstance(values, list) and all(isinstance(v, str) and v.strip() for v in values),
        key,
        "must be a list of non-empty strings",
    )
    for value in values:
        _require(pattern is None or bool(pattern.match(value)), key, f"holds {value!r}, which is not {what}")


@dataclass(kw_only=True, slots=True)
class CardConfig:
    """What the model card (script 05) says about the model: its front matter is what the Hub
    indexes (search filters, the widget, the evaluation table)."""

    license: str = "apache-2.0"
    """License identifier for the card's front matter."""
    tags: list = field(default_factory=lambda: ["pytorch", "safetensors"])
    """Hub tags."""
    description: str = ""
    """One paragraph describing the model; a default is written when empty."""
    library_name: str = ""
    """The Hub's library field; empty means ``transformers`` for a transformers model, else ``pytorch``."""
    pipeline_tag: str = ""
    """The Hub task, e.g. ``text-generation``; empty leaves it out."""
    language: list = field(default_factory=list)
    """Languages of the data as ISO 639 codes, e.g. ``[en]``."""
    datasets: list = field(default_factory=list)
    """Hub dataset ids the model was trained on, e.g. ``[tiny_shakespeare]``."""
    base_model: str = ""
    """Hub id of the model this one was fine-tuned from; empty for a model trained from scratch."""
    eval_dataset_name: str = ""
    """The evaluation table's dataset name; empty means the first of ``datasets``, else the model's data."""
    eval_dataset_type: str = ""
    """The evaluation table's dataset type (a Hub dataset id links it); empty means the first of ``datasets``."""
    sections: str = ""
    """A Markdown file (UTF-8, relative to the working folder) of your own card sections, such as
    "## Intended use" or "## Limitations", added after the description; empty for none. Its
    text is scanned for secrets and audited with the rest of the stage."""
    allow_leaks: dict = field(default_factory=dict)
    """False positives of the leak scan, per staged file: ``{README.md: [jwt]}`` lets that file hold
    something shaped like a JSON Web Token (kinds in docs/publishing.md). 05 and 06 both apply it."""

    def __post_init__(self) -> None:
        _strings(self.tags, "card.tags")
        _strings(self.language, "card.language", _LANGUAGE, "an ISO 639 code such as 'en' or 'pt-BR'")
        _strings(self.datasets, "card.datasets", _HUB_ID, "a Hub dataset id such as 'user/name'")
        _require(
            not self.base_model or bool(_HUB_ID.match(self.base_model)),
            "card.base_model",
            f"must be a Hub model id such as 'user/name' (got {self.base_model!r})",
        )
        _require(
            not self.pipeline_tag or bool(_PIPELINE_TAG.match(self.pipeline_tag)),
            "card.pipeline_tag",
            f"must be a Hub task such as 'text-generation' (got {self.pipeline_tag!r})",
        )
        _require(
            not self.library_name or bool(_PIPELINE_TAG.match(self.library_name)),
            "card.library_name",
            f"must be a Hub library name such as 'transformers' (got {self.library_name!r})",
        )
        _require(bool(self.license.strip()), "card.license", "must not be empty")
        # The kinds are checked by the leak scan (pipeline.leaks), which this module does not import:
        # the model's shipped code closure includes this module.
        _require(
            isinstance(self.allow_leaks, dict)
            and all(
                isinstance(name, str) and isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)
                for name, kinds in self.allow_leaks.items()
            ),
            "card.allow_leaks",
            "must map a staged file to a list of leak kinds, e.g. {README.md: [jwt]}",
        )


@dataclass(kw_only=True, slots=True)
class OutputsConfig:
    """Where this config's results go, besides its checkpoints (``checkpoint.dir``). Left out
    of a config file, they are derived from the file's name (:func:`derived_outputs`), so
    two configs in one clone never share them."""

    metrics: str = METRICS_FILE
    """The evaluation record script 04 writes and script 05 reads."""
    stage: str = STAGE_DIR
    """The folder script 05 builds and script 06 publishes."""
    traces: str = TRACES_DIR
    """The TensorBoard traces training writes (with the optional ``tensorboard``); left out, the
    folder ``traces`` beside ``checkpoint.dir``. Training rebuilds it from the restored history at
    every start, so it replaces only a folder it made itself."""

    def __post_init__(self) -> None:
        _require(bool(self.metrics), "outputs.metrics", "must not be empty")
        _require(bool(self.stage), "outputs.stage", "must not be empty")
        _require(bool(self.traces), "outputs.traces", "must not be empty")


_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "card": CardConfig,
    "outputs": OutputsConfig,
}


@dataclass(kw_only=True, slots=True)
class Config:
    """The whole run configuration."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    card: CardConfig = field(default_factory=CardConfig)
    outputs: OutputsConfig = field(default_factory=OutputsConfig)
    source: str = field(default="<defaults>", compare=False)
    """Where the config was read from; used in error messages, not saved."""
    command_args: tuple[str, ...] = field(default=(), compare=False)
    """The command-line arguments that rebuild this config (``--config FILE``, one ``--set``
    per override), so every command the pipeline prints runs this config; not saved."""

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able dict using the YAML key names (the form saved in meta.json)."""
        return {name: _section_to_dict(getattr(self, name)) for name in _SECTIONS}

    def flat(self) -> dict[str, Any]:
        """``{"section.key": value}`` for comparisons that name the differing key."""
        out: dict[str, Any] = {}
        for section, values in self.to_dict().items():
            for key, value in values.items():
                out[f"{section}.{key}"] = value
        return out


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _section_to_dict(section: Any) -> dict[str, Any]:
    return {_yaml_key(f): _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` against a field annotation; ints are accepted where floats are."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _coerce(value, option, key)
            except ValueError:
                continue
        raise ValueError(
            f"{key} has the wrong type: expected {annotation}, got {type(value).__name__} {value!r}"
        )
    if annotation is type(None):
        if value is None:
            return None
        raise ValueError(f"{key} must be null")
    if origin is Literal:
        _require_choice(value, annotation, key)
        return value
    if value is None:
        raise ValueError(f"{key} has no value: give one, or delete the line to use the default")
    expected = origin or annotation
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and is_yaml11_float(value):
        return float(value)
    if expected is int and isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got a boolean ({value!r})")
    if not isinstance(value, expected):
        raise ValueError(f"{key} must be {_type_name(expected)}, got {type(value).__name__} {value!r}")
    return value


def _build_section(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a mapping of keys to values, got {type(raw).__name__}")
    fields = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown key {name}.{unknown[0]} (known keys of {name}: {', '.join(sorted(fields))})"
        )
    kwargs = {fields[k].name: _coerce(v, fields[k].type, f"{name}.{k}") for k, v in raw.items()}
    return cls(**kwargs)


def config_from_dict(raw: Any, *, source: str = "<dict>") -> Config:
    """Validate a plain dict (as read from YAML or meta.json) into a :class:`Config`."""
    try:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError("the top level must be a mapping of sections")
        unknown = sorted(set(raw) - set(_SECTIONS))
        if unknown:
            raise ValueError(f"unknown section {unknown[0]!r} (known sections: {', '.join(_SECTIONS)})")
        sections = {name: _build_section(name, cls, raw.get(name)) for name, cls in _SECTIONS.items()}
        _require(
            not sections["checkpoint"].best_metric or sections["training"].eval_every > 0,
            "checkpoint.best_metric",
            "needs evaluations: set training.eval_every to a number of steps > 0",
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return Config(**sections, source=source)


def launch_mode(parallel: str, world_size: int | None) -> str:
    """``training.parallel`` as a launch of ``world_size`` processes runs it (``None``: a plain
    process, not torchrun's): ``auto`` is ``ddp`` under torchrun with more than one process,
    ``none`` otherwise; an explicit value stays as given, checked against the launch where
    the run starts (:class:`pipeline.start.Launch`,
    :meth:`pipeline.distributed.world.LaunchWorld.start`)."""
    if parallel != "auto":
        return parallel
    return "ddp" if world_size is not None and world_size > 1 else "none"


def launched_as(config: "Config", world_size: int | None) -> "Config":
    """``config`` with ``training.parallel`` as a launch of ``world_size`` runs it
    (:func:`launch_mode`): what the run's checkpoints record."""
    parallel = launch_mode(config.training.parallel, world_size)
    return dataclasses.replace(config, training=dataclasses.replace(config.training, parallel=parallel))

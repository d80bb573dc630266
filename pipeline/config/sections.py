"""What a configuration is: :class:`Config`, its sections together (:mod:`.training`,
:mod:`.outputs`), and the dict form a checkpoint records (:meth:`Config.to_dict`;
:func:`config_from_dict` reads it back, and every config file through it). Unknown keys,
wrong types and out-of-range values are refused with one message naming the key and the file.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..params import is_yaml11_float
from .outputs import CardConfig, OutputsConfig
from .training import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
)
from .values import require as _require
from .values import require_choice as _require_choice

__all__ = [
    "Config",
    "config_from_dict",
    "launch_mode",
    "launched_as",
    "RESUME_IRRELEVANT_KEYS",
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
        # When a run stops early, and what callbacks see: the steps trained are the same. A
        # callback's saved state follows it by name (pipeline.callbacks).
        "training.early_stopping_patience",
        "training.early_stopping_threshold",
        "training.callbacks",
        # A resume restores the thread count its checkpoint recorded (pipeline.environment).
        "training.threads",
        "card",
        "outputs",
    }
)


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
        options = [option for option in typing.get_args(annotation) if option is not type(None)]
        if len(options) == 1 and value is not None:  # an optional value: refused as its type would be
            return _coerce(value, options[0], key)
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
        _require(
            not sections["training"].early_stopping_patience or bool(sections["checkpoint"].best_metric),
            "training.early_stopping_patience",
            "counts evaluations of checkpoint.best_metric without an improvement: set checkpoint.best_metric "
            "(and training.eval_every), or early_stopping_patience: 0",
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

"""Typed configuration, loaded from YAML with a strict ``yaml.SafeLoader``.

Every knob lives in one file (``config.yaml`` by default). Unknown keys, duplicate keys,
empty values, wrong types and out-of-range values are rejected with one message that names
the key and the file, before anything runs; free-form ``params`` hold only JSON values
(finite numbers, 64-bit integers, bounded nesting), since every checkpoint records them as
JSON. Command-line flags override the file through :func:`load_config`'s ``overrides``.
Each config owns its outputs (``checkpoint.dir``, ``outputs.metrics``, ``outputs.stage``):
see :func:`derived_outputs` and docs/configuration.md.

============  ================================================================
``sections``  the typed sections and :class:`Config`, every value validated; the dict
              form a checkpoint records, read back by :func:`config_from_dict`
``loading``   a config file read, its outputs derived, ``--set`` overrides applied
``values``    what a file may hold: the strict YAML reader, the ``params`` check
============  ================================================================
"""

from .loading import DEFAULT_CONFIG_PATH, apply_overrides, derived_outputs, load_config, parse_set_overrides
from .sections import (
    METRIC_NAME,
    RESUME_IRRELEVANT_KEYS,
    CardConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    OutputsConfig,
    SchedulerConfig,
    TrainingConfig,
    config_from_dict,
    launch_mode,
    launched_as,
)

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
    "DEFAULT_CONFIG_PATH",
    "load_config",
    "config_from_dict",
    "parse_set_overrides",
    "apply_overrides",
    "derived_outputs",
    "launch_mode",
    "launched_as",
    "RESUME_IRRELEVANT_KEYS",
    "METRIC_NAME",
]

"""Typed configuration, loaded from YAML with a strict ``yaml.SafeLoader``.

Every knob lives in one file (``config.yaml`` by default). Unknown keys, duplicate keys,
empty values, wrong types and out-of-range values are rejected with one message that names
the key and the file, before anything runs; free-form ``params`` hold only JSON values
(finite numbers, 64-bit integers, bounded nesting), since every checkpoint records them as
JSON. Command-line flags override the file through :func:`load_config`'s ``overrides``.
Each config owns its outputs (``checkpoint.dir``, ``outputs.metrics``, ``outputs.stage``):
see :func:`derived_outputs` and docs/configuration.md.

============  ================================================================
``sections``  :class:`Config`, its sections together; the dict form a checkpoint
              records, read back by :func:`config_from_dict`
``training``  the sections of what a run computes and how it is saved: data, model,
              optimizer, scheduler, training, checkpoint
``outputs``   the sections of where results go and what the card says: outputs, card
``loading``   a config file read, its outputs derived, ``--set`` overrides applied
``values``    what a file may hold: the strict YAML reader, the checks of every value,
              the ``params`` check
============  ================================================================
"""

from .loading import DEFAULT_CONFIG_PATH, apply_overrides, derived_outputs, load_config, parse_set_overrides
from .outputs import CardConfig, OutputsConfig, traces_folder
from .sections import RESUME_IRRELEVANT_KEYS, Config, config_from_dict, launch_mode, launched_as
from .training import (
    METRIC_NAME,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
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
    "traces_folder",
]

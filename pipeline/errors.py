"""Domain exceptions. Every expected failure is one of these, so the scripts can print a
single line that says what is wrong and what to do, and exit 2 without a traceback."""

from __future__ import annotations

__all__ = [
    "PipelineError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "ChecksumMismatch",
    "SchemaMismatch",
    "ConfigMismatch",
    "StateMismatch",
    "CheckpointLocked",
    "NoCheckpoint",
]


class PipelineError(Exception):
    """Base class: an expected failure whose message is meant for the user."""

    exit_code = 2


class ConfigError(PipelineError, ValueError):
    """The configuration file or a command-line override is invalid."""


class DataError(PipelineError, ValueError):
    """Prepared data is missing or does not match its recorded fingerprint."""


class CheckpointError(PipelineError):
    """A checkpoint is missing, damaged, or cannot be used for this run."""


class ChecksumMismatch(CheckpointError, ValueError):
    """A file's SHA-256 or size differs from what its meta.json records."""


class SchemaMismatch(CheckpointError, ValueError):
    """meta.json is malformed or written by an unknown schema version."""


class ConfigMismatch(CheckpointError, ValueError):
    """The checkpoint was written by a run whose config differs from this one."""


class StateMismatch(CheckpointError, ValueError):
    """Saved tensors do not fit the objects built from the current config."""


class CheckpointLocked(CheckpointError):
    """Another trainer holds the checkpoint folder's lock."""


class NoCheckpoint(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""

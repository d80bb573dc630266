"""Where a configuration comes from: its YAML file, read strictly, the outputs it leaves out
derived from its name (:func:`derived_outputs`, docs/configuration.md), and the command line's
``--set`` overrides (:func:`parse_set_overrides`), all in :func:`load_config`.
"""

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..layout import CHECKPOINT_DIR, METRICS_FILE, STAGE_DIR
from .sections import Config, config_from_dict
from .values import load_yaml as _load_yaml

__all__ = ["DEFAULT_CONFIG_PATH", "load_config", "parse_set_overrides", "apply_overrides", "derived_outputs"]

DEFAULT_CONFIG_PATH = Path("config.yaml")


def parse_set_overrides(items: list[str] | None) -> dict[str, Any]:
    """Turn ``["training.max_steps=20", ...]`` into ``{"training.max_steps": 20}``.

    Values are parsed as YAML, so ``20`` is an int, ``1e-3`` a float and ``true`` a bool; an
    empty value (``training.max_steps=``) or ``null`` is refused rather than ignored.
    """
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        shown = item if len(item) <= 80 else item[:77] + "..."
        if not sep or "." not in key:
            raise ConfigError(
                f"--set {shown!r}: expected SECTION.KEY=VALUE, e.g. --set training.max_steps=20"
            )
        try:
            value = _load_yaml(text)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"--set {shown!r}: value is not valid YAML ({getattr(exc, 'problem', None) or exc})"
            ) from None
        if value is None:
            raise ConfigError(
                f"--set {shown!r}: no value given: write one after '=' (an empty string is "
                f"--set '{key.strip()}=\"\"')"
            )
        out[key.strip()] = value
    return out


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``raw`` with dotted-key overrides applied (``None`` values are skipped)."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        if merged.get(section) is None:  # left out, or written without a key under it (``training:``)
            merged[section] = {}
        target = merged[section]
        if not isinstance(target, dict):
            raise ConfigError(f"cannot override {dotted}: section {section!r} is not a mapping")
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"cannot override {dotted}: {part!r} is not a mapping")
        target[parts[-1]] = value
    return merged


def derived_outputs(path: str | Path | None) -> dict[str, str]:
    """The outputs of a config file that does not name them, relative to the working folder
    (the run's folder, where every relative path of a config points):

    - ``config.yaml`` at its top (the default config), or a config file outside it (shared by
      runs that each work in their own folder), keeps ``estados_local/``, ``metrics.json`` and
      ``hub_stage/``;
    - any other config file inside it writes under ``runs/<name>/``, where name is the file's
      stem, or its folder's name for a file called ``config.yaml``
      (``examples/charlm/config.yaml`` -> ``runs/charlm/estados_local/``,
      ``runs/charlm/metrics.json``, ``runs/charlm/hub_stage/``),

    so several configs in one clone never share their checkpoints, metrics or stage."""
    base = None
    if path is not None:
        absolute, cwd = Path(os.path.abspath(path)), Path(os.path.abspath(os.curdir))
        if absolute.is_relative_to(cwd) and absolute != cwd / DEFAULT_CONFIG_PATH:
            name = absolute.stem if absolute.stem != DEFAULT_CONFIG_PATH.stem else absolute.parent.name
            base = Path("runs") / name
    if base is None:
        return {"checkpoint.dir": CHECKPOINT_DIR, "outputs.metrics": METRICS_FILE, "outputs.stage": STAGE_DIR}
    return {
        "checkpoint.dir": str(base / CHECKPOINT_DIR),
        "outputs.metrics": str(base / METRICS_FILE),
        "outputs.stage": str(base / STAGE_DIR),
    }


def _with_derived_outputs(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """``raw`` with each output key it leaves out set to :func:`derived_outputs`'s value."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for dotted, value in derived_outputs(path).items():
        section, _, key = dotted.partition(".")
        target = merged.get(section)
        if target is None:
            target = merged[section] = {}
        if isinstance(target, dict) and key not in target:
            target[key] = value
    return merged


_LENGTHS = ("training.max_steps", "training.epochs")


def _length_overridden(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without its length when the command line gives the run's length the other way
    (``--set training.epochs=3`` over a file's ``max_steps: 10``): the command line's wins."""
    given = [key for key in _LENGTHS if overrides.get(key)]
    training = raw.get("training")
    if len(given) != 1 or not isinstance(training, dict):
        return raw
    other = next(key for key in _LENGTHS if key not in given).partition(".")[2]
    return {**raw, "training": {key: value for key, value in training.items() if key != other}}


def _refuse_two_lengths(overrides: dict[str, Any]) -> None:
    """``training.max_steps`` and ``training.epochs`` are two ways to say how long a run is: the
    command line gives one. (A file may hold both only as a checkpoint records them, the steps
    counted from the epochs: :func:`pipeline.run.with_counted_length` checks that they agree.)"""
    if all(overrides.get(key) for key in _LENGTHS):
        raise ConfigError(
            f"the command line gives both training.max_steps ({overrides['training.max_steps']}) and "
            f"training.epochs ({overrides['training.epochs']}): keep one (--max-steps sets training.max_steps)"
        )


def _flow(value: Any) -> str:
    """A ``--set`` value that parses back to ``value``."""
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip().removesuffix("...").strip()


def _refuse_empty_values(raw: dict[str, Any], path: Path) -> None:
    """A key written without a value (``max_steps:``) is a slip, not a request for the default,
    even where the default is "not given" (``training.max_steps`` beside ``epochs``)."""
    for section, values in raw.items():
        for key, value in values.items() if isinstance(values, dict) else ():
            if value is None:
                raise ConfigError(
                    f"{path}: {section}.{key} has no value: give one, or delete the line to use the default"
                )


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read ``path`` (default ``config.yaml``) with a strict ``yaml.SafeLoader``, fill in the
    outputs it leaves out (:func:`derived_outputs`), and apply ``overrides``.

    Errors name the file and the key: ``config.yaml: training.max_steps must be >= 1 (got 0)``.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    if not path.is_file():
        raise ConfigError(f"config file {path} not found: pass --config PATH or run from the repository root")
    try:
        raw = _load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    _refuse_empty_values(raw or {}, path)
    raw = _with_derived_outputs(raw or {}, path)
    source = str(path)
    default = os.path.abspath(path) == os.path.abspath(DEFAULT_CONFIG_PATH)
    args: list[str] = [] if default else ["--config", str(path)]
    if overrides:
        _refuse_two_lengths(overrides)
        raw = apply_overrides(_length_overridden(raw, overrides), overrides)
        source = f"{path} (with command-line overrides)"
        for key, value in overrides.items():
            if value is not None:
                args += ["--set", f"{key}={_flow(value)}"]
    config = config_from_dict(raw, source=source)
    return dataclasses.replace(config, command_args=tuple(args))

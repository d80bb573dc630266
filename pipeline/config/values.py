"""What a config file may hold: the strict YAML reader, the checks every section's values go
through (:func:`require` and its kin), and the check of free-form ``params``.

Torch-free, used by the rest of :mod:`pipeline.config`. A free-form ``params`` value nests at most
``MAX_PARAMS_DEPTH`` levels and holds at most ``MAX_PARAMS_VALUES`` values (YAML aliases can
make a small file expand to an exponential tree); integers fit in 64 bits, as numpy and torch
need them to; the YAML reader itself stops at ``MAX_YAML_DEPTH`` (its composer recurses).
"""

from __future__ import annotations

import math
import typing
from typing import Any

import yaml

__all__ = [
    "INT64",
    "MAX_YAML_DEPTH",
    "MAX_PARAMS_DEPTH",
    "MAX_PARAMS_VALUES",
    "require",
    "require_int",
    "require_choice",
    "check_params",
    "load_yaml",
]

MAX_YAML_DEPTH = 64
MAX_PARAMS_DEPTH = 16
MAX_PARAMS_VALUES = 100_000
INT64 = 2**63


def require(condition: bool, key: str, message: str) -> None:
    """Refuse a value unless ``condition`` holds: ``ValueError("<key> <message>")``. A section's
    ``__post_init__`` does not know the file's name;
    :func:`~pipeline.config.sections.config_from_dict` adds it."""
    if not condition:
        raise ValueError(f"{key} {message}")


def require_int(value: int, key: str, low: int, high: int = INT64) -> None:
    """``low <= value < high``; the default ceiling is what numpy and torch hold (int64)."""
    require(value >= low, key, f"must be >= {low} (got {value})")
    ceiling = f"2**{high.bit_length() - 1}" if high & (high - 1) == 0 else str(high)
    require(value < high, key, f"must be < {ceiling} (got {value}): numpy and torch hold 64-bit integers")


def require_choice(value: Any, choices: Any, key: str) -> None:
    """``value`` is one of the ``Literal`` type's values (a string, not e.g. ``True`` for 'none')."""
    allowed = typing.get_args(choices)
    require(isinstance(value, str) and value in allowed, key, f"must be one of {allowed} (got {value!r})")


def _where(key: str, path: tuple[Any, ...]) -> str:
    return key + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def check_params(params: Any, key: str) -> None:
    """A free-form ``params`` mapping holds JSON values only: string keys; null, booleans,
    64-bit integers, finite floats, strings, lists and mappings; nested at most
    ``MAX_PARAMS_DEPTH`` levels, at most ``MAX_PARAMS_VALUES`` values in all. Each
    checkpoint records the config as JSON (no NaN, no dates, no sets), and the factories
    hand the numbers to numpy and torch. Iterative, so no value nests Python's stack away."""
    if not isinstance(params, dict):
        raise ValueError(f"{key} must be a mapping of names to values, got {type(params).__name__}")
    pending: list[tuple[Any, tuple[Any, ...]]] = [(params, ())]
    count = 0
    while pending:
        value, path = pending.pop()
        count += 1
        if count > MAX_PARAMS_VALUES:
            raise ValueError(f"{key} holds more than {MAX_PARAMS_VALUES} values")
        where = _where(key, path)
        if isinstance(value, (dict, list)):
            if len(path) >= MAX_PARAMS_DEPTH:
                raise ValueError(f"{key} is nested deeper than {MAX_PARAMS_DEPTH} levels (at {where})")
            if isinstance(value, dict):
                for name in value:
                    if not isinstance(name, str) or not name:
                        raise ValueError(f"{where} has the key {name!r}: keys must be non-empty strings")
                pending.extend((item, (*path, name)) for name, item in value.items())
            else:
                pending.extend((item, (*path, i)) for i, item in enumerate(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(
                    f"{where} must be a finite number (got {value}): checkpoints record the config "
                    "as JSON, which has no NaN or infinity"
                )
        elif isinstance(value, int) and not isinstance(value, bool):
            if not -INT64 <= value < INT64:
                raise ValueError(f"{where} is {value}, beyond the 64-bit integers numpy and torch hold")
        elif value is not None and not isinstance(value, (str, bool)):
            raise ValueError(
                f"{where} is a {type(value).__name__} ({str(value)[:40]}): params hold null, "
                "booleans, numbers, strings, lists and mappings only (quote it to make it a string)"
            )


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the
    last silently) and stops nesting at ``MAX_YAML_DEPTH`` (its composer recurses, so a
    deep enough value would end in a RecursionError)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        merges = 0
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden key by key
                merges += 1
                if merges > 1:  # PyYAML would merge both, one's keys silently over the other's
                    raise yaml.constructor.ConstructorError(
                        None, None, "the key '<<' is given twice", key_node.start_mark
                    )
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class names it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)

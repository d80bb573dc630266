"""Validate a factory's free-form ``params``: :func:`read_params`, for code that is published.

Self-contained (the standard library only), so model code that uses it still loads from a
published repository without this project: the stage ships this file beside the model's
code (docs/custom-model.md). Inside the project a refusal is a
:class:`pipeline.errors.ConfigError` (one ``error:`` line from every script); shipped
alone, a ``ValueError`` of the same name.
"""

from __future__ import annotations

import re
from typing import Any

try:
    from .errors import ConfigError
except ImportError:  # shipped with a published model, without the rest of this project

    class ConfigError(ValueError):  # type: ignore[no-redef]
        """A parameter of the config is invalid."""


__all__ = ["ConfigError", "read_params", "is_yaml11_float"]

_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def is_yaml11_float(value: Any) -> bool:
    """PyYAML follows YAML 1.1, where ``1e-3`` (no dot) loads as a string; users mean a number."""
    return isinstance(value, str) and bool(_YAML11_FLOAT.match(value.strip()))


def read_params(params: dict[str, Any], key: str, spec: dict[str, tuple[type, Any]]) -> dict[str, Any]:
    """Validate a factory's ``params`` mapping against ``{name: (type, default)}``.

    A default of ``...`` makes the key required. Errors name ``key.name``.
    """
    unknown = sorted(set(params) - set(spec))
    if unknown:
        raise ConfigError(f"unknown key {key}.{unknown[0]} (known: {', '.join(sorted(spec)) or 'none'})")
    out: dict[str, Any] = {}
    for name, (kind, default) in spec.items():
        if name not in params:
            if default is ...:
                raise ConfigError(f"{key}.{name} is required")
            out[name] = default
            continue
        value = params[name]
        if kind is float and (
            isinstance(value, int) and not isinstance(value, bool) or is_yaml11_float(value)
        ):
            value = float(value)
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ConfigError(f"{key}.{name} must be {kind.__name__}, got {type(value).__name__} {value!r}")
        out[name] = value
    return out

"""What the Hub's own tools need beside the weights: ``config.json`` and the model's own files.

:func:`inspect_model` looks at the configured model, built without weights
(``build_model(config, "meta")``), to learn what it is. A transformers ``PreTrainedModel``
gets exactly the ``config.json`` and ``generation_config.json`` that ``save_pretrained``
writes, and its tied weights are published under the name transformers keeps. Any other
model gets a ``config.json`` naming the factory, class, dtype and config that rebuild it.
transformers is never imported here: a model can only be a ``PreTrainedModel`` if its
factory imported transformers. The weights themselves are :mod:`.weights`' business.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..checkpoint import stored_layout
from ..config import Config
from ..errors import ConfigError
from ..provenance import is_transformers_model

__all__ = ["HUB_FILES_HOOK", "ModelExport", "hub_files", "inspect_model", "is_transformers_model"]

# A function the model factory's module may define: ``hub_files(config) -> {file name: bytes}``.
HUB_FILES_HOOK = "hub_files"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # \Z: no final line break


@dataclass(frozen=True, slots=True)
class ModelExport:
    """What :func:`inspect_model` learned. ``renames`` maps a stored tensor name to the name
    it is published under (tied weights transformers keeps under another name)."""

    is_transformers: bool
    architecture: str
    config_json: bytes
    generation_config_json: bytes | None
    renames: dict[str, str]


def _json(payload: Any) -> bytes:
    return (json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


def _tied_renames(model: torch.nn.Module, kept: set[str]) -> dict[str, str]:
    """Stored name -> the name transformers keeps, for each tied group where they differ."""
    _, tied = stored_layout(model)
    renames = {}
    for stored in set(tied.values()):
        wanted = [
            name
            for name in (stored, *(alias for alias, name in tied.items() if name == stored))
            if name in kept
        ]
        if stored not in kept and len(wanted) == 1:
            renames[stored] = wanted[0]
    return renames


def _transformers_export(model: Any, architecture: str) -> ModelExport:
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # The same two fields save_pretrained sets before writing the config.
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    generation = None
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        generation = model.generation_config.to_json_string(use_diff=True).encode("utf-8")
    kept = set(remove_tied_weights_from_state_dict(model.state_dict(), model))
    return ModelExport(
        is_transformers=True,
        architecture=architecture,
        config_json=model.config.to_json_string(use_diff=True).encode("utf-8"),
        generation_config_json=generation,
        renames=_tied_renames(model, kept),
    )


def inspect_model(model: torch.nn.Module, config: Config, public_config: Mapping[str, Any]) -> ModelExport:
    """Describe how to publish ``config``'s ``model`` (built without weights will do).

    ``public_config`` is the config as published (machine paths removed); a model that is
    not a transformers one records it in its ``config.json`` so the card's snippet can
    rebuild the model from that file alone.
    """
    architecture = f"{type(model).__module__}.{type(model).__qualname__}"
    if is_transformers_model(model):
        return _transformers_export(model, architecture)
    from ..factories import resolve

    _, tied = stored_layout(model)
    factory = resolve(config.model.factory, "model.factory").target
    payload = {
        "architecture": architecture,
        "tied": dict(sorted(tied.items())),
        # Where the function is defined: the module that ships (a re-export's module may not).
        "factory": f"{factory.__module__}:{factory.__qualname__}",
        "dtype": config.training.dtype,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "config": dict(public_config),
    }
    return ModelExport(
        is_transformers=False,
        architecture=architecture,
        config_json=_json(payload),
        generation_config_json=None,
        renames={},
    )


def hub_files(config: Config, reserved: set[str]) -> dict[str, bytes]:
    """What the model factory's module hands to the stage through ``hub_files(config)`` (a
    tokenizer's files, say): plain names that no stage file uses, bytes as values."""
    from ..factories import resolve

    module = config.model.factory.partition(":")[0]
    try:
        hook = resolve(f"{module}:{HUB_FILES_HOOK}", "model.factory")
    except ConfigError:
        return {}  # the module defines no hook
    files = hook(config)
    where = f"{module}.{HUB_FILES_HOOK}()"
    if not isinstance(files, dict):
        raise ConfigError(f"{where} must return a dict of file name to bytes, got {type(files).__name__}")
    for name, data in files.items():
        if not isinstance(name, str) or not _PLAIN_NAME.match(name) or name in reserved:
            raise ConfigError(
                f"{where} returned the file name {name!r}: use a plain name that is not one of the "
                f"stage's own files ({', '.join(sorted(reserved))})"
            )
        if not isinstance(data, bytes):
            raise ConfigError(f"{where}: {name} must be bytes, got {type(data).__name__}")
    return dict(sorted(files.items()))

"""Load the model of this repository: ``load_model(folder)``.

This file is published as ``code/hub_loader.py`` beside the model's own code; it needs
only ``torch`` and ``safetensors``. It rebuilds the model with the factory and config that
``config.json`` names (running the Python files under ``code/``: read them first), loads
every tensor of the weight files strictly (tied weights are stored once and restored as
ties) and returns it in evaluation mode. Nothing is unpickled.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file

__all__ = ["load_model"]


def load_model(folder: str | Path, device: str = "cpu") -> Any:
    """The model stored in ``folder`` (a download of this repository), on ``device``."""
    folder = Path(folder)
    spec = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    code = str(folder / "code")
    if code not in sys.path:
        sys.path.insert(0, code)
    module, _, function = spec["factory"].partition(":")
    config = SimpleNamespace(
        **{section: SimpleNamespace(**values) for section, values in spec["config"].items()}
    )
    model = getattr(importlib.import_module(module), function)(config).to(getattr(torch, spec["dtype"]))
    index = json.loads((folder / "model.safetensors.index.json").read_text(encoding="utf-8"))
    weights = {}
    for file in sorted(set(index["weight_map"].values())):
        weights.update(load_file(folder / file))  # plain tensors: no pickle, no code runs here
    for alias, stored in spec["tied"].items():
        weights[alias] = weights[stored]
    model.load_state_dict(weights, strict=True)  # names and shapes must match exactly
    return model.to(device).eval()

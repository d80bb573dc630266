"""What the Hub's own tools need beside the weights: ``config.json``, the weight index, shards.

- :func:`inspect_model` builds the configured model once (random weights, CPU) to learn
  what it is. A transformers ``PreTrainedModel`` gets exactly the ``config.json`` and
  ``generation_config.json`` that ``save_pretrained`` writes, and its tied weights are
  published under the name transformers keeps. Any other model gets a ``config.json`` naming
  the factory, class, dtype and config that rebuild it. transformers is never imported
  here: a model can only be a ``PreTrainedModel`` if its factory imported transformers.
- :func:`plan_weights` / :func:`write_weights` publish the checkpoint's tensors as one
  ``modelo.safetensors``, or as ``modelo-0000i-of-0000N.safetensors`` shards when they are
  larger than ``max_shard_size``, and :func:`index_bytes` writes
  ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), which lets
  ``from_pretrained`` find the weights under these file names.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from ..checkpoint import dedupe_shared_tensors, write_safetensors
from ..config import Config
from ..errors import ConfigError
from ..layout import MODEL_FILE, shard_name

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "HUB_FILES_HOOK", "ModelExport", "WeightsPlan", "hub_files", "parse_size",
           "inspect_model", "plan_weights", "write_weights", "index_bytes"]

# A function the model factory's module may define: ``hub_files(config) -> {file name: bytes}``.
HUB_FILES_HOOK = "hub_files"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# save_pretrained's default, so a model too big for one file is split where transformers would split it.
DEFAULT_MAX_SHARD_SIZE = "50GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]I?B|B)?\s*$", re.IGNORECASE)
# Bytes of safetensors header per tensor beyond its name: dtype, shape and offsets as JSON.
_HEADER_PER_TENSOR = 96
_HEADER_FIXED = 8 + 64  # length prefix and the {"__metadata__": {"format": "pt"}} entry
_PUBLISHED_METADATA = {"format": "pt"}  # what transformers' loader checks in a safetensors header


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"1MB"``, ``"500KiB"`` or a byte count, as ``save_pretrained`` reads sizes."""
    match = _SIZE.match(str(text))
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 1048576")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


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


def _is_transformers_model(model: torch.nn.Module) -> bool:
    module = sys.modules.get("transformers")
    return module is not None and isinstance(model, module.PreTrainedModel)


def _tied_renames(model: torch.nn.Module, kept: set[str]) -> dict[str, str]:
    """Stored name -> the name transformers keeps, for each tied group where they differ."""
    state = model.state_dict()
    stored = dedupe_shared_tensors(state)
    renames = {}
    for name in stored:
        group = [other for other, tensor in state.items()
                 if tensor.data_ptr() == state[name].data_ptr() and tensor.device == state[name].device]
        wanted = [other for other in group if other in kept]
        if name not in kept and len(wanted) == 1:
            renames[name] = wanted[0]
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
    return ModelExport(is_transformers=True, architecture=architecture,
                       config_json=model.config.to_json_string(use_diff=True).encode("utf-8"),
                       generation_config_json=generation, renames=_tied_renames(model, kept))


def inspect_model(config: Config, public_config: Mapping[str, Any]) -> ModelExport:
    """Build ``config``'s model (CPU, random weights) and describe how to publish it.

    ``public_config`` is the config as published (machine paths removed); a model that is
    not a transformers one records it in its ``config.json`` so the card's snippet can
    rebuild the model from that file alone.
    """
    from ..run import build_model

    model = build_model(config, "cpu")
    architecture = f"{type(model).__module__}.{type(model).__qualname__}"
    if _is_transformers_model(model):
        return _transformers_export(model, architecture)
    state = model.state_dict()
    stored = dedupe_shared_tensors(state)
    # Tied names absent from the file, each with the stored name it shares storage with.
    tied = {alias: next(kept for kept in stored if state[kept].data_ptr() == tensor.data_ptr())
            for alias, tensor in state.items() if alias not in stored}
    payload = {
        "architecture": architecture,
        "tied": dict(sorted(tied.items())),
        "factory": config.model.factory,
        "dtype": config.training.dtype,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "config": dict(public_config),
    }
    return ModelExport(is_transformers=False, architecture=architecture, config_json=_json(payload),
                       generation_config_json=None, renames={})


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
            raise ConfigError(f"{where} returned the file name {name!r}: use a plain name that is not one of the "
                              f"stage's own files ({', '.join(sorted(reserved))})")
        if not isinstance(data, bytes):
            raise ConfigError(f"{where}: {name} must be bytes, got {type(data).__name__}")
    return dict(sorted(files.items()))


# -- weights --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WeightsPlan:
    """Published tensor name -> file, the files in order, and the tensors' total bytes."""

    weight_map: dict[str, str]
    files: tuple[str, ...]
    total_size: int
    renames: dict[str, str]

    @property
    def copies_source(self) -> bool:
        """One file under the stored names: the checkpoint's file can be copied byte for byte."""
        return len(self.files) == 1 and not self.renames


def plan_weights(source: Path, renames: Mapping[str, str], max_shard_size: int) -> WeightsPlan:
    """Split the tensors of ``source`` into files of at most ``max_shard_size`` bytes (header
    included), in name order; a tensor larger than that gets a file of its own, as with
    ``save_pretrained``."""
    sizes: dict[str, int] = {}
    with safe_open(str(source), framework="pt", device="cpu") as handle:
        for name in handle.keys():
            view = handle.get_slice(name)
            count = 1
            for dim in view.get_shape():
                count *= dim
            element = torch.empty((), dtype=getattr(torch, _DTYPES[view.get_dtype()])).element_size()
            sizes[renames.get(name, name)] = count * element
    shards: list[list[str]] = [[]]
    used = _HEADER_FIXED
    for name in sorted(sizes):
        cost = sizes[name] + len(name.encode("utf-8")) + _HEADER_PER_TENSOR
        if shards[-1] and used + cost > max_shard_size:
            shards.append([])
            used = _HEADER_FIXED
        shards[-1].append(name)
        used += cost
    count = len(shards)
    files = (MODEL_FILE,) if count == 1 else tuple(shard_name(i + 1, count) for i in range(count))
    weight_map = {name: files[i] for i, names in enumerate(shards) for name in names}
    return WeightsPlan(weight_map=dict(sorted(weight_map.items())), files=files, total_size=sum(sizes.values()),
                       renames=dict(renames))


# safetensors header dtype -> torch dtype attribute
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64"}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # Bytes, not values: NaN != NaN, and -0.0 == 0.0 would hide a difference.
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True


def write_weights(folder: Path, source: Path, plan: WeightsPlan) -> dict[str, dict[str, Any]]:
    """Write the planned files into ``folder`` from ``source`` (one file's tensors in memory
    at a time), then read each back and compare every tensor's bytes with the source.
    Returns ``{file: {"sha256", "size"}}`` (hashed while writing)."""
    stored_name = {published: stored for stored, published in plan.renames.items()}
    written: dict[str, dict[str, Any]] = {}
    with safe_open(str(source), framework="pt", device="cpu") as handle:
        for file in plan.files:
            names = [name for name, target in plan.weight_map.items() if target == file]
            tensors = {name: handle.get_tensor(stored_name.get(name, name)) for name in names}
            sha, size = write_safetensors(folder / file, tensors, _PUBLISHED_METADATA)
            written[file] = {"sha256": sha, "size": size}
            with safe_open(str(folder / file), framework="pt", device="cpu") as back:
                if set(back.keys()) != set(names) or not all(_same_bits(back.get_tensor(n), tensors[n]) for n in names):
                    raise OSError(f"{folder / file} reads back with other tensors than were written: check the disk")
            del tensors
    return written


def index_bytes(plan: WeightsPlan) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    return _json({"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map})

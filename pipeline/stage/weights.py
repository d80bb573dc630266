"""The checkpoint's weights on their way into the stage, one tensor in memory at a time.

:func:`~pipeline.checkpoint.open_weights` copies the weights of a verified checkpoint into
a scratch folder beside the stage, hashing while copying and comparing with ``meta.json``:
every later read is of this private copy, so the bytes staged are the bytes verified, and
nothing needs the whole model in memory. :func:`plan_weights` splits the tensors into the files
the Hub will hold (``--max-shard-size``; never above the Hub's per-file maximum) and
:func:`write_weights` writes them: the copy itself, renamed into the stage, when nothing
changes; otherwise tensor by tensor (a distributed checkpoint's sharded tensors each
assembled alone), each file re-hashed from disk after writing.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..checkpoint import PUBLISHED_METADATA, CheckpointWeights, MappedTensors, write_safetensors_streamed
from ..errors import ConfigError, StageAuditError, StageError
from ..hashing import sha256_file
from ..layout import MODEL_FILE, shard_name

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "HUB_MAX_FILE_SIZE",
    "WeightsPlan",
    "find_nonfinite",
    "large_blocks_to_the_os",
    "parse_size",
    "plan_weights",
    "write_weights",
    "index_bytes",
]

# save_pretrained's default, so a model too big for one file is split where transformers would split it.
DEFAULT_MAX_SHARD_SIZE = "50GB"
# The Hub refuses a larger file (20 GB is its recommendation).
HUB_MAX_FILE_SIZE = 50 * 10**9
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]I?B|B)?\s*$", re.IGNORECASE)
# Bytes of safetensors header per tensor beyond its name: dtype, shape and offsets as JSON.
_HEADER_PER_TENSOR = 96
_HEADER_FIXED = 8 + 64  # length prefix and the {"__metadata__": {"format": "pt"}} entry
_SCAN_ELEMENTS = 1 << 18  # elements per slice of the NaN/inf scan
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def large_blocks_to_the_os() -> None:
    """Make glibc's allocator hand every freed block of 1 MiB or more back to the OS at once.

    By default glibc raises its mmap threshold to the size of the largest block freed (up
    to 32 MiB), after which the 8 MiB read, hash and tensor buffers of staging come from
    heaps that keep their pages once freed, one heap per thread: the peak would depend on
    which thread freed what. Script 05 calls this first (``mallopt(M_MMAP_THRESHOLD)``, a
    documented glibc call); elsewhere it does nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"1MB"``, ``"500KiB"`` or a byte count, as ``save_pretrained`` reads sizes."""
    match = _SIZE.match(str(text))
    if match is None or int(match.group(1)) < 1:
        raise ConfigError(
            f"--max-shard-size {text!r}: expected a positive size such as 5GB, 500MB or 1048576"
        )
    return int(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


def _nbytes(spec: torch.Tensor) -> int:
    return spec.numel() * spec.element_size()


# -- the published files ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WeightsPlan:
    """Published tensor name -> file, the files in order, and the tensors' total bytes."""

    weight_map: dict[str, str]
    files: tuple[str, ...]
    total_size: int
    renames: dict[str, str]

    @property
    def copies_source(self) -> bool:
        """One file under the stored names: the checkpoint's file can be published byte for byte."""
        return len(self.files) == 1 and not self.renames

    def stored(self, published: str) -> str:
        """The stored name of a published tensor."""
        return next((stored for stored, name in self.renames.items() if name == published), published)


def plan_weights(
    specs: Mapping[str, torch.Tensor], renames: Mapping[str, str], max_shard_size: int
) -> WeightsPlan:
    """Split the tensors (``specs``: stored name -> ``meta`` tensor) into files of at most
    ``max_shard_size`` bytes (header included), in name order; a tensor larger than that
    gets a file of its own, as with ``save_pretrained``. No file may exceed the Hub's
    per-file maximum: a tensor above it is refused by name, a larger ``--max-shard-size``
    with the fix."""
    sizes = {renames.get(name, name): _nbytes(spec) for name, spec in specs.items()}
    too_big = sorted((size, name) for name, size in sizes.items() if size + _HEADER_FIXED > HUB_MAX_FILE_SIZE)
    if too_big:
        size, name = too_big[-1]
        raise StageError(
            f"tensor {name} is {size:,} bytes: a file holding it would exceed the Hub's per-file "
            f"maximum of {HUB_MAX_FILE_SIZE:,} bytes, and a tensor cannot be split across files; "
            "nothing was staged"
        )
    shards: list[list[str]] = [[]]
    used = _HEADER_FIXED
    for name in sorted(sizes):
        cost = sizes[name] + len(name.encode("utf-8")) + _HEADER_PER_TENSOR
        if shards[-1] and used + cost > max_shard_size:
            shards.append([])
            used = _HEADER_FIXED
        shards[-1].append(name)
        used += cost
        if used > HUB_MAX_FILE_SIZE:
            raise StageError(
                f"--max-shard-size {max_shard_size:,} bytes puts {used:,} bytes in one file, above the "
                f"Hub's per-file maximum of {HUB_MAX_FILE_SIZE:,} bytes: pass --max-shard-size 50GB or "
                "less (20GB is the Hub's recommendation); nothing was staged"
            )
    count = len(shards)
    files = (MODEL_FILE,) if count == 1 else tuple(shard_name(i + 1, count) for i in range(count))
    weight_map = {name: files[i] for i, names in enumerate(shards) for name in names}
    return WeightsPlan(
        weight_map=dict(sorted(weight_map.items())),
        files=files,
        total_size=sum(sizes.values()),
        renames=dict(renames),
    )


def find_nonfinite(path: str | Path) -> list[str]:
    """Names of floating-point tensors in a safetensors file that hold NaN or ±inf, sorted;
    one tensor in memory at a time."""
    mapped, bad = MappedTensors(path), []
    for name in sorted(mapped.specs):
        if _nonfinite(mapped.tensor(name)):
            bad.append(name)
        mapped.release(name)
    return bad


def _nonfinite(tensor: torch.Tensor) -> bool:
    """NaN or ±inf anywhere, checked a slice at a time (small temporaries, whatever the size)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _SCAN_ELEMENTS):
        piece = flat[start : start + _SCAN_ELEMENTS]
        if piece.is_floating_point() and piece.element_size() == 1:
            piece = piece.float()  # float8 kernels lack isfinite
        if not bool(torch.isfinite(piece).all()):
            return True
    return False


def write_weights(
    built: Path, weights: CheckpointWeights, plan: WeightsPlan
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Write the planned files into ``built``, one tensor in memory at a time; returns
    ``{file: {"sha256", "size"}}`` and the (published) names of tensors holding NaN or ±inf.

    Unchanged weights are the verified copy itself, moved in; others are written tensor
    by tensor and each file is re-hashed from disk and its header compared with the plan.
    ``weights`` is closed after (its maps and buffer let go)."""
    nonfinite = []
    if plan.copies_source and weights.copy is not None:
        os.replace(weights.copy, built / plan.files[0])
        for name in sorted(weights.specs):
            if _nonfinite(weights.tensor(name)):
                nonfinite.append(name)
            weights.release(name)
        weights.close()
        return {plan.files[0]: dict(weights.entry or {})}, nonfinite
    written: dict[str, dict[str, Any]] = {}
    for file in plan.files:
        specs = {
            name: weights.specs[plan.stored(name)]
            for name, target in plan.weight_map.items()
            if target == file
        }
        produced: list[str] = []

        def produce(name: str) -> torch.Tensor:
            if produced:  # written by now: its pages can go
                weights.release(plan.stored(produced[-1]))
            produced.append(name)
            tensor = weights.tensor(plan.stored(name))
            if _nonfinite(tensor):
                nonfinite.append(name)
            return tensor

        sha256, size = write_safetensors_streamed(built / file, specs, produce, PUBLISHED_METADATA)
        if produced:
            weights.release(plan.stored(produced[-1]))
        back = MappedTensors(built / file)
        if sha256_file(built / file) != sha256 or {n: (t.dtype, t.shape) for n, t in back.specs.items()} != {
            n: (t.dtype, t.shape) for n, t in specs.items()
        }:
            raise StageAuditError(
                f"{built / file} reads back with other bytes than were written: check the disk"
            )
        written[file] = {"sha256": sha256, "size": size}
    weights.close()
    return written, sorted(nonfinite)


def index_bytes(plan: WeightsPlan) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    payload = {"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map}
    return (json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")

"""Measured comparisons for the resume proof: tensors, nested training state, plain records.

Every comparison yields a :class:`Check` with the largest absolute difference it measured,
zero included. With ``atol == 0`` floating values must match bit for bit (so ``-0.0`` and
``0.0`` differ, and a NaN matches only the same NaN); with ``atol > 0`` they may differ by at
most ``atol`` (rtol is always 0). Integers, booleans, strings, dtypes, shapes and key sets
must always match exactly: RNG states and data positions have no tolerance.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..checkpoint import join_state, load_checkpoint, read_tensors
from ..layout import MODEL_FILE, STATE_FILE

__all__ = [
    "Check",
    "Bundle",
    "SNAPSHOT_STATE",
    "compare",
    "checkpoint_bundle",
    "load_snapshot",
]

# A snapshot folder holds the same two safetensors files as a checkpoint, plus this JSON
# (the ``training_state`` part of a checkpoint's meta.json).
SNAPSHOT_STATE = "training_state.json"


@dataclass(slots=True)
class Check:
    """One named comparison between a reference and a candidate."""

    name: str
    component: str
    passed: bool
    max_abs_diff: float | None  # None: some values could not be compared (structure differs)
    compared: int
    differing: int
    first_difference: str | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "component": self.component,
            "passed": self.passed,
            "max_abs_diff": self.max_abs_diff,
            "compared": self.compared,
            "differing": self.differing,
            "first_difference": self.first_difference,
            "note": self.note,
        }


@dataclass(slots=True)
class Bundle:
    """Model tensors, the JSON training state and its tensor table: a checkpoint or a snapshot."""

    model: dict[str, torch.Tensor]
    state: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def component(self, name: str) -> Any:
        return join_state(self.state[name], self.tensors)

    def history(self, key: str) -> torch.Tensor:
        return self.tensors[f"history/{key}"]

    def evaluations(self) -> dict[str, torch.Tensor]:
        """``training.eval_every``'s values (``evaluation/*``; none when the run evaluates nothing)."""
        return {key: tensor for key, tensor in self.tensors.items() if key.startswith("evaluation/")}


def checkpoint_bundle(folder: Path) -> Bundle:
    """A committed checkpoint, after verifying every file's SHA-256 against its meta.json."""
    loaded = load_checkpoint(folder)
    return Bundle(loaded.model_tensors, loaded.meta["training_state"], loaded.state_tensors)


def load_snapshot(folder: Path) -> Bundle:
    state = json.loads((folder / SNAPSHOT_STATE).read_text(encoding="utf-8"))
    return Bundle(read_tensors(folder / MODEL_FILE), state, read_tensors(folder / STATE_FILE))


def compare(name: str, component: str, reference: Any, candidate: Any, atol: float) -> Check:
    """Compare two nested values (dicts, lists, tuples, tensors, arrays, scalars) leaf by leaf."""
    left, right = _leaves(reference), _leaves(candidate)
    paths = list(left) + [p for p in right if p not in left]
    worst, comparable, differing, first, note = 0.0, True, 0, None, ""
    for path in paths:
        if path not in left or path not in right:
            ok, diff, why = False, None, f"only in the {'candidate' if path in right else 'reference'}"
        else:
            ok, diff, why = _leaf(left[path], right[path], atol)
        if diff is None:
            comparable = False
        else:
            worst = max(worst, diff)
        if not ok:
            differing += 1
            if first is None:
                first, note = path or "value", why
    return Check(
        name=name,
        component=component,
        passed=differing == 0,
        max_abs_diff=worst if comparable else None,
        compared=len(paths),
        differing=differing,
        first_difference=first,
        note=note,
    )


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(value, Mapping):
        for key, item in value.items():
            out.update(_leaves(item, f"{path}/{key}" if path else str(key)))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            out.update(_leaves(item, f"{path}/{index}" if path else str(index)))
    elif isinstance(value, np.ndarray):
        out[path] = torch.from_numpy(np.ascontiguousarray(value).copy())
    elif isinstance(value, np.generic):
        out[path] = value.item()
    else:
        out[path] = value
    return out


def _leaf(a: Any, b: Any, atol: float) -> tuple[bool, float | None, str]:
    """(within tolerance, measured max |a - b| or None when incomparable, why not)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensors(a, b, atol)
    if type(a) is not type(b):
        return False, None, f"type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, float):
        diff = _float_diff(a, b)
        ok = struct.pack("<d", a) == struct.pack("<d", b) if atol == 0 else diff <= atol
        return ok, diff, "" if ok else f"{a!r} vs {b!r}"
    if isinstance(a, int) and not isinstance(a, bool):
        return a == b, float(abs(a - b)), "" if a == b else f"{a} vs {b}"
    return a == b, 0.0 if a == b else None, "" if a == b else f"{a!r} vs {b!r}"


def _float_diff(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0  # also equal infinities, whose difference would be NaN
    return abs(a - b)


def _tensors(a: torch.Tensor, b: torch.Tensor, atol: float) -> tuple[bool, float | None, str]:
    if a.dtype != b.dtype:
        return False, None, f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return False, None, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.numel() == 0:
        return True, 0.0, ""
    a, b = a.detach().cpu(), b.detach().cpu()
    x, y = _as_float64(a), _as_float64(b)
    both_nan = torch.isnan(x) & torch.isnan(y)
    same = (x == y) | both_nan  # equal infinities would give inf - inf = NaN
    diff = torch.nan_to_num(torch.where(same, torch.zeros_like(x), (x - y).abs()), nan=math.inf)
    worst = float(diff.max())
    if atol == 0 or not (a.is_floating_point() or a.is_complex()):
        bad = (_bits(a) != _bits(b)).any(dim=1)  # per element, bit for bit
    else:
        bad = diff > atol
    count = int(bad.sum())
    if count == 0:
        return True, worst, ""
    index = int(bad.nonzero()[0, 0])
    where = "element" if a.dim() <= 1 else "flat element"
    return (
        False,
        worst,
        f"{count} of {a.numel()} elements differ, first at {where} {index}; max |diff| {worst:.3g}",
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One row of raw bytes per element."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), -1)


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).to(torch.float64)

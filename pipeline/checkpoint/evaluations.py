"""A run's evaluations (``run.evaluations``) in its training state, and their check on load.

Stored beside ``history/*`` as ``evaluation/step`` (int64) and one ``evaluation/<metric>``
(float64) per metric the task's ``evaluate`` returned, one value per evaluated step. A run
that evaluated nothing stores none of them, so its checkpoints are as before.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..config import METRIC_NAME
from ..errors import SEALED_BUT_UNFIT, StateMismatch

__all__ = ["PREFIX", "evaluation_tensors", "evaluations_from"]

PREFIX = "evaluation/"


def evaluation_tensors(evaluations: Mapping[str, list]) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores for ``evaluations`` (none before the first)."""
    if not evaluations["step"]:
        return {}
    return {
        f"{PREFIX}{name}": torch.tensor(values, dtype=torch.int64 if name == "step" else torch.float64)
        for name, values in evaluations.items()
    }


def _fail(where: str, why: str) -> StateMismatch:
    return StateMismatch(f"training_state.{where} {why}: {SEALED_BUT_UNFIT}")


def evaluations_from(tensors: Mapping[str, torch.Tensor], step: int) -> dict[str, list]:
    """``run.evaluations`` from a checkpoint's state tensors, checked (nothing set): steps
    strictly increasing in [1, ``step``], every metric a finite float64 value per step."""
    names = sorted(key[len(PREFIX) :] for key in tensors if key.startswith(PREFIX))
    if not names:
        return {"step": []}
    steps = tensors.get(f"{PREFIX}step")
    if steps is None or steps.dtype != torch.int64 or steps.dim() != 1 or len(steps) == 0:
        raise _fail(f"{PREFIX}step", "is not a list of int64 evaluated steps")
    listed = steps.tolist()
    if any(b <= a for a, b in zip(listed, listed[1:])) or listed[0] < 1 or listed[-1] > step:
        raise _fail(f"{PREFIX}step", f"does not count up within 1 ... {step}")
    metrics = [name for name in names if name != "step"]
    if not metrics:
        raise _fail(f"{PREFIX}step", "has no metric beside it")
    out: dict[str, list] = {"step": listed}
    for name in metrics:
        values = tensors[f"{PREFIX}{name}"]
        where = f"{PREFIX}{name}"
        if not METRIC_NAME.match(name):
            raise _fail(where, "is not a metric name")
        if values.dtype != torch.float64 or values.shape != steps.shape:
            raise _fail(where, f"is not {len(listed)} float64 values")
        out[name] = values.tolist()
        if not all(math.isfinite(value) for value in out[name]):
            raise _fail(where, "holds a value that is not finite")
    return out

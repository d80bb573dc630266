"""The best evaluated checkpoint (``checkpoint.best_metric``): which step it is, and its mark.

The best step is computed from the run's own evaluations (``run.evaluations``, saved in every
checkpoint), the earliest of equal values winning. The mark is ``BEST.json`` in the checkpoint
folder, ``{"step", "metric", "mode", "value"}``, replaced atomically. The order that keeps the
best and the last verifiable whatever instant a kill strikes (:meth:`CheckpointStore.prune_after_commit`):

1. the new best's checkpoint is committed (the old best is still there, still marked);
2. the mark moves to it (one atomic rename: either mark names a committed checkpoint);
3. only then the prune runs, sparing the marked step besides the last ``keep_last``.

A kill between 1 and 2 leaves the old best marked and kept; the next save marks the new one
(it is recomputed from the evaluations at every save). A mark that cannot be read stops every
prune (a warning): nothing is deleted that might be the best.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from ..durable import json_loads_strict, write_json_atomic
from ..errors import CheckpointError
from ..layout import BEST_FILE

__all__ = ["best_record", "read_best", "write_best", "best_path"]

_KEYS = frozenset({"step", "metric", "mode", "value"})
# The mark is a few dozen bytes; the bound keeps a stray file from being parsed.
_MAX_BYTES = 4096


def best_record(evaluations: Mapping[str, list], metric: str, mode: str) -> dict[str, Any] | None:
    """The best evaluated step of ``metric`` (``mode`` 'min' or 'max'), as the mark records it;
    ``None`` when nothing was evaluated yet or no metric is chosen."""
    if not metric or not evaluations.get("step") or metric not in evaluations:
        return None
    values = evaluations[metric]
    pick = min if mode == "min" else max
    index = values.index(pick(values))  # the first of equal values: the earliest step
    return {"step": int(evaluations["step"][index]), "metric": metric, "mode": mode, "value": values[index]}


def best_path(root: str | Path) -> Path:
    return Path(root) / BEST_FILE


def read_best(root: str | Path) -> dict[str, Any] | None:
    """The mark in ``root``, checked (``None``: there is none); a mark that is not one raises
    :class:`CheckpointError` naming the file."""
    path = best_path(root)
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_BYTES:
        raise CheckpointError(
            f"{path} is not a best-checkpoint mark: delete it; the next save writes it again"
        )
    try:
        record = json_loads_strict(path.read_bytes())
    except ValueError as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc}): delete it; the next save writes it again"
        ) from None
    if (
        not isinstance(record, dict)
        or set(record) != _KEYS
        or type(record["step"]) is not int
        or record["step"] < 1
        or not isinstance(record["metric"], str)
        or record["mode"] not in ("min", "max")
        or isinstance(record["value"], bool)
        or not isinstance(record["value"], (int, float))
        or not math.isfinite(record["value"])
    ):
        raise CheckpointError(
            f"{path} does not hold exactly step, metric, mode and a finite value: delete it; the next "
            "save writes it again"
        )
    return record


def write_best(root: str | Path, record: Mapping[str, Any]) -> None:
    """Move the mark to ``record`` (atomic: the old mark or the new one, never half of one)."""
    write_json_atomic(best_path(root), dict(record))

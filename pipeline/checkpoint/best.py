"""The best evaluated checkpoint (``checkpoint.best_metric``): which step it is, and its mark.

The best step is computed from the run's own evaluations (``run.evaluations``, saved in every
checkpoint), the earliest of equal values winning, among the steps that have a committed
checkpoint (:func:`best_record` with ``among``). The mark is ``BEST.json`` in the checkpoint
folder, ``{"step", "metric", "mode", "value"}``, replaced atomically. The order that keeps the
best and the last verifiable whatever instant a kill strikes (:meth:`CheckpointStore.prune_after_commit`):

1. the new best's checkpoint is committed (the old best is still there, still marked);
2. the mark moves to the best committed step (one atomic rename: either mark names a committed
   checkpoint);
3. only then the prune runs, sparing the marked step besides the last ``keep_last``.

A kill between 1 and 2 leaves the old best marked and kept; the next save marks the new one
(it is recomputed from the evaluations at every save), and so does the next resume before it
trains (:meth:`CheckpointStore.mark_best_again`): after a run's last save there is no next save.
A mark that cannot be read stops every prune (a warning): nothing is deleted that might be
the best. A resume that changes ``best_metric`` or ``best_mode`` moves the mark at its first
save to the best of the kept checkpoints under the new rule, and only then may the old best be
pruned.

Every reader checks the mark against the checkpoint it names (:func:`check_best`): that step
evaluated itself, with the marked value, no committed checkpoint before it recorded an
evaluation that the mark's own rule ranks as good or better, and none after it one ranked
better (by the evaluations the newest committed checkpoint recorded: the marked one's stop at
its own step). A mark moved by hand, or left from another run, is refused in one line; so is
a mark one save behind (a run killed between a commit and the mark's move), which the card
would otherwise present as the best it is not.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Mapping

from ..config import METRIC_NAME
from ..durable import json_loads_strict, write_json_atomic
from ..errors import CheckpointError
from ..layout import BEST_FILE

__all__ = ["BestRule", "best_record", "check_best", "read_best", "write_best", "best_path"]

_KEYS = frozenset({"step", "metric", "mode", "value"})
# The mark is a few dozen bytes; the bound keeps a stray file from being parsed.
_MAX_BYTES = 4096


def best_record(
    evaluations: Mapping[str, list], metric: str, mode: str, *, among: Collection[int] | None = None
) -> dict[str, Any] | None:
    """The best evaluated step of ``metric`` (``mode`` 'min' or 'max'), as the mark records it;
    ``None`` when nothing was evaluated yet or no metric is chosen. ``among``: only these steps
    count (the committed checkpoints'); ``None``: every evaluated step."""
    if not metric or not evaluations.get("step") or metric not in evaluations:
        return None
    pairs = [
        (int(step), value)
        for step, value in zip(evaluations["step"], evaluations[metric])
        if among is None or step in among
    ]
    if not pairs:
        return None
    pick = min if mode == "min" else max
    best = pick(value for _, value in pairs)
    step = next(step for step, value in pairs if value == best)  # the first of equal values: the earliest
    return {"step": step, "metric": metric, "mode": mode, "value": best}


@dataclass(frozen=True, slots=True)
class BestRule:
    """What a save hands its store (:attr:`CheckpointStore.best`): the rule, and the run's
    evaluations as of that save (a copy: training goes on while a background save commits)."""

    metric: str
    mode: str
    evaluations: Mapping[str, list]

    @classmethod
    def of(cls, evaluations: Mapping[str, list], metric: str, mode: str) -> "BestRule | None":
        """The rule of a run (``None`` without ``checkpoint.best_metric``)."""
        if not metric:
            return None
        return cls(metric, mode, {name: list(values) for name, values in evaluations.items()})

    def among(self, committed: Collection[int]) -> dict[str, Any] | None:
        """The mark for these committed steps: the best of them under this rule."""
        return best_record(self.evaluations, self.metric, self.mode, among=set(committed))


def _better_or_equal(value: float, than: float, mode: str) -> bool:
    return value <= than if mode == "min" else value >= than


def _better(value: float, than: float, mode: str) -> bool:
    return value < than if mode == "min" else value > than


def check_best(
    mark: Mapping[str, Any],
    evaluations: Mapping[str, list],
    committed: Collection[int],
    path: str | Path,
    *,
    newest: Mapping[str, list] | None = None,
) -> dict[str, Any]:
    """``mark`` (read from ``path``) checked against the evaluations that the checkpoint it
    names recorded (its own training state): the step evaluated itself, ``metric`` is one of
    its values and has exactly the marked value, and no committed step before it was
    evaluated as good or better under the mark's ``mode`` (the mark names the earliest best
    of the kept checkpoints). ``newest``: the evaluations of the newest committed checkpoint,
    when that is a later one: no committed step after the mark was evaluated better there.
    Returns the mark with the record's value; a mark that fails raises
    :class:`CheckpointError` naming ``path``."""
    step, metric, mode = mark["step"], mark["metric"], mark["mode"]
    fix = "delete it (the next save marks the best again), or pass --checkpoint latest or PATH"
    steps = list(evaluations.get("step", []))
    if step not in steps or metric not in evaluations:
        recorded = ", ".join(sorted(name for name in evaluations if name != "step")) or "nothing"
        raise CheckpointError(
            f"{path} marks step {step} as the best by {metric}, but that checkpoint recorded no "
            f"evaluation of {metric} at its own step (it recorded {recorded}): {fix}"
        )
    values = evaluations[metric]
    value = values[steps.index(step)]
    if value != mark["value"]:
        raise CheckpointError(
            f"{path} marks step {step} with {metric} = {mark['value']!r}, but that checkpoint recorded "
            f"{metric} = {value!r} at step {step}: {fix}"
        )
    for earlier, earlier_value in zip(steps, values):
        if earlier < step and earlier in committed and _better_or_equal(earlier_value, value, mode):
            raise CheckpointError(
                f"{path} marks step {step} ({metric} = {value!r}) as the best ({mode}), but the committed "
                f"step {earlier} was evaluated at {metric} = {earlier_value!r}, as good or better: {fix}"
            )
    later = newest or {}
    for after, after_value in zip(later.get("step", []), later.get(metric, [])):
        if after > step and after in committed and _better(after_value, value, mode):
            raise CheckpointError(
                f"{path} marks step {step} ({metric} = {value!r}) as the best ({mode}), but the committed "
                f"step {after} was evaluated better, at {metric} = {after_value!r} (the mark was moved by "
                f"hand, or a run stopped between that save and the mark's move): resume the run with "
                "--resume latest (it marks the best again before it trains), or pass --checkpoint latest or PATH"
            )
    return {"step": step, "metric": metric, "mode": mode, "value": value}


def best_path(root: str | Path) -> Path:
    return Path(root) / BEST_FILE


def read_best(root: str | Path) -> dict[str, Any] | None:
    """The mark in ``root``, checked (``None``: there is none); a mark that is not one raises
    :class:`CheckpointError` naming the file. Opened once, without following a link or waiting
    on a FIFO, and read from what was opened: a file swapped in after a look at its name would
    be read (or block the reader) otherwise."""
    path = best_path(root)
    not_a_mark = CheckpointError(
        f"{path} is not a best-checkpoint mark: delete it; the next save writes it again"
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, a socket
            raise not_a_mark from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_a_mark
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_BYTES:
        raise not_a_mark
    try:
        record = json_loads_strict(data)
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
        or not METRIC_NAME.match(record["metric"])
        or record["mode"] not in ("min", "max")
        or isinstance(record["value"], bool)
        or not isinstance(record["value"], (int, float))
        or not math.isfinite(record["value"])
    ):
        raise CheckpointError(
            f"{path} does not hold exactly step, a metric name, mode and a finite value: delete it; the "
            "next save writes it again"
        )
    return record


def write_best(root: str | Path, record: Mapping[str, Any]) -> None:
    """Move the mark to ``record`` (atomic: the old mark or the new one, never half of one)."""
    write_json_atomic(best_path(root), dict(record))

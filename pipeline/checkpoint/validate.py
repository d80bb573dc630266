"""Check a restored training state before any of it touches a live object.

``meta.json`` is sealed and the tensors hashed, but a sealed file can still be hostile or
written by a buggy version, so :func:`validated_state` joins every component (each tensor
referenced once), then checks each against the objects just built from the config:
types per field, finite hyperparameters, optimizer state shaped like the parameters it
belongs to, a sane integer step matching the history, sampler positions and RNG states
that a scratch object accepts, a data source record that belongs to this run's inputs.
Any failure is one :class:`~pipeline.errors.StateMismatch` (a source that changed: a
:class:`~pipeline.errors.DataError`) naming the field; nothing live has been changed by then.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..errors import StateMismatch
from ..run import TrainingRun
from .components import components, fail, like
from .evaluations import PREFIX, evaluations_from

__all__ = ["HISTORY", "history_lists", "validated_state"]

HISTORY = ("step", "loss", "lr", "grad_norm", "epoch")
"""``run.history``'s lists, stored as ``history/KEY``: one value per step (``grad_norm`` at the
logged steps only, NaN elsewhere; ``epoch`` NaN for a stream)."""
# Keys a checkpoint written before they were recorded lacks: read as NaN at every step.
_ADDED = frozenset({"grad_norm", "epoch"})
_DTYPES = {"step": torch.int64}


def history_lists(tensors: Mapping[str, torch.Tensor], step: int) -> dict[str, list]:
    """``run.history`` from a checkpoint's ``history/*`` tensors (:func:`validated_state` checks
    their types too): each of ``step`` values, or ``ValueError`` naming it."""
    history = {
        key: tensors[f"history/{key}"].tolist() if f"history/{key}" in tensors else [math.nan] * step
        for key in HISTORY
    }
    for key, values in history.items():
        if len(values) != step:
            raise ValueError(f"history/{key} holds {len(values)} values, the history {step} steps")
    return history


def _progress(
    state: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], run: TrainingRun, step: int | None
) -> int:
    progress = state["progress"]
    if not isinstance(progress, dict) or set(progress) != {"step"}:
        raise fail("progress", "is not {step}")
    value = progress["step"]
    if type(value) is not int or value < 0:
        raise fail("progress.step", f"is {value!r}, expected an integer >= 0")
    if step is not None and value != step:
        raise fail("progress.step", f"is {value}, the checkpoint is step {step}")
    if value > run.config.training.max_steps:
        raise fail("progress.step", f"is {value}, past training.max_steps {run.config.training.max_steps}")
    history = {key: tensors.get(f"history/{key}") for key in HISTORY}
    for key, tensor in history.items():
        dtype = _DTYPES.get(key, torch.float64)
        if tensor is None and key in _ADDED:
            continue
        if tensor is None or tensor.dtype != dtype or tensor.shape != (value,):
            raise fail(f"history/{key}", f"is not {value} {dtype} values")
    if not torch.equal(history["step"], torch.arange(1, value + 1, dtype=torch.int64)):
        raise fail("history/step", "does not count 1, 2, ... step")
    return value


def validated_state(
    run: TrainingRun,
    state: Any,
    tensors: Mapping[str, torch.Tensor],
    *,
    step: int | None = None,
    optimizer: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Join and check every component of ``state`` against ``run`` (nothing is loaded):
    ``{name: state}`` for each :func:`~pipeline.checkpoint.components.components` entry, and
    ``"step"``.

    ``optimizer``: for a torchrun run, this rank's live optimizer state in
    ``torch.distributed.checkpoint``'s flattened form (what its checkpoints hold); the
    saved one must have its structure and types (default: torch's ``state_dict`` form)."""
    table = components()
    names = [component.name for component in table]
    if isinstance(state, dict):  # a checkpoint written before a built-in component existed
        state = {**{c.name: c.absent() for c in table if c.absent and c.name not in state}, **state}
    if not isinstance(state, dict) or set(state) != {*names, "progress"}:
        raise fail("", f"does not hold exactly {', '.join([*names, 'progress'])}")
    used: set[str] = set()
    try:
        joined = {
            component.name: component.joined(state[component.name], tensors, used) for component in table
        }
    except KeyError as exc:
        raise fail("", f"references tensor {exc.args[0]!r}, which the state file lacks") from None
    except ValueError as exc:
        if isinstance(exc, StateMismatch):  # a component's own join refused it, naming the field
            raise
        raise fail("", f"is malformed: {exc}") from None
    except RecursionError:
        raise fail("", "is nested too deeply") from None
    unused = sorted(
        set(tensors)
        - used
        - {f"history/{key}" for key in HISTORY}
        - {k for k in tensors if k.startswith(PREFIX)}
    )
    if unused:
        raise fail("", f"does not reference tensor {unused[0]!r} of the state file")
    joined["step"] = _progress(state, tensors, run, step)
    joined["history"] = history_lists(tensors, joined["step"])
    joined["evaluations"] = evaluations_from(tensors, joined["step"])
    for component in table:
        if component.name == "optimizer" and optimizer is not None:
            like(joined["optimizer"], dict(optimizer), "optimizer")
        else:
            component.checked(run, joined[component.name], joined["step"])
    return joined

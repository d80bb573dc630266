"""Capture and restore the complete training state of a run.

Its components (:mod:`~pipeline.checkpoint.components`: ``rng``, ``optimizer``,
``scheduler``, ``data``, ``scaler``, and any registered one) can each be left out on
restore, which is how the resume proof shows every one of them matters. Model weights and
progress (step, history) are always restored.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ..errors import CheckpointError, InternalError, StateMismatch, first_line
from ..run import TrainingRun
from .components import component_names, components, restore_order
from .evaluations import evaluation_tensors
from .validate import HISTORY, validated_state
from .weights import dedupe_shared_tensors, load_model_weights

__all__ = [
    "capture_state",
    "capture_history",
    "check_capturable",
    "checked_omit",
    "restore_state",
    "restore_components",
]


def capture_state(
    run: TrainingRun,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """Return (model tensors, JSON state, state tensors). Tensors are the live ones: write
    them before the next step, or copy them (the async checkpointer does)."""
    model_tensors = dedupe_shared_tensors(run.model.state_dict())
    tensors: dict[str, torch.Tensor] = {}
    state = {component.name: component.captured(run, tensors) for component in components()}
    state["progress"] = {"step": run.step}
    capture_history(run, tensors)
    return model_tensors, state, tensors


def capture_history(run: TrainingRun, tensors: dict[str, torch.Tensor]) -> None:
    """The history (step, loss, learning rate, gradient norm, epoch), as tensors ``history/KEY`` of ``tensors``, and the
    evaluations (``evaluation/*``, :mod:`.evaluations`)."""
    for key in HISTORY:
        dtype = torch.int64 if key == "step" else torch.float64
        tensors[f"history/{key}"] = torch.tensor(run.history[key], dtype=dtype)
    tensors.update(evaluation_tensors(run.evaluations))


def check_capturable(run: TrainingRun) -> None:
    """Walk the state once before the first step, so state that cannot be saved without
    pickle (a scheduler holding a callable object, say) fails now, not at the first save
    hours later."""
    try:
        capture_state(run)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"this run's state cannot be checkpointed: {exc}") from None


def checked_omit(omit: Iterable[str]) -> frozenset[str]:
    """``omit`` as a set of component names, each one of this run's components."""
    omit = frozenset(omit)
    unknown = omit - set(component_names())
    if unknown:
        raise InternalError(f"unknown components to omit: {sorted(unknown)}; choose from {component_names()}")
    return omit


def restore_state(
    run: TrainingRun,
    model_tensors: Mapping[str, torch.Tensor],
    state: Any,
    tensors: Mapping[str, torch.Tensor],
    *,
    omit: Iterable[str] = (),
    step: int | None = None,
    derived: Any = (),
    record: Any = None,
) -> None:
    """Validate everything first (:func:`~pipeline.checkpoint.validate.validated_state`;
    ``step``: the checkpoint's step, which the state must agree with; ``derived``: the
    checkpoint's derived buffers, compared with this run's fresh ones; ``record``: its
    meta.json model record, see :func:`~pipeline.checkpoint.weights.check_weights_fit`),
    then load weights, every component but ``omit`` (RNG states last), step and history."""
    omit = checked_omit(omit)
    joined = validated_state(run, state, tensors, step=step)
    try:
        load_model_weights(run.model, model_tensors, derived=derived, record=record)
        restore_components(run, joined, omit)
        run.step = joined["step"]
        run.history = joined["history"]
        run.evaluations = joined["evaluations"]
    except (ValueError, RuntimeError, TypeError, KeyError, IndexError, AttributeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise StateMismatch(
            f"saved training state does not fit the objects built from the config: "
            f"{first_line(exc, limit=None)}"
        ) from None


def restore_components(
    run: TrainingRun, joined: Mapping[str, Any], omit: Iterable[str] = (), *, shared_only: bool = False
) -> None:
    """Set each validated component but ``omit`` into the run, the RNGs last; with
    ``shared_only``, only those a launch saves once for every rank (a distributed restore
    sets each rank's own itself)."""
    for component in restore_order():
        if component.name not in omit and not (shared_only and component.per_rank):
            component.restore(run, joined[component.name])

"""Capture and restore the complete training state of a run.

Components (each can be left out on restore, which is how the resume proof shows every
one of them matters): ``optimizer``, ``scheduler``, ``data`` (sampler position, the task
data's own state, and the ``source``: its size and fingerprint, or a stream's positions),
``rng`` (Python, NumPy Generator and legacy, torch CPU and CUDA),
``scaler`` (AMP). Model weights and progress (step, history) are always restored.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping

import torch

from ..errors import CheckpointError, InternalError, StateMismatch
from ..rng import capture_rng, restore_rng
from ..run import TrainingRun
from .codec import split_state
from .evaluations import evaluation_tensors
from .validate import HISTORY, validated_state
from .weights import dedupe_shared_tensors, load_model_weights

__all__ = [
    "OMITTABLE",
    "capture_state",
    "capture_data",
    "check_capturable",
    "restore_state",
    "restore_positions",
]

OMITTABLE = ("rng", "optimizer", "scheduler", "data", "scaler")


def capture_state(
    run: TrainingRun,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """Return (model tensors, JSON state, state tensors). Tensors are the live ones: write
    them before the next step, or copy them (the async checkpointer does)."""
    model_tensors = dedupe_shared_tensors(run.model.state_dict())
    tensors: dict[str, torch.Tensor] = {}
    state = {
        "optimizer": split_state(run.optimizer.state_dict(), "optimizer", tensors),
        "scheduler": split_state(run.scheduler.state_dict(), "scheduler", tensors),
        "data": capture_data(run, tensors),
        "rng": split_state(capture_rng(run.generator), "rng", tensors),
        "scaler": split_state(run.scaler.state_dict(), "scaler", tensors) if run.scaler is not None else None,
        "progress": {"step": run.step},
    }
    for key in HISTORY:
        dtype = torch.int64 if key == "step" else torch.float64
        tensors[f"history/{key}"] = torch.tensor(run.history[key], dtype=dtype)
    tensors.update(evaluation_tensors(run.evaluations))
    return model_tensors, state, tensors


def capture_data(run: TrainingRun, tensors: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """The ``data`` component: the sampler's position, the task's own state, and the feed's
    ``source`` record (JSON). With ``tensors``, split for a checkpoint (tensors added there);
    without, the live values (copies of the sampler's and task's, for comparisons). Under
    torchrun a stream's record gathers every rank's position: every rank calls this together."""
    task_state = getattr(run.data, "state_dict", None)
    sampler = run.sampler.state_dict() if run.sampler is not None else None
    task = task_state() if task_state else None
    if tensors is None:
        return copy.deepcopy({"sampler": sampler, "task": task, "source": run.feed.state_dict()})
    return {
        "sampler": split_state(sampler, "data/sampler", tensors) if sampler is not None else None,
        "task": split_state(task, "data/task", tensors) if task_state else None,
        "source": run.feed.state_dict(),
    }


def check_capturable(run: TrainingRun) -> None:
    """Walk the state once before the first step, so state that cannot be saved without
    pickle (a scheduler holding a callable object, say) fails now, not at the first save
    hours later."""
    try:
        capture_state(run)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"this run's state cannot be checkpointed: {exc}") from None


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
    then load weights, optimizer, scheduler, data position and scaler, and RNG states last."""
    omit = frozenset(omit)
    unknown = omit - set(OMITTABLE)
    if unknown:
        raise InternalError(f"unknown components to omit: {sorted(unknown)}; choose from {OMITTABLE}")
    joined = validated_state(run, state, tensors, step=step)
    try:
        load_model_weights(run.model, model_tensors, derived=derived, record=record)
        if "optimizer" not in omit:
            run.optimizer.load_state_dict(joined["optimizer"])
        restore_positions(run, joined, omit)
        if "scaler" not in omit and run.scaler is not None:
            run.scaler.load_state_dict(joined["scaler"])
        run.step = joined["step"]
        run.history = {key: tensors[f"history/{key}"].tolist() for key in HISTORY}
        run.evaluations = joined["evaluations"]
        if "rng" not in omit:
            restore_rng(joined["rng"], run.generator, need_cuda=run.device.type == "cuda")
    except (ValueError, RuntimeError, TypeError, KeyError, IndexError, AttributeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateMismatch(
            f"saved training state does not fit the objects built from the config: {first_line}"
        ) from None


def restore_positions(run: TrainingRun, joined: Mapping[str, Any], omit: Iterable[str] = ()) -> None:
    """The schedule's and the data's positions from a validated state (the scheduler; the
    sampler, then the task's own state), except the omitted components: the same in one
    process and under torchrun."""
    if "scheduler" not in omit:
        run.scheduler.load_state_dict(joined["scheduler"])
    if "data" not in omit:
        if run.sampler is not None:
            run.sampler.load_state_dict(joined["sampler"])
        run.feed.load_state_dict(joined["source"])
        if joined["task"] is not None:
            run.data.load_state_dict(joined["task"])

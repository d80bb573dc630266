"""Evaluation during training: the task's ``evaluate`` on the live model when the callbacks
ask for it (``training.eval_every``'s steps: the built-in ``schedule``), its values in
``run.evaluations`` and heard by every callback's ``on_evaluate``; and :class:`BestMark`, the
callback that saves a new best step of ``checkpoint.best_metric``.

``evaluate(model, device)`` is the function script 04 calls on a checkpoint; it returns
``{metric: value}``, or ``{set: {metric: value}}`` for several evaluation sets (named
``"set/metric"`` from then on). Here it sees the
live model in eval mode under ``torch.no_grad`` (train mode restored after), with every RNG
family the training draws from saved before and restored after: an evaluation that draws
(a sampling metric, say) changes nothing the training computes, so a resume stays bitwise
whatever ``eval_every`` is. Under torchrun every rank evaluates the whole model: DDP's
module (its replica, no collective), or the FSDP2 model, whose forward gathers the shards
on every rank together; the replicas are equal, so every rank records the same values.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import get_close_matches

import torch

from .callbacks import Callbacks, Control
from .checkpoint import best_record
from .config import METRIC_NAME
from .errors import ConfigError, MetricsError
from .evaluate import check_metrics
from .factories import factory_errors
from .rng import capture_rng, restore_rng
from .run import TrainingRun
from .world import World

__all__ = ["evaluate_step", "Evaluation", "BestMark"]


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluation during training, and what it asks of the loop."""

    metrics: dict[str, float]
    refusal: str | None = None
    """``checkpoint.best_metric`` is not among the values: save this step, then stop with this."""
    fix: str | None = None
    """With ``refusal``: the ``--set`` item (``key=value``) the printed resume command carries."""


def evaluate_step(run: TrainingRun, world: World, callbacks: Callbacks, control: Control) -> Evaluation:
    """Evaluate the step just trained, record the values (their names checked against every
    earlier evaluation's first: nothing is recorded or written for an evaluation refused), say
    them, and let every callback hear them."""
    step = run.step
    if not callable(getattr(run.data, "evaluate", None)):
        raise ConfigError(
            f"a callback asked for an evaluation of step {step} (control.should_evaluate), but the task "
            f"({run.config.data.factory}) has no evaluate(model, device)"
        )
    metrics = _evaluate(run, world)
    _record(run.evaluations, step, metrics, run.config.data.factory)
    control.say(
        f"step {step} evaluation: " + ", ".join(f"{name} {value:.6g}" for name, value in metrics.items())
    )
    callbacks.on_evaluate(run, metrics, control)
    checkpoint = run.config.checkpoint
    if checkpoint.best_metric and checkpoint.best_metric not in metrics:
        names = sorted(metrics)
        # The printed resume command sets the name closest to the misspelt one (else the first).
        instead = (get_close_matches(checkpoint.best_metric, names, n=1) or names)[0]
        return Evaluation(
            metrics,
            refusal=f"{run.config.source}: checkpoint.best_metric is {checkpoint.best_metric!r}, but the task's "
            f"evaluate returned {', '.join(names)}: set checkpoint.best_metric to one of them",
            fix=f"checkpoint.best_metric={instead}",
        )
    return Evaluation(metrics)


class BestMark:
    """``checkpoint.best_metric``: an evaluation that is the run's new best asks for its step to
    be saved, on the save interval or not. The mark itself (``BEST.json``, and the order that
    keeps the best checkpoint) is the store's (:mod:`pipeline.checkpoint.best`)."""

    def __init__(self, metric: str, mode: str) -> None:
        self.metric, self.mode = metric, mode

    def on_evaluate(self, run: TrainingRun, metrics: dict[str, float], control: Control) -> None:
        best = best_record(run.evaluations, self.metric, self.mode)
        if best is not None and best["step"] == run.step:
            control.should_save = True


def _evaluate(run: TrainingRun, world: World) -> dict[str, float]:
    model = run.model.module if world.mode == "ddp" else run.model
    rng = capture_rng(run.generator)
    was_training = model.training
    model.eval()
    where = f"{run.config.data.factory} evaluate()"
    try:
        with torch.no_grad(), factory_errors("data.factory", where):
            values = run.data.evaluate(model, run.device)
    finally:
        model.train(was_training)
        restore_rng(rng, run.generator, need_cuda=run.device.type == "cuda")
    return check_metrics(values, where)


def _record(evaluations: dict[str, list], step: int, metrics: dict[str, float], factory: str) -> None:
    """Append one evaluation to ``evaluations``, after checking its names: each a tensor name of
    the checkpoint, and the same as at the run's earlier evaluations (a name added or gone
    would leave the saved lists of unequal lengths, which no load accepts)."""
    for name in metrics:
        if name == "step" or not METRIC_NAME.match(name):
            raise MetricsError(
                f"{factory} evaluate() returned a metric named {name!r}: during training a metric is named "
                "like a Python variable (letters, digits, '_', '.', '-'; up to 64), or 'set/metric' for one of "
                "several evaluation sets, and not 'step' (it names a tensor of the checkpoint)"
            )
    names = set(evaluations) - {"step"}
    if evaluations["step"] and names != set(metrics):
        added, gone = sorted(set(metrics) - names), sorted(names - set(metrics))
        change = "; ".join(
            part
            for part in (
                f"new: {', '.join(added)}" if added else "",
                f"missing: {', '.join(gone)}" if gone else "",
            )
            if part
        )
        raise MetricsError(
            f"{factory} evaluate() returned other metrics at step {step} than at the run's earlier evaluations "
            f"({change}): a run's evaluations keep the same names; nothing of step {step} was recorded"
        )
    evaluations["step"].append(step)
    for name, value in metrics.items():
        evaluations.setdefault(name, []).append(value)

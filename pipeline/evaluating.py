"""Evaluation during training (``training.eval_every``): the task's ``evaluate`` on the live
model, its values in ``run.evaluations``, and whether the step must be saved as the new best.

``evaluate(model, device)`` is the function script 04 calls on a checkpoint. Here it sees the
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
from typing import Callable

import torch

from .checkpoint import best_record
from .config import METRIC_NAME
from .errors import ConfigError, MetricsError
from .evaluate import check_metrics
from .factories import factory_errors
from .rng import capture_rng, restore_rng
from .run import TrainingRun
from .world import World

__all__ = ["check_evaluable", "evaluate_if_due", "Evaluated"]


def check_evaluable(run: TrainingRun) -> None:
    """Refuse ``training.eval_every`` for a task without ``evaluate`` before the first step."""
    config = run.config
    if config.training.eval_every and not callable(getattr(run.data, "evaluate", None)):
        raise ConfigError(
            f"{config.source}: training.eval_every is {config.training.eval_every}, but the task "
            f"({config.data.factory}) has no evaluate(model, device): set training.eval_every: 0, or give "
            "the task an evaluate method"
        )


@dataclass(frozen=True, slots=True)
class Evaluated:
    """What an evaluation asks of the loop after a step."""

    save: bool = False
    """Save this step even off ``checkpoint.every``: it is the new best."""
    refusal: str | None = None
    """``checkpoint.best_metric`` is not among the values: save this step, then stop with this."""
    fix: str | None = None
    """With ``refusal``: the ``--set`` item (``key=value``) the printed resume command carries."""


def evaluate_if_due(run: TrainingRun, world: World, say: Callable[[str], None]) -> Evaluated:
    """After an optimizer step: evaluate when ``run.step`` is a multiple of ``training.eval_every``
    or ``training.max_steps``, record the values, and say them (``say``: the first rank's
    report)."""
    every, step = run.config.training.eval_every, run.step
    if not every or (step % every and step != run.config.training.max_steps):
        return Evaluated()
    metrics = _evaluate(run, world)
    _record(run.evaluations, step, metrics, run.config.data.factory)
    say(f"step {step} evaluation: " + ", ".join(f"{name} {value:.6g}" for name, value in metrics.items()))
    checkpoint = run.config.checkpoint
    if checkpoint.best_metric and checkpoint.best_metric not in metrics:
        names = sorted(metrics)
        # The printed resume command sets the name closest to the misspelt one (else the first).
        instead = (get_close_matches(checkpoint.best_metric, names, n=1) or names)[0]
        return Evaluated(
            save=True,
            refusal=f"{run.config.source}: checkpoint.best_metric is {checkpoint.best_metric!r}, but the task's "
            f"evaluate returned {', '.join(names)}: set checkpoint.best_metric to one of them",
            fix=f"checkpoint.best_metric={instead}",
        )
    best = best_record(run.evaluations, checkpoint.best_metric, checkpoint.best_mode)
    return Evaluated(save=best is not None and best["step"] == step)


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
    for name in metrics:
        if name == "step" or not METRIC_NAME.match(name):
            raise MetricsError(
                f"{factory} evaluate() returned a metric named {name!r}: during training a metric's name must "
                f"match {METRIC_NAME.pattern} and not be 'step' (it names a tensor of the checkpoint)"
            )
    names = set(evaluations) - {"step"}
    if evaluations["step"] and names != set(metrics):
        raise MetricsError(
            f"{factory} evaluate() returned {', '.join(sorted(metrics))} at step {step}, "
            f"{', '.join(sorted(names))} before: it must return the same metrics every time"
        )
    evaluations["step"].append(step)
    for name, value in metrics.items():
        evaluations.setdefault(name, []).append(value)

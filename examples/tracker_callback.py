"""A callback that sends a run's history to another tracker, each step once, a resume included.

    training:
      callbacks: [examples.tracker_callback:jsonl]     # or :wandb_offline, :trackio

The TensorBoard traces are rebuilt from the checkpoint at every start; a tracker you only
append to cannot be, so this callback sends only what a committed checkpoint holds: at each
``on_save`` the steps (and evaluations) up to that checkpoint's step. A run killed after step
57 with its last checkpoint at step 50 resumes from 50: steps 51-57 were never sent, and are
sent once, when the resumed run commits them. Nothing of it is saved in the checkpoint: a
start knows that everything up to the step it resumes from was sent by the process that
committed it. (A kill between a commit and its ``on_save``, which for a background save comes
at the end of the step that finds it committed, leaves those steps unsent, never sent twice.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

Log = Callable[[dict[str, float], int], None]
"""``log(values, step)``: what the tracker is given, one call per step."""


class HistoryTracker:
    """Sends ``run.history`` and ``run.evaluations`` to ``log``, committed steps only."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.sent: int | None = None
        """The last step sent: the step this process started from, once it trains."""

    def on_step_end(self, run: Any, control: Any) -> None:
        if self.sent is None:
            self.sent = run.step - 1  # sent, at its saves, by the process that trained it

    def on_save(self, run: Any, checkpoint: Any, control: Any) -> None:
        if self.sent is None:
            self.sent = checkpoint.step
        history, evaluations = run.history, run.evaluations
        names = [name for name in evaluations if name != "step"]
        evaluated = dict(zip(evaluations["step"], range(len(evaluations["step"]))))
        for index, step in enumerate(history["step"]):
            if self.sent < step <= checkpoint.step:
                values = {f"train/{key}": history[key][index] for key in ("loss", "lr")}
                if step in evaluated:
                    values.update({f"eval/{name}": evaluations[name][evaluated[step]] for name in names})
                self.log(values, step)
        self.sent = max(self.sent, checkpoint.step)


def jsonl(config: Any) -> HistoryTracker:
    """One JSON line per step in ``<checkpoint folder>-tracker.jsonl`` beside it (or the
    file ``TRACKER_FILE`` names): the simplest tracker, and the one the tests read."""
    folder = Path(config.checkpoint.dir)
    path = Path(os.environ.get("TRACKER_FILE") or folder.with_name(f"{folder.name}-tracker.jsonl"))

    def log(values: dict[str, float], step: int) -> None:
        with path.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"step": step, **values}) + "\n")

    return HistoryTracker(log)


def wandb_offline(config: Any) -> HistoryTracker:
    """Weights & Biases in offline mode (``wandb sync`` uploads it later)."""
    import wandb

    run = wandb.init(mode="offline", project=config.model.name, config=config.to_dict())
    return HistoryTracker(lambda values, step: run.log(values, step=step))


def trackio(config: Any) -> HistoryTracker:
    """trackio, Hugging Face's local-first tracker."""
    import trackio as tracker

    tracker.init(project=config.model.name, config=config.to_dict())
    return HistoryTracker(lambda values, step: tracker.log(values, step=step))
